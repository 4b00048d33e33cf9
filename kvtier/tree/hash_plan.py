"""The hash chains a tree hands to another thread to compute (`RadixTree.hashing_of`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.hashing import page_hashes

if TYPE_CHECKING:
    from kvtier.tree.node import TreeNode


class HashPlan:
    """The chains of `nodes` (root-down), from their token arrays and known first hashes
    taken when it was made, continuing from `prev`: safe to run on another thread."""

    __slots__ = ("nodes", "parts", "prev", "page_size", "namespace_id", "algo")

    def __init__(self, nodes: list[TreeNode], parts: list[tuple], prev: bytes | None, page_size: int,
                 namespace_id: str, algo: str) -> None:
        self.nodes, self.parts, self.prev = nodes, parts, prev
        self.page_size, self.namespace_id, self.algo = page_size, namespace_id, algo

    def __call__(self) -> list[list[bytes]]:
        out, prev, ps = [], self.prev, self.page_size
        for tokens, extra_key, known in self.parts:
            if known:
                chain = known + page_hashes(tokens[len(known) * ps:], ps, self.namespace_id, extra_key, known[-1],
                                            self.algo)
            else:
                chain = page_hashes(tokens, ps, self.namespace_id, extra_key, prev, self.algo)
            out.append(chain)
            prev = chain[-1]
        return out
