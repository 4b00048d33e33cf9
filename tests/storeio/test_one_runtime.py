"""Over kvtier's own source: every client calls the store through the one store runtime
(kvtier/storeio/). The breaker-guarded call, an op's settling and the staged read are each
written once; a second copy (a client that calls `breaker.failed` itself, or fishes
`settled` out of an exception) fails here. `integrations/` imports nothing of
`controller/`, and the controller nothing of the tree."""

import ast
from collections import Counter
from pathlib import Path

import kvtier

ROOT = Path(kvtier.__file__).parent


def sources(under: str = "") -> dict[str, ast.Module]:
    return {
        str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
        for p in sorted((ROOT / under).rglob("*.py"))
    }


def functions(tree: ast.Module):
    """(qualified name, node) of every function, nested ones too."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


# the Breaker's methods, by how many arguments each takes: a call of that name and shape
# on any object (however the breaker is named there) is a call of the breaker; others of
# the name (`LayerWaiter.failed()`, `PollReport.abandoned()`) take none
BREAKER_ARGS = {"admit": 0, "succeeded": 0, "failed": 1, "abandoned": 1}


def breaker_calls(method: str) -> list[str]:
    """Where `<...>.<method>(...)` is called with the Breaker method's arguments, outside
    the breaker itself: "file:function" per call."""
    found = []
    for path, tree in sources().items():
        if path == "storeio/breaker.py":
            continue
        for name, fn in functions(tree):
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == method
                    and len(node.args) + len(node.keywords) == BREAKER_ARGS[method]
                    and not any(  # a nested function's own calls count for it alone
                        node in ast.walk(inner)
                        for _, inner in functions(fn)
                        if inner is not fn
                    )
                ):
                    found.append(f"{path}:{name}")
    return found


def definitions() -> Counter:
    counts = Counter()
    for tree in sources().values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                counts[node.name] += 1
    return counts


def test_the_breaker_guarded_store_call_is_written_once():
    """The breaker learns a call's outcome in `store_call` alone, and an abandoned call in
    `settle` alone; the breaker admits whole ops only where a prefetch or a backup starts."""
    call = "storeio/call.py:store_call"
    direct = "storeio/call.py:direct_ended"  # a call made off the loop (file_direct.py)
    assert sorted(breaker_calls("failed")) == [direct, call]
    assert sorted(breaker_calls("succeeded")) == [direct, call]
    assert sorted(breaker_calls("abandoned")) == [direct, "storeio/call.py:settle"]
    assert sorted(breaker_calls("admit")) == [
        "controller/side_prefetch.py:_calls",  # a hybrid model's prefetch starts
        "controller/storage.py:StorageWorker._prefetch_pages",
        "storeio/call.py:direct_admitted",
        call,
        "storeio/writes.py:backup_calls",
    ]


def test_the_staged_read_and_the_ops_lifetime_are_written_once():
    counts = definitions()
    for name in (
        "store_call",
        "guarded",
        "lifetime",
        "read_staged",
        "StagingPool",
        "StoreLoop",
        "Breaker",
        "Phase",
        "PageKeys",
        "BackupOp",
    ):
        assert counts[name] == 1, (name, counts[name])
    for retired in ("LoopThread", "_guarded", "breaker_for"):
        assert counts[retired] == 0, retired
    staging = [
        f"{path}:{name}"
        for path, tree in sources().items()
        for name, fn in functions(tree)
        if any(
            isinstance(n, ast.Call) and ast.unparse(n.func).endswith("pool.take")
            for n in ast.walk(fn)
        )
    ]
    assert staging == ["storeio/call.py:read_staged"]


def test_reads_into_memory_are_made_in_known_places_only():
    """`batch_get_into` (a read into a caller's memory) is named only by the staged read
    (an engine's memory) and the reads into host pages of the cache and the linker, whose
    pages an abandoned read keeps out of use: a new reader into memory is a second copy
    of one of them, or must be added here knowingly."""
    readers = sorted(
        {
            f"{path}:{name}"
            for path, tree in sources().items()
            if not path.startswith(("backends/", "bench/"))
            for name, fn in functions(tree)
            for node in ast.walk(fn)
            if isinstance(node, ast.Attribute) and node.attr == "batch_get_into"
        }
    )
    assert readers == [
        # a hybrid prefetch reads into buffers of its own (an abandoned read writes nothing
        # anybody reads), copied into host slots once verified
        "controller/side_prefetch.py:_find_and_read",  # in its nested have()
        "controller/side_prefetch.py:_find_and_read.have",
        "controller/storage.py:StorageWorker._read",
        "controller/store_pages.py:read",
        # the linker's host pages (page_first), else buffers copied in once verified
        "integrations/sglang/linker/store_io.py:LinkerStore._read_own",
        "storeio/call.py:read_staged",
    ]


def test_settled_is_a_declared_field_never_fished_out():
    """`StoreTimeout.settled` is declared (errors.py); no `getattr(exc, "settled", ...)`."""
    from kvtier.errors import StoreAbandoned, StoreTimeout

    assert StoreTimeout("x").settled is None
    assert StoreAbandoned("x").settled is None
    fished = [
        path
        for path, tree in sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "settled"
    ]
    assert fished == []


def imports(under: str) -> list[tuple[str, str]]:
    """(file, module) of every import under `under`, inside functions and
    TYPE_CHECKING blocks too; `from kvtier import x` names kvtier.x."""
    found = []
    for path, tree in sources(under).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(path, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{under}/{path}: a relative import"
                found.append((path, node.module))
                found += [(path, f"{node.module}.{a.name}") for a in node.names]
    return found


def test_integrations_import_nothing_of_the_controller():
    bad = [
        (path, module)
        for path, module in imports("integrations")
        if module == "kvtier.controller" or module.startswith("kvtier.controller.")
    ]
    assert bad == []
    assert imports("integrations"), "no import found: the walk is broken"


def test_the_controller_imports_nothing_of_the_tree():
    """The tree helpers store pages need (`tokens_above`, `lead_in`) are the cache's."""
    bad = [
        (path, module)
        for path, module in imports("controller")
        if module == "kvtier.tree" or module.startswith("kvtier.tree.")
    ]
    assert bad == []


def test_the_store_runtime_sits_below_controller_and_integrations():
    bad = [
        (path, module)
        for path, module in imports("storeio")
        if module.startswith(
            ("kvtier.controller", "kvtier.integrations", "kvtier.cache")
        )
    ]
    assert bad == []
