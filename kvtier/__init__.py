"""kvtier: hierarchical KV-cache tiering for LLM serving.

Layer map (layers import downward only; see kvtier/README.md):

    cli, engine        -> cache
    cache              -> tree, controller, tiers, backends
    controller         -> tiers, backends
    tree               -> hashing, errors
    tiers, backends    -> hashing, errors
"""

__version__ = "0.1.0"
