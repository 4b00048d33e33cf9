"""`tierctl replay`: run the reference engine on a workload and print what each tier did."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from kvtier.errors import KvtierConfigError


# kvtier is installed from a clone, not PyPI: its `plot` extra is matplotlib
PLOT_INSTALL = (
    "pip install matplotlib (or, in a kvtier clone, pip install -e '.[plot]')"
)


def add_arguments(p) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="a YAML file, or a shipped config by name: default, memory, redis, redis-cluster, s3",
    )
    p.add_argument("--workload", default="multiturn", help="multiturn | docqa | agent")
    p.add_argument(
        "--trace", default=None, help="a JSONL trace instead of a built-in workload"
    )
    p.add_argument(
        "--requests", type=int, default=60, help="turns to replay (default 60)"
    )
    p.add_argument(
        "--batch", type=int, default=4, help="requests per forward (default 4)"
    )
    p.add_argument(
        "--verify",
        nargs="?",
        const=1.0,
        type=float,
        default=None,
        metavar="FRACTION",
        help="check every request (or a FRACTION of them) against an uncached run",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="write cumulative hit rate per tier (needs matplotlib)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--hints",
        action="store_true",
        help="pin each session at its tool-call pauses and prefetch it before it resumes; "
        "the same trace also runs without hints, and the last line compares the two",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        choices=("tiny", "hybrid"),
        default=None,
        help="the reference model: tiny (full attention) or hybrid (full, sliding-window and "
        "recurrent layers); default: the config's model.kind (tiny)",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        metavar="N",
        help="prefill rate of the model this replay stands for: store loads expected to take longer "
        "than recomputing at this rate are skipped (default: never skip)",
    )


def check_arguments(args) -> None:
    """Refuse what would be silently ignored or fail only after the whole replay."""
    if args.verify is not None and not 0 < args.verify <= 1:
        raise KvtierConfigError(
            f"--verify {args.verify}: a fraction in (0, 1] (--verify alone checks every request)"
        )
    if args.trace and (args.requests != 60 or args.workload != "multiturn"):
        raise KvtierConfigError(
            "--trace replays its own turns: --requests and --workload do not apply to it"
        )
    if args.seed < 0:
        raise KvtierConfigError(
            f"--seed {args.seed}: must be an integer >= 0 (the model's weights and the workload)"
        )
    if args.requests < 1:
        raise KvtierConfigError(f"--requests {args.requests}: must be >= 1")
    if getattr(args, "batch", 1) < 1:
        raise KvtierConfigError(
            f"--batch {args.batch}: must be >= 1 (requests per forward)"
        )
    if args.trace and not os.path.isfile(args.trace):
        raise KvtierConfigError(
            f"--trace {args.trace!r}: no such file (a JSONL trace, one turn per line: README)"
        )
    rate = getattr(args, "prefill_tokens_per_s", None)
    if rate is not None and not 0 < rate < float("inf"):
        raise KvtierConfigError(
            f"--prefill-tokens-per-s {rate}: must be a number of tokens per second > 0"
        )
    if args.plot and getattr(args, "hints", False):
        raise KvtierConfigError(
            "--plot draws one run's hits; --hints replays two (with hints and without): "
            "use one of them"
        )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise KvtierConfigError(
                f"--plot needs matplotlib: {PLOT_INSTALL}"
            ) from None
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise KvtierConfigError(
                f"--plot {args.plot!r}: cannot write there ({folder} is not a writable "
                "directory); checked before the replay runs"
            )


def run(args, default_config: str) -> int:
    check_arguments(args)
    from kvtier.cache import TieredCache
    from kvtier.config import load_config
    from kvtier.engine.engine import Engine, timed_run
    from kvtier.engine.hybrid_engine import HybridEngine, hybrid_cache
    from kvtier.engine.workloads import generate, load_trace

    config = load_config(args.config, base=default_config)
    model = model_of(config, args.seed, getattr(args, "model", None))
    config = with_weights(config, model)
    turns = (
        load_trace(args.trace, model.config.vocab)
        if args.trace
        else generate(args.workload, args.requests, model.config.vocab, args.seed)
    )
    hybrid = model.kind == "hybrid"
    if getattr(args, "hints", False):
        if hybrid:
            raise KvtierConfigError(
                "--hints with the hybrid model: the hinted replay runs the full-attention "
                "engine only (use --model tiny)"
            )
        return _run_hints(args, model, config, turns)
    cache = hybrid_cache(config, model) if hybrid else TieredCache(config)
    try:
        cache.set_prefill_rate(getattr(args, "prefill_tokens_per_s", None))
        engine = (
            HybridEngine(cache, model, max_batch=args.batch)
            if hybrid
            else Engine(cache, model, max_batch=args.batch)
        )
        progress = None if args.json or not sys.stderr.isatty() else _progress
        results, seconds = timed_run(
            engine, turns, keep_logits=args.verify is not None, progress=progress
        )
        if progress:
            print(file=sys.stderr)
        checked, worst, wrong = _verify(model, results, args.verify)
        stats = cache.stats()
    finally:
        cache.close()
    summary = _summary(results, seconds, stats, config.pool.page_size, checked, worst)
    if hybrid:
        summary["hybrid"] = _hybrid_summary(
            results, config.pool.page_size, summary, stats
        )
    summary["verify_failures"] = wrong
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_table(summary))
    if args.plot:  # after the table: a plot that fails loses nothing
        _plot(results, args.plot, summary, args.trace or args.workload)
    return (
        1 if wrong or summary["failed_requests"] or not summary["counts_add_up"] else 0
    )


def model_of(config, seed: int, kind: str | None = None):
    """The reference model `kind` names (`--model`), else the config's `model` section."""
    from kvtier.engine.model import build_model

    return build_model(kind or config.model.kind, seed, config.model.window)


