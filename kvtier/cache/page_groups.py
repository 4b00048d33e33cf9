"""Where a tree node's pages sit among store pages of several device pages
(`store.page_tokens`, kvtier/controller/store_pages.py): the cache owns the tree, so what
is read off its nodes for the controller is read here."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvtier.tree import TreeNode


def tokens_above(node: TreeNode) -> int:
    """Tokens on the path above `node` (a node an eviction just removed keeps its parent)."""
    n, depth = node.parent, 0
    while n is not None and n.parent is not None:
        depth += len(n)
        n = n.parent
    return depth


def lead_in(node: TreeNode, pages: int, page_size: int, host: int) -> np.ndarray:
    """Host pages of the last `pages` pages above `node`, oldest first (fewer where an
    ancestor has no host copy: then its first store page is not stored)."""
    want, parts, n = pages * page_size, [], node.parent
    while want > 0 and n is not None and n.parent is not None:
        slots = n.values[host]
        if slots is None:
            break
        take = min(want, len(slots))
        parts.append(slots[len(slots) - take :: page_size] // page_size)
        want -= take
        n = n.parent
    return np.concatenate(parts[::-1]) if parts else np.empty(0, np.int64)
