"""The store runtime: how kvtier calls a store, for the cache and every integration alike.

- `loop.py`: the store loop, one asyncio loop on a thread of its own (woken keeping the
  GIL: `waker.py`; kept to `controller.cpus`: `cpus.py`);
- `breaker.py`: the circuit breaker in front of a sick store;
- `call.py`: the one breaker-guarded call, an op's lifetime around its calls, the one
  staged read (with its bounded staging pool);
- `ops.py`: store-call ops, whose lifetime is a `Phase`, and `PageKeys`.

It sits beside `backends/` and below `controller/`, `cache/` and `integrations/`: it
imports only `backends/` and kvtier's shared helpers (`errors.py`).
"""