def _run_hints(args, model, config, turns) -> int:
    """`--hints`: the trace with the pause hints, then without them (each on a cache of
    its own); the table is the hinted run's, the last line compares resumed turns."""
    import time

    from kvtier.cache import TieredCache
    from kvtier.engine.engine import Engine
    from kvtier.engine.hinted import replay, resumed_ratio

    keep = args.verify is not None
    runs = {}
    for hints in (
        True,
        False,
    ):  # hinted first: the store it leaves helps only the other
        cache = TieredCache(config)
        try:
            cache.set_prefill_rate(getattr(args, "prefill_tokens_per_s", None))
            engine = Engine(cache, model, max_batch=args.batch)
            start = time.perf_counter()
            run = replay(engine, turns, hints, keep_logits=keep)
            seconds = time.perf_counter() - start
            stats = cache.stats()
        finally:
            cache.close()
        checked, worst, wrong = _verify(model, run.results, args.verify)
        runs[hints] = (run, seconds, stats, checked, worst, wrong)
    run, seconds, stats, checked, worst, wrong = runs[True]
    ps = config.pool.page_size
    summary = _summary(run.results, seconds, stats, ps, checked, worst)
    base = runs[False]
    summary["verify_failures"] = wrong + base[5]
    summary["verified_requests"] += base[3]
    summary["max_logit_diff"] = max(worst, base[4])
    with_hints, without = resumed_ratio(run, ps), resumed_ratio(base[0], ps)
    summary["hints"] = {
        "resumed_turns": len(run.resumed),
        "resumed_ratio_with_hints": with_hints,
        "resumed_ratio_without": without,
        "pins": run.pins,
        "pins_refused": run.pins_refused,
        "prefetches": run.prefetches,
        "cache": stats.get("hints", {}),
    }
    failed = summary["failed_requests"] + sum(
        r.error is not None for r in base[0].results
    )
    summary["failed_requests"] = failed
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_table(summary))
        print(
            f"hints: resumed turns {with_hints:.2f}x bound with hints, "
            f"{without:.2f}x without"
        )
    bad = summary["verify_failures"] or failed or not summary["counts_add_up"]
    return 1 if bad else 0


def with_weights(config, model):
    """The namespace names these weights: KV of another seed is never served to them."""
    ns = dataclasses.replace(
        config.namespace, revision=config.namespace.revision or model.fingerprint()
    )
    return dataclasses.replace(config, namespace=ns)


