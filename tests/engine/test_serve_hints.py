"""`tierctl serve`'s agent hints over HTTP (POST /hints/...): by prompt and by session,
behind the same token as every route, bad bodies a 4xx naming the field, a tenant over its
bound a 409 that changes nothing."""

from kvtier.cache.hints import LeaseBounds
from tests.engine import test_serve
from tests.engine.test_serve import connect, post

cache_home, serving = test_serve.cache_home, test_serve.serving  # its fixtures

AUTH = {"Authorization": "Bearer s3cret"}


def test_hints_by_prompt_and_session_behind_the_token(serving):
    listener, server = serving(token="s3cret")
    conn = connect(listener)
    prompt = list(range(1, 70))
    assert post(conn, "/hints/pin", {"prompt": prompt, "ttl_s": 30})[0] == 401
    code, out = post(
        conn, "/generate", {"prompt": prompt, "max_new_tokens": 2, "session": "s"}, AUTH
    )
    assert code == 200
    code, out = post(
        conn, "/hints/pin", {"session": "s", "ttl_s": 30, "tiers": ["device"]}, AUTH
    )
    # the session's history is the prompt and 2 outputs; the last output has no KV yet
    assert code == 200 and out["tokens"] == 64 and out["tiers"] == ["device"]
    code, out = post(conn, "/hints/pin", {"prompt": prompt, "ttl_s": 5}, AUTH)
    assert code == 200 and out["tiers"] == ["host", "store"]
    assert post(conn, "/hints/retain", {"session": "s", "priority": 3}, AUTH) == (
        200,
        {"priority": 3},
    )
    assert post(conn, "/hints/demote", {"prompt": prompt}, AUTH)[0] == 200
    assert post(conn, "/hints/prefetch", {"prompt": prompt}, AUTH) == (
        200,
        {"started": False},  # on device and host already
    )
    assert post(conn, "/hints/release", {"prompt": prompt[:64]}, AUTH) == (
        200,
        {"released": 2},
    )
    hints = server.loop.call(server.cache.stats).result(30)["hints"]
    assert hints["pins"] == 2 and hints["releases"] == 2 and hints["leases"] == 0
    server.loop.call(server.cache.tree.sanity_check).result(30)


def test_bad_hint_bodies_name_the_field_and_over_the_bound_is_409(serving):
    listener, server = serving()
    conn = connect(listener)
    for path, body, status, words in [
        ("/hints/pin", {"prompt": [1] * 32}, 400, "ttl_s=null"),
        ("/hints/pin", {"prompt": [1] * 32, "ttl_s": -1}, 400, "ttl_s=-1"),
        (
            "/hints/pin",
            {"prompt": [1] * 32, "ttl_s": 1, "tiers": ["gpu"]},
            400,
            "tiers=",
        ),
        ("/hints/pin", {"ttl_s": 1}, 400, "one of prompt, session"),
        ("/hints/retain", {"prompt": [1] * 32, "priority": "hi"}, 400, "priority="),
        ("/hints/demote", {"prompt": [1], "ttl_s": 1}, 400, "unknown field 'ttl_s'"),
        ("/hints/prefetch", {"session": "nobody"}, 404, "no history"),
        ("/hints/evict", {"prompt": [1]}, 404, "hints: pin"),
    ]:
        code, out = post(conn, path, body)
        assert code == status and words in out["error"], (path, body, out)
    bpt = server.cache.pool.bytes_per_token
    bounds = LeaseBounds(16 * bpt, 16 * bpt, 16 * bpt)
    server.loop.call(lambda: server.cache.set_lease_bounds(bounds, "t")).result(30)
    prompt = list(range(1, 40))
    assert post(conn, "/generate", {"prompt": prompt, "max_new_tokens": 1})[0] == 200
    pin = {"prompt": prompt, "ttl_s": 9, "tiers": ["device"], "tenant": "t"}
    assert post(conn, "/hints/pin", {**pin, "prompt": prompt[:16]})[0] == 200

    def held():
        server.cache.drain()  # writes in flight hold device locks too
        s = server.cache.stats()
        return s["tiers"]["device"]["protected_tokens"], s["hints"]["lease_bytes"]

    before = server.loop.call(held).result(30)
    code, out = post(conn, "/hints/pin", pin)
    assert code == 409 and "'t'" in out["error"] and f"{16 * bpt} bytes" in out["error"]
    assert server.loop.call(held).result(30) == before
    assert before[1] == {"t/device": 16 * bpt}
