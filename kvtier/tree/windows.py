"""SWA windows in a hybrid tree: which nodes a change can concern, which SWA KV is still
in a live window, which locks reach a node (docs/design.md, "Hybrid models: components").

A *live window* is the `wp` tokens (the SWA window in whole pages) that end at a point a
match can stop at and whose SWA KV is all present (on device or host), or that end at a
lock's node. Match points are every page boundary without a MAMBA component, and the ends
of nodes holding a Mamba state (on either tier) with one. SWA KV in no live window can
never be used again: the tree frees it.
"""

from __future__ import annotations

from kvtier.tree.node import HybridNode


def swa_present(node: HybridNode) -> bool:
    return node.swa[0] is not None or node.swa[1] is not None


def near(node: HybridNode, lo: int, hi: int, root: HybridNode) -> list[HybridNode]:
    """`node` (unless it is the root), its ancestors that end after `lo`, and its
    descendants that start before `hi`: every node a window through [lo, hi) can touch."""
    out = []
    n = node
    while n is not root and n.end > lo:
        out.append(n)
        n = n.parent
    stack = [c for c in node.children.values() if c.start < hi]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(c for c in n.children.values() if c.start < hi)
    return out


def is_live(node: HybridNode, wp: int, mamba: bool, root: HybridNode) -> bool:
    """Is some token of `node` in a live window? (`node` holds SWA KV on some tier.)

    The window that ends at L covers [L - wp, L); it reaches into `node` = [s, e) when
    s < L < e + wp, so L is the end of `node` or of a descendant, or (without Mamba) a page
    boundary inside them."""
    s, e = node.start, node.end
    up, top, p = 0, False, node.parent  # SWA run just above `node`, up to wp tokens
    while True:
        if p is root:
            top = True
            break
        if not swa_present(p):
            break
        up += len(p)
        if up >= wp:
            break
        p = p.parent
    if top and not mamba:
        return (
            True  # every page boundary of `node` ends a window that runs from the root
        )
    stack = [(node, True)]
    while stack:
        m, present = stack.pop()
        end = m.end
        if end < e + wp and (m.anchors[0] or m.anchors[1]):
            return True  # a lock's window
        if present:
            if mamba:
                if (
                    end < e + wp
                    and (m.mamba[0] is not None or m.mamba[1] is not None)
                    and (top or end - wp >= s - up)
                ):
                    return True
            elif end - s + up >= wp:
                return True  # a run of wp tokens through `node`: a window ends in it
        if end < e + wp:
            stack.extend((c, present and swa_present(c)) for c in m.children.values())
    return False


def holds_reaching(node: HybridNode, pos: int, wp: int, tier: int) -> int:
    """Locks on `tier` taken at `node` or below whose window reaches before `pos` (they
    end before pos + wp): what an upper half ending at `pos` inherits on a split."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        if n.end >= pos + wp:
            continue  # and so is everything below it
        total += n.anchors[tier]
        stack.extend(n.children.values())
    return total