def _verify(model, results, fraction) -> tuple[int, float, list[str]]:
    """(requests checked, worst logit diff, one line per request that differs)."""
    from kvtier.engine.engine import verify

    if fraction is None:
        return 0, 0.0, []
    step = max(1, round(1 / fraction)) if fraction > 0 else len(results) + 1
    worst, checked, wrong = 0.0, 0, []
    for r in results[::step]:
        if r.error is not None:
            continue
        try:
            worst = max(worst, verify(model, r))
        except AssertionError as exc:
            wrong.append(str(exc).splitlines()[0])
        checked += 1
    return checked, worst, wrong


def _summary(results, seconds, stats, page_size, checked, worst) -> dict:
    from kvtier.engine.engine import infinite_hit_rate

    prompt = sum(len(r.prompt) for r in results)
    dev, host, storage = (
        sum(getattr(r, f) for r in results)
        for f in ("device_hit", "host_hit", "storage_hit")
    )
    computed = sum(r.computed for r in results)
    c = stats["counters"]
    return {
        "failed_requests": sum(r.error is not None for r in results),
        "errors": [f"{r.session}/{r.turn}: {r.error}" for r in results if r.error][:5],
        "counts_add_up": dev + host + storage + computed == prompt,
        "requests": len(results),
        "prompt_tokens": prompt,
        "hit_tokens": {"device": dev, "host": host, "storage": storage},
        "hit_rate": (dev + host + storage) / max(prompt, 1),
        "infinite_cache_hit_rate": infinite_hit_rate(results, page_size),
        "prefill_tokens_computed": computed,
        "prefill_tokens_without_cache": prompt,
        "bytes": {
            "device_to_host": c["d2h_bytes"],
            "host_to_device": c["h2d_bytes"],
            "host_to_store": c["l3_write_bytes"],
            "store_to_host": c["l3_read_bytes"],
        },
        "seconds": seconds,  # throughput counts the requests served, not those that failed
        "requests_per_s": sum(r.error is None for r in results) / seconds,
        "prompt_tokens_per_s": sum(len(r.prompt) for r in results if r.error is None)
        / seconds,
        "verified_requests": checked,
        "max_logit_diff": worst,
        "store": {
            k: stats.get("store", {}).get(k, 0)
            for k in (
                "hits",
                "misses",
                "frame_failures",
                "errors",
                "timeouts",
                "set_failures",
                "store_down",
                "breaker_trips",
                "calls_skipped_store_down",
                "prefetch_skipped_slow",
            )
        },
    }


def _hybrid_summary(results, page_size: int, summary: dict, stats: dict) -> dict:
    """What each side component restored, and the hit rate of a cache that never evicts
    when only lengths with a state (and their window) are restorable."""
    from kvtier.engine.bounds import finish_state_points, restorable_hit_rate

    pairs = [(r.prompt, r.prompt + r.output[:-1]) for r in results if r.error is None]
    bound = restorable_hit_rate(pairs, page_size, finish_state_points)
    swa = sum(r.swa_hit for r in results)
    on_device = sum(r.swa_device for r in results)
    h = summary["hit_tokens"]
    return {
        "full_tokens": dict(h),
        "swa_window_tokens": {"device": on_device, "loaded": swa - on_device},
        "mamba_states": sum(r.state_hit for r in results),
        # what restores read from each tier, per side component (the cache's count)
        "side_hits": {
            c: {"device": v["hits_device"], "host": v["hits_host"]}
            for c, v in stats.get("components", {}).items()
        },
        "requests_with_hit": sum(r.cached > 0 for r in results),
        "restorable_bound": bound,
        "hit_rate_over_bound": summary["hit_rate"] / bound if bound else None,
    }


def _hybrid_lines(s: dict) -> list[str]:
    hy = s["hybrid"]
    f, w = hy["full_tokens"], hy["swa_window_tokens"]
    ratio = hy["hit_rate_over_bound"]
    side = hy["side_hits"]

    def tiers(c: str) -> str:
        t = side.get(c, {"device": 0, "host": 0})
        return f"read from device {t['device']}, host {t['host']}"

    return [
        f"components   full        device {f['device']}, host {f['host']}, store {f['storage']} tokens",
        f"             swa         {w['device'] + w['loaded']} window tokens restored "
        f"({w['device']} held on device, {w['loaded']} loaded or copied; {tiers('swa')})",
        f"             mamba       {hy['mamba_states']} states restored "
        f"({hy['requests_with_hit']} requests hit; {tiers('mamba')})",
        f"hybrid bound             {hy['restorable_bound']:.1%}   (restorable lengths only, from an "
        f"empty start: a warm store can beat it); hit rate {'n/a' if ratio is None else f'{ratio:.2f}x'} of it",
    ]


