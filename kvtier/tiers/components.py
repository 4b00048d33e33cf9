"""A hybrid model's components in the tiers: what each holds, and the namespace its pages
are stored under.

| component | pool (`PoolConfig`)                     | a page is                        | namespace `component` |
|-----------|-----------------------------------------|----------------------------------|-----------------------|
| FULL      | mha / mla, the full-attention layers    | `page_size` tokens' KV           | None (ids unchanged)  |
| SWA       | mha / mla, the sliding-window layers    | `page_size` tokens' KV           | `swa:window=W`        |
| MAMBA     | `StatePoolConfig`, recurrent layers     | one sequence's state (one slot)  | `mamba`               |

Each component has its own pool and mirror; one controller moves the slots of all of
them, a node's or a request's side components in the same two-phase op as its FULL KV
(`CacheController.add_component`, the cache's `cache/components.py`); only the namespace
tells them apart in the store. A component's namespace takes the dtype, layout
(`PoolConfig.page_layout`: layers and heads, or the state's shape) and page size of its own
pool, and the window, so two models that differ in any of them never share a stored page:
its key names another namespace id, and its frame another namespace (a miss).

A state's store key is the page hash of the last page of the prefix it was taken at (the
chain of the FULL namespace), under the MAMBA namespace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from kvtier.hashing import Namespace
from kvtier.tiers.pool import PoolConfig, StatePoolConfig


class Component(str, Enum):
    """The kinds of per-node data a hybrid model's cache keeps, one enum for every layer:
    the tree keys its per-node data by it, the tiers their pools, mirrors and namespaces."""

    FULL = "full"
    SWA = "swa"
    MAMBA = "mamba"

    @classmethod
    def parse(cls, value: object) -> Component:
        """`value` as a component: a Component, or its name in any case ("swa", "SWA");
        else ValueError naming the value and the allowed ones."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        allowed = ", ".join(c.value for c in cls)
        raise ValueError(
            f"components: {value!r} is not a component; allowed: {allowed}"
        )


@dataclass(slots=True, frozen=True)
class ComponentSpec:
    """One component's pool geometry, and for SWA its window (tokens before a query that
    a sliding-window layer sees)."""

    component: Component
    pool: PoolConfig | StatePoolConfig
    window: int | None = None

    def __post_init__(self) -> None:
        try:
            kind = Component(self.component)
        except ValueError:
            raise ValueError(
                f"component={self.component!r}: allowed: "
                f"{', '.join(c.value for c in Component)}"
            ) from None
        object.__setattr__(self, "component", kind)
        state = isinstance(self.pool, StatePoolConfig)
        if (kind == Component.MAMBA) != state:
            raise ValueError(
                f"component={kind.value!r}: pool.attention={self.pool.attention!r}; the "
                "mamba component, and only it, holds state slots (a StatePoolConfig)"
            )
        if kind == Component.SWA:
            w = self.window
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(
                    f"window={w!r}: the swa component needs an integer >= 1"
                )
        elif self.window is not None:
            raise ValueError(
                f"window={self.window!r}: for the swa component only (component={kind.value!r})"
            )

    @property
    def tag(self) -> str | None:
        """`Namespace.component`: None for FULL, so full-attention ids stay as they were."""
        if self.component == Component.FULL:
            return None
        if self.component == Component.SWA:
            return f"swa:window={self.window}"
        return "mamba"

    def namespace(self, base: Namespace) -> Namespace:
        """`base` (the model's: model id, revision, tenant, TP rank) for this component's
        pages: its pool's dtype, layout and page size, and its tag. A state is a store page
        of its own (store_pages 1): the base's store_pages counts token pages of the full
        pool's page size, which no state slot has."""
        p = self.pool
        return dataclasses.replace(
            base,
            dtype=p.dtype,
            layout=p.page_layout,
            page_size=p.page_size,
            store_pages=1 if self.component == Component.MAMBA else base.store_pages,
            component=self.tag,
        )
