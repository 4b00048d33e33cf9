"""`tierctl serve`'s agent hints: POST /hints/{pin,prefetch,demote,retain,release}
(docs/http-api.md, "Agent hints"). A body names the prefix by its tokens (`prompt`) or by
a session (its history so far); the checks here run on the request's thread, the hint on
the engine's (`Server.hint`), as every use of the cache does."""

from __future__ import annotations

import json

from kvtier.cache.hints import HintTier

OPS = ("pin", "prefetch", "demote", "retain", "release")
_FIELDS = {
    "pin": {"ttl_s", "tiers", "tenant"},
    "prefetch": set(),
    "demote": set(),
    "retain": {"priority"},
    "release": {"tenant"},
}
MAX_TENANT = 256  # bytes of a tenant name, UTF-8


class UnknownSession(LookupError):
    """The session has no history here (never seen, or dropped): a 404."""


def check(op: str, body: dict, vocab: int) -> dict:
    """The hint's arguments, checked: ValueError names the field, value and what is allowed."""
    allowed = {"prompt", "session"} | _FIELDS[op]
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(
            f"/hints/{op}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}"
        )
    out = {"prompt": None, "session": None}
    if ("prompt" in body) == ("session" in body):
        raise ValueError(f"/hints/{op}: name the prefix by one of prompt, session")
    if "prompt" in body:
        out["prompt"] = _prompt(body["prompt"], vocab)
    else:
        out["session"] = _name("session", body["session"])
    if op == "pin":
        ttl = body.get("ttl_s")
        if not _is_number(ttl) or not 0 < ttl <= 86400:
            raise ValueError(
                f"ttl_s={json.dumps(ttl)[:40]}: a number of seconds in (0, 86400]"
            )
        out["ttl_s"] = float(ttl)
        tiers = body.get("tiers", ["host", "store"])
        allowed_tiers = [t.value for t in HintTier]
        if (
            not isinstance(tiers, list)
            or not tiers
            or not all(t in allowed_tiers for t in tiers)
        ):
            raise ValueError(
                f"tiers={json.dumps(tiers)[:60]}: a non-empty list of "
                f"{', '.join(allowed_tiers)}"
            )
        out["tiers"] = tuple(tiers)
    if op in ("pin", "release"):
        out["tenant"] = _name("tenant", body.get("tenant", "default"))
    if op == "retain":
        priority = body.get("priority")
        if not _is_int(priority) or not -(2**31) <= priority < 2**31:
            raise ValueError(
                f"priority={json.dumps(priority)[:40]}: an integer in [-2^31, 2^31)"
            )
        out["priority"] = priority
    return out


def apply(cache, histories, op: str, args: dict) -> dict:
    """Run a checked hint on the engine's thread; the answer's JSON."""
    tokens = args["prompt"]
    if tokens is None:
        history = histories.get(args["session"])
        if len(history) < 2:
            raise UnknownSession(
                f"session {args['session'][:40]!r} has no history here (never seen, or "
                "dropped: --sessions, --session-ttl)"
            )
        tokens = history[:-1]  # its last output has no KV yet
    if op == "pin":
        lease = cache.pin(tokens, args["ttl_s"], args["tiers"], tenant=args["tenant"])
        return {
            "lease": lease.id,
            "tokens": lease.tokens,
            "tiers": sorted(t.value for t in lease.tiers),
            "ttl_s": args["ttl_s"],
        }
    if op == "prefetch":
        return {"started": cache.prefetch(tokens)}
    if op == "demote":
        return {"queued_tokens": cache.demote(tokens)}
    if op == "retain":
        cache.retain(tokens, args["priority"])
        return {"priority": args["priority"]}
    return {"released": cache.release(tokens, tenant=args["tenant"])}


def _prompt(prompt, vocab: int) -> list[int]:
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(_is_int(t) and 0 <= t < vocab for t in prompt)
    ):
        raise ValueError(
            f"prompt must be a non-empty list of token ids in [0, {vocab})"
        )
    return prompt


def _name(field: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"{field}={json.dumps(value)[:40]}: must be a non-empty string"
        )
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_TENANT:
        raise ValueError(
            f"{field}={value[:24]!r}...: {size} bytes; at most {MAX_TENANT} (UTF-8)"
        )
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
