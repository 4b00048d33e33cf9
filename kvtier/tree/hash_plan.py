"""A node's page hash chain: the plan a tree hands to another thread to compute
(`RadixTree.hashing_of`), and how a node keeps the hashes it is given, adopts, or splits."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING
from collections.abc import Callable

from kvtier.tree.chain_memo import ChainMemo

if TYPE_CHECKING:
    from kvtier.tree.node import TreeNode


class HashPlan:
    """The chains of `nodes` (root-down), from their token arrays and known first hashes
    taken when it was made, continuing from `prev`: safe to run on another thread. Hashed
    through the tree's `ChainMemo`: what it made lately is not hashed again."""

    __slots__ = ("nodes", "parts", "prev", "page_size", "namespace_id", "algo", "memo")

    def __init__(
        self,
        nodes: list[TreeNode],
        parts: list[tuple],
        prev: bytes | None,
        page_size: int,
        namespace_id: str,
        algo: str,
        memo: ChainMemo,
    ) -> None:
        self.nodes, self.parts, self.prev = nodes, parts, prev
        self.page_size, self.namespace_id, self.algo, self.memo = (
            page_size,
            namespace_id,
            algo,
            memo,
        )

    def __call__(self) -> list[list[bytes]]:
        out, prev, ps, hashes = [], self.prev, self.page_size, self.memo.page_hashes
        for tokens, extra_key, known in self.parts:
            if known:
                chain = known + hashes(
                    tokens[len(known) * ps :],
                    ps,
                    self.namespace_id,
                    extra_key,
                    known[-1],
                    self.algo,
                )
            else:
                chain = hashes(
                    tokens, ps, self.namespace_id, extra_key, prev, self.algo
                )
            out.append(chain)
            prev = chain[-1]
        return out


def plan_chains(
    node: TreeNode,
    root: TreeNode,
    page_size: int,
    namespace_id: str,
    algo: str,
    memo: ChainMemo,
) -> HashPlan | None:
    """What computes the chains of `node` and its ancestors not hashed yet, root-down;
    None when `node`'s is known."""
    pending, n = [], node
    while n is not root and n.hashes is None:
        pending.append(n)
        n = n.parent
    if not pending:
        return None
    pending.reverse()
    prev = n.hashes[-1] if n is not root else None
    return HashPlan(
        pending,
        [(p.key.tokens, p.key.extra_key, p.hash_prefix) for p in pending],
        prev,
        page_size,
        namespace_id,
        algo,
        memo,
    )


def chain_below(
    anchor: TreeNode,
    tokens,
    extra_key: str | None,
    root: TreeNode,
    page_size: int,
    namespace_id: str,
    algo: str,
    memo: ChainMemo,
) -> Callable[[], list[bytes]]:
    """A function that computes the chain of `tokens`' pages as they would hang below
    `anchor`, to run on another thread (with the anchor's own chain, where not known yet)."""
    if anchor is root:
        return partial(
            memo.page_hashes, tokens, page_size, namespace_id, extra_key, None, algo
        )
    if anchor.hashes is not None:
        return partial(
            memo.page_hashes,
            tokens,
            page_size,
            namespace_id,
            extra_key,
            anchor.hashes[-1],
            algo,
        )
    plan = plan_chains(anchor, root, page_size, namespace_id, algo, memo)
    return lambda: memo.page_hashes(
        tokens, page_size, namespace_id, extra_key, plan()[-1][-1], algo
    )


def take_known(node: TreeNode, known: list[bytes], page_size: int) -> None:
    """A new node starts with pages whose hashes the caller knows: keep them; the rest of
    its chain is made when first needed (`hashing_of`: on the storage thread). A node whose
    chain is known already (an observer asked for it as the node appeared) keeps it:
    `hash_prefix` is only for a node whose `hashes` are not known."""
    if not known or node.hashes is not None:
        return
    if len(known) == len(node) // page_size:
        node.hashes = known
    else:
        node.hash_prefix = known


def adopt(node: TreeNode, hashes: list[bytes], page_size: int) -> None:
    """Keep a chain computed for `node`, which may have been split since: it kept its deeper
    half, whose pages are the chain's last ones."""
    pages = len(node) // page_size
    if node.hashes is None and len(hashes) >= pages:
        node.hashes, node.hash_prefix = list(hashes[len(hashes) - pages :]), None


def split_hashes(upper: TreeNode, child: TreeNode, pages: int) -> None:
    """`child`'s edge was cut after `pages` pages into `upper` and itself: its known
    hashes (whole chain or leading part) go with the pages they belong to."""
    if child.hashes is not None:
        upper.hashes, child.hashes = child.hashes[:pages], child.hashes[pages:]
    elif child.hash_prefix is not None:
        known = child.hash_prefix
        if len(known) >= pages:
            upper.hashes, child.hash_prefix = known[:pages], known[pages:] or None
        else:
            upper.hash_prefix, child.hash_prefix = known, None
