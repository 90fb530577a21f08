"""The dialect routes of the front (docs/api.md, "Anthropic Messages sessions"): which op a
session's `/v1/messages` is, and the gateway's refusals on it in the dialect's envelope."""

from __future__ import annotations

import json

from sessiongate.dialects import dialect_of_path, gateway_error_in_dialect
from sessiongate.front.routes import classify, front_decision
from sessiongate.protocol import Op


def test_a_session_messages_post_is_the_messages_op() -> None:
    route = classify("POST", "/sessions/abc/v1/messages", [])
    assert (route.op, route.session_id) == (Op.MESSAGES, "abc")
    # Other methods and subpaths stay the session proxy; no session: the stateless relay.
    assert classify("GET", "/sessions/abc/v1/messages", []).op is Op.PROXY
    assert classify("POST", "/sessions/abc/v1/messages/count_tokens", []).op is Op.PROXY
    assert classify("POST", "/v1/messages", []).op is Op.PROXY
    # The compiled front passes it to Python like every session request.
    assert front_decision("POST", "/sessions/abc/v1/messages", []) == "dispatch"


def test_dialect_of_path() -> None:
    assert dialect_of_path("/sessions/abc/v1/messages") == "anthropic"
    assert dialect_of_path("/sessions/a%2Fb/v1/messages") == "anthropic"
    assert dialect_of_path("/sessions/abc/v1/chat/completions") is None
    assert dialect_of_path("/v1/messages") is None
    assert dialect_of_path("/sessions/v1/messages") is None


def test_gateway_errors_are_rewrapped_and_others_kept() -> None:
    wrapped = gateway_error_in_dialect("anthropic", 404, b'{"error":"session x not found"}')
    assert wrapped is not None
    assert json.loads(wrapped) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "session x not found"},
    }
    envelope = b'{"type":"error","error":{"type":"x","message":"y"}}'
    assert gateway_error_in_dialect("anthropic", 400, envelope) is None
    assert gateway_error_in_dialect("anthropic", 503, b'{"error":"down","status":"x"}') is None
