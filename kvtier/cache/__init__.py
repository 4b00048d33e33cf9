"""The cache a server embeds (`TieredCache`, facade.py) and the parts it wires, each the
one owner of its state (kvtier/README.md):

    facade.py       TieredCache: the public API
    requests.py     the request table: what each request holds, and its checks
    slots.py        device and host slot ownership, on-demand eviction
    writes.py       device->host writes in prefix order, store backups
    loads.py        host->device loads into slots a request will own
    prefetch.py     store prefetches: start, grant, insert what landed, name ready requests
    completions.py  the one agreement per poll, as a named record, and applying it
    hints.py        agent hints: leases (pin, release), prefetch, demote, retain
    components.py   a hybrid model's side components: their pools, mirrors, slot owners
    hybrid.py       HybridTieredCache: the facade over a hybrid model's components

Each part calls only the ones listed below it; the facade calls them all.
"""

from kvtier.cache.facade import Acquired, TieredCache
from kvtier.cache.hybrid import HybridAcquired, HybridTieredCache

__all__ = ["Acquired", "HybridAcquired", "HybridTieredCache", "TieredCache"]
