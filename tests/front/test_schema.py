"""The served OpenAPI document (`/openapi.json`), the docs page, and schemathesis against a
real `serve --workers 1` (mock engine). The long run is benches/stress/schema_fuzz.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.procs import ServerProcess, free_port
from support.schema_cases import SessionPool, check_case, fuzz_all, load_schema

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

# Bounded: 25 generated requests per operation and mode, no shrinking (support/schema_cases.py).
EXAMPLES = 25
ROUTES = {
    "/health": {"get"},
    "/metrics": {"get"},
    "/sessions": {"post"},
    "/sessions/{session_id}": {"get", "delete"},
    "/sessions/{session_id}/v1/chat/completions": {"post"},
    "/sessions/{session_id}/v1/messages": {"post"},
    "/sessions/{session_id}/v1/responses": {"post"},
    "/sessions/{session_id}/trajectory": {"get"},
    "/sessions/{session_id}/samples": {"post"},
    "/sessions/{session_id}/{path}": {"get", "post", "put", "patch", "delete"},
    "/v1/chat/completions": {"post"},
    "/v1/{path}": {"get", "post", "put", "patch", "delete"},
}


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--workers", "1"], port) as server:
        yield server


@pytest.fixture(scope="module")
def document(gateway: ServerProcess) -> dict[str, Any]:
    response = httpx.get(gateway.url + "/openapi.json", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    return response.json()


def test_openapi_document_lists_every_route(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    assert {path: set(ops) for path, ops in document["paths"].items()} == ROUTES
    schemas = document["components"]["schemas"]
    assert schemas["ErrorBody"]["required"] == ["error"]
    # FastAPI's own request validation is not the gateway's: no 422 HTTPValidationError.
    assert "HTTPValidationError" not in schemas
    chat = document["paths"]["/sessions/{session_id}/v1/chat/completions"]["post"]
    assert {"200", "400", "404", "500", "502", "503", "default"} <= set(chat["responses"])
    assert "X-Sessiongate-Recorded" in chat["responses"]["200"]["headers"]
    assert "Retry-After" in document["paths"]["/sessions"]["post"]["responses"]["429"]["headers"]
    assert "security" not in document["paths"]["/health"]["get"]


def test_error_replies_are_documented_as_json(document: dict[str, Any]) -> None:
    """Regression (schemathesis ST105): FastAPI filed the error bodies of /trajectory and
    /samples under their success media type, application/octet-stream."""
    for path in ("/sessions/{session_id}/trajectory", "/sessions/{session_id}/samples"):
        (operation,) = document["paths"][path].values()
        for status, response in operation["responses"].items():
            if status != "200":
                assert set(response["content"]) == {"application/json"}, (path, status)


def test_optional_bodies_are_objects_not_null(gateway: ServerProcess, document: dict) -> None:
    """Regression (schemathesis): `null` bodies on POST /sessions and /samples are a 400
    (not an object), so the document must not offer `null` as a valid body."""
    for path in ("/sessions", "/sessions/{session_id}/samples"):
        body = document["paths"][path]["post"]["requestBody"]
        assert not body.get("required", False)
        assert "anyOf" not in body["content"]["application/json"]["schema"]
    refused = httpx.post(gateway.url + "/sessions", content=b"null")
    assert refused.status_code == 400
    assert "error" in refused.json()


def test_upstream_error_passthrough_conforms(gateway: ServerProcess) -> None:
    """Regression (schemathesis ST108): an upstream's own 400 body (SGLang's
    `{"object": "error", ...}`) passes through chat routes, and the document says so."""
    schema = load_schema(gateway.url)
    pool = SessionPool(gateway.url)
    try:
        case = schema["/v1/chat/completions"]["POST"].Case(body={"messages": []})
        check_case(case, gateway.url, pool)
    finally:
        pool.close()
    reply = httpx.post(gateway.url + "/v1/chat/completions", json={"messages": []})
    assert reply.status_code == 400 and reply.json()["object"] == "error"


def test_streamed_turn_conforms(gateway: ServerProcess) -> None:
    """Regression (schemathesis ST108 on SSE): each event is documented as `{data}`."""
    schema = load_schema(gateway.url)
    pool = SessionPool(gateway.url)
    try:
        case = schema["/v1/chat/completions"]["POST"].Case(
            body={"messages": [{"role": "user", "content": "hi"}], "stream": True},
            headers={"X-Session-ID": "schema-stream-1"},
        )
        check_case(case, gateway.url, pool)
    finally:
        pool.close()


def test_a_relayed_engine_reply_without_a_content_type_conforms(gateway: ServerProcess) -> None:
    """Regression (schemathesis ST104 on `/sessions/{id}/health`): the proxy relays SGLang's
    bodiless `/health` as it is, with no Content-Type."""
    schema = load_schema(gateway.url)
    pool = SessionPool(gateway.url)
    try:
        session_id = pool.client.post(gateway.url + "/sessions").json()["session_id"]
        case = schema["/sessions/{session_id}/{path}"]["GET"].Case(
            path_parameters={"session_id": session_id, "path": "health"}
        )
        pool.counter = iter([0])  # keep this session id
        check_case(case, gateway.url, pool)
    finally:
        pool.close()


def test_docs_page(gateway: ServerProcess) -> None:
    page = httpx.get(gateway.url + "/docs")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in page.text and "/openapi.json" in page.text
    assert httpx.head(gateway.url + "/openapi.json").status_code == 200


def test_docs_wrong_method_is_405(gateway: ServerProcess) -> None:
    for path in ("/openapi.json", "/docs"):
        reply = httpx.post(gateway.url + path)
        assert reply.status_code == 405
        assert reply.json() == {"error": f"POST is not allowed on {path} (use GET)"}


def test_docs_need_no_api_key_in_process() -> None:
    """`/openapi.json` and `/docs` are open like /health, also with `--api-key`, and the
    in-process layout (`--workers 0`) serves them from the same front end."""
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "0", "--api-key", "k3y"]
    with ServerProcess(argv, port) as server:
        assert httpx.get(server.url + "/openapi.json").status_code == 200
        assert httpx.get(server.url + "/docs").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 401
        authed = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k3y"})
        assert authed.status_code == 200


def test_schemathesis_every_operation(gateway: ServerProcess) -> None:
    """Schema-valid requests (positive) and schema-breaking ones (negative) to every
    operation: every reply documented, no server error but the upstream failures."""
    started = time.monotonic()
    failures = fuzz_all(gateway.url, EXAMPLES, seed=1)
    failures += fuzz_all(gateway.url, EXAMPLES, seed=1, negative=True)
    assert not failures, "\n\n".join(failures)
    assert time.monotonic() - started < 60
    # The gateway is still healthy after the run.
    assert httpx.get(gateway.url + "/health").status_code == 200
