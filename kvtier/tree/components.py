"""The kinds of per-node data a tree keeps (docs/design.md, "Hybrid models: components").

A tree is built with its component set: FULL alone (a full-attention model: `RadixTree`),
or FULL with SWA and/or MAMBA (`HybridRadixTree`). FULL is the token-indexed KV of the
full-attention layers and decides which nodes exist; SWA is the token-indexed KV of the
sliding-window layers (its own slot space); MAMBA is one fixed-size recurrent state slot,
valid only at the end of the node that holds it. `Component` is the tiers' enum
(`tiers/components.py`): one name for a component from the tree down to the store.
"""

from __future__ import annotations

import math
import numbers

from kvtier.tiers.components import Component


def parse_components(
    components: object, swa_window: object, page_size: int
) -> tuple[tuple[Component, ...], int]:
    """The sorted component set and the SWA window rounded up to whole pages (0 without
    SWA), or ValueError naming the field, the value and what is allowed."""
    if isinstance(components, (str, Component)) or not hasattr(components, "__iter__"):
        raise ValueError(
            f"components={components!r}: expected a collection of components, e.g. (FULL, SWA)"
        )
    parsed = tuple(
        c for c in Component if c in {Component.parse(x) for x in components}
    )
    if Component.FULL not in parsed:
        raise ValueError(
            f"components={components!r}: must include FULL (full-attention KV decides what the tree holds)"
        )
    if Component.SWA in parsed:
        if (
            isinstance(swa_window, bool)
            or not isinstance(swa_window, numbers.Integral)
            or swa_window < 1
        ):
            raise ValueError(
                f"swa_window={swa_window!r}: with an SWA component it must be an integer >= 1 (tokens)"
            )
        return parsed, math.ceil(int(swa_window) / page_size) * page_size
    if swa_window is not None:
        raise ValueError(
            f"swa_window={swa_window!r}: only a tree with an SWA component takes a window"
        )
    return parsed, 0