def _table(s: dict) -> str:
    h = s["hit_tokens"]
    p = max(s["prompt_tokens"], 1)
    b = s["bytes"]
    lines = [
        f"requests                 {s['requests']}",
        f"prompt tokens            {s['prompt_tokens']}",
        f"hit tokens   device      {h['device']:>8}  ({h['device'] / p:.1%})",
        f"             host        {h['host']:>8}  ({h['host'] / p:.1%})",
        f"             store       {h['storage']:>8}  ({h['storage'] / p:.1%})",
        f"hit rate                 {s['hit_rate']:.1%}   (an infinite cache that starts empty: {s['infinite_cache_hit_rate']:.1%})",
        *(_hybrid_lines(s) if "hybrid" in s else ()),
        f"prefill computed         {s['prefill_tokens_computed']} tokens (without cache: {s['prefill_tokens_without_cache']})",
        f"bytes moved  dev->host   {_mib(b['device_to_host'])}   host->dev {_mib(b['host_to_device'])}",
        f"             host->store {_mib(b['host_to_store'])}   store->host {_mib(b['store_to_host'])}",
        f"throughput               {s['requests_per_s']:.1f} req/s, {s['prompt_tokens_per_s']:.0f} prompt tokens/s",
    ]
    st = s["store"]
    if st["errors"] or st["frame_failures"] or st["timeouts"] or st["set_failures"]:
        lines.append(
            f"store trouble            {st['errors']} failed calls, {st['timeouts']} timeouts, "
            f"{st['set_failures']} pages not stored, {st['frame_failures']} pages that did not verify "
            f"(each a miss; see the log)"
        )
    if st["breaker_trips"]:
        state = "DOWN at the end" if st["store_down"] else "up again at the end"
        lines.append(
            f"store down               {st['breaker_trips']} times ({state}); "
            f"{st['calls_skipped_store_down']} calls skipped instead of waiting for it"
        )
    if st["prefetch_skipped_slow"]:
        lines.append(
            f"store too slow           {st['prefetch_skipped_slow']} prefetches skipped: loading was "
            f"expected to take longer than recomputing"
        )
    if s["failed_requests"]:
        lines.append(
            f"failed requests          {s['failed_requests']} (released); first: {s['errors'][0]}"
        )
    if not s["counts_add_up"]:
        lines.append(
            "COUNTS DO NOT ADD UP      device + host + store + computed != prompt tokens"
        )
    wrong = s.get("verify_failures") or []
    if wrong:
        lines.append(
            f"VERIFY FAILED            {len(wrong)} of {s['verified_requests']} requests differ from the "
            f"uncached run; first: {wrong[0]}"
        )
    elif s["verified_requests"]:
        lines.append(
            f"verified                 {s['verified_requests']} requests match the uncached run "
            f"(max |logit diff| {s['max_logit_diff']:.1e})"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:8.1f} MiB"


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(
        f"\rreplay [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
    )
    sys.stderr.flush()


def _plot(results, path: str, summary: dict, workload: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"tierctl: --plot needs matplotlib: {PLOT_INSTALL}") from None
    totals = {"device": 0, "host": 0, "store": 0}
    prompt, series = 0, {k: [] for k in totals}
    for r in results:
        prompt += len(r.prompt)
        for k, v in (
            ("device", r.device_hit),
            ("host", r.host_hit),
            ("store", r.storage_hit),
        ):
            totals[k] += v
            series[k].append(totals[k] / prompt)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(1, len(results) + 1)
    for k, ys in series.items():
        ax.plot(xs, ys, label=k)
    ax.plot(xs, [sum(t) for t in zip(*series.values())], label="total", color="black")
    ax.axhline(
        summary["infinite_cache_hit_rate"],
        linestyle="--",
        color="grey",
        label=f"bound: an infinite cache ({summary['infinite_cache_hit_rate']:.1%})",
    )
    ax.set_xlabel("requests")
    ax.set_ylabel("cumulative hit rate (of prompt tokens)")
    ax.set_title(
        f"kvtier replay of {os.path.basename(workload)}: where prefixes were found"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
