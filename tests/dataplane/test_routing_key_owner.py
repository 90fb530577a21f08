"""The router sends stateless calls with one X-SMG-Routing-Key to one worker (a policy's
memory of a key is per worker process), and `--session-header none` turns header sessions
off. No process: the router's choice and the option's parsing, directly."""

from __future__ import annotations

import time

import pytest

from sessiongate.dataplane.router.shard_router import ShardRouter
from sessiongate.front.routes import DEFAULT_SESSION_HEADERS, classify, session_header_names
from sessiongate.primitives import shard_index
from sessiongate.protocol import Op


class _Channel:
    def __init__(self, index: int, *, up: bool) -> None:
        self.index = index
        self.up = up
        self.last_heartbeat = time.monotonic()


def router_with(*up: bool) -> ShardRouter:
    router = ShardRouter(len(up))
    router.channels = [_Channel(i, up=u) for i, u in enumerate(up)]  # type: ignore[misc]
    return router


def test_one_routing_key_one_worker_while_it_is_up() -> None:
    router = router_with(True, True, True)
    for key in ("k1", "session-7", "2f0c"):
        owners = {router._owner(None, [("X-SMG-Routing-Key", key)]) for _ in range(6)}
        assert owners == {shard_index(key, 3)}
    # Without a key (or an empty one) stateless calls take the live workers in turn.
    assert {router._owner(None, []) for _ in range(6)} == {0, 1, 2}
    assert {router._owner(None, [("x-smg-routing-key", "")]) for _ in range(6)} == {0, 1, 2}


def test_a_key_whose_worker_is_down_goes_to_a_live_one() -> None:
    key = next(k for k in (f"k{n}" for n in range(100)) if shard_index(k, 2) == 0)
    router = router_with(False, True)
    assert router._owner(None, [("X-SMG-Routing-Key", key)]) == 1


def test_session_header_none_turns_header_sessions_off() -> None:
    assert session_header_names(None) == DEFAULT_SESSION_HEADERS
    assert session_header_names(["X-Session-ID"]) == ("X-Session-ID",)
    assert session_header_names(["none"]) == ()
    with pytest.raises(SystemExit, match="cannot be combined"):
        session_header_names(["none", "X-Session-ID"])
    headers = [("X-SMG-Routing-Key", "s1"), ("X-Session-ID", "s1")]
    route = classify("POST", "/v1/chat/completions", headers, ())
    assert route.op is Op.PROXY and route.session_id is None
    # The default: the same call is a session turn.
    assert classify("POST", "/v1/chat/completions", headers).op is Op.CHAT
