"""Adapters that put kvtier behind other engines' interfaces (docs/sglang.md)."""
