"""The session API contract against real `serve` and `mock-engine` processes on loopback."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import quote

import httpx
import pytest

from sessiongate.demo.verify import completion_ids, trajectory_problems
from sessiongate.session.state import Session
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
    }
]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(
        ["mock-engine", "--port", str(port), "--r3-layers", "3", "--r3-topk", "2"], port
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def gateway(engine: ServerProcess) -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--backend",
            engine.url,
            "--r3",
            "--r3-topk",
            "2",
            "--max-body-bytes",
            "200000",
        ],
        port,
    ) as proc:
        yield proc


@pytest.fixture()
def client(gateway: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30.0) as c:
        yield c


def new_session(client: httpx.Client, parent: str | None = None) -> str:
    body = {"parent_session_id": parent} if parent else None
    response = client.post("/sessions", json=body)
    assert response.status_code == 200, response.text
    session_id: str = response.json()["session_id"]
    return session_id


def chat(
    client: httpx.Client, session_id: str, messages: list[dict[str, Any]], **extra: Any
) -> httpx.Response:
    return client.post(
        f"/sessions/{session_id}/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 12, **extra},
    )


def assistant_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


def start_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Begin the task."},
    ]


def test_health(client: httpx.Client) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_create_get_delete(client: httpx.Client) -> None:
    session_id = new_session(client)
    assert len(session_id) == 32 and all(c in "0123456789abcdef" for c in session_id)
    body = client.get(f"/sessions/{session_id}").json()
    assert body["session_id"] == session_id
    assert body["records"] == []
    assert body["metadata"]["accumulated_token_ids"] == []
    assert body["metadata"]["max_trim_tokens"] == 0
    assert client.delete(f"/sessions/{session_id}").status_code == 204
    # Deleted: the id answers 410 (reclaimed), not 404, for --reclaimed-ttl.
    gone = client.delete(f"/sessions/{session_id}")
    assert gone.status_code == 410 and session_id in gone.json()["error"]
    assert client.get(f"/sessions/{session_id}").status_code == 410


def test_fifty_turn_session_is_token_exact(client: httpx.Client, engine: ServerProcess) -> None:
    session_id = new_session(client)
    messages = start_messages()
    for turn in range(50):
        response = chat(client, session_id, messages, tools=TOOLS)
        messages.append(assistant_of(response))
        role = "tool" if turn % 2 == 0 else "user"
        messages.append({"role": role, "content": f"observation {turn} \u2713"})
    session = client.get(f"/sessions/{session_id}").json()
    assert len(session["records"]) == 50
    assert trajectory_problems(session) == []
    # The accumulated ids are exactly every prompt piece and completion concatenated.
    pieces: list[int] = []
    for record in session["records"]:
        prompt = record["request"]["input_ids"]
        assert prompt[: len(pieces)] == pieces
        pieces = prompt + completion_ids(record["response"])
    assert session["metadata"]["accumulated_token_ids"] == pieces
    # max_tokens may cut the last turn off before its end-of-turn token, which the
    # framework's report counts (special_token_count); the detail leaves it out.
    assert session["metadata"]["tito_session_mismatch_detail"] == []
    # What the engine received is what was recorded.
    last = client.get(f"{engine.url}/mock/requests", params={"last": 1}).json()["requests"][-1]
    assert last["input_ids"] == session["records"][-1]["request"]["input_ids"]
    assert last["logprobs"] is True and last["return_meta_info"] is True
    assert last["return_routed_experts"] is True and last["no_stop_trim"] is False


def test_r3_kept_in_record_and_stripped_from_reply(client: httpx.Client) -> None:
    session_id = new_session(client)
    response = chat(client, session_id, start_messages())
    assert response.status_code == 200
    assert "routed_experts" not in response.json()["choices"][0]["meta_info"]
    record = client.get(f"/sessions/{session_id}").json()["records"][0]
    meta = record["response"]["choices"][0]["meta_info"]
    raw = base64.b64decode(meta["routed_experts"])
    tokens = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    assert len(raw) == tokens * 3 * 2 * 4
    assert record["status_code"] == 200 and record["method"] == "POST"


def test_rollback_of_one_assistant_step(client: httpx.Client) -> None:
    session_id = new_session(client)
    messages = start_messages()
    messages.append(assistant_of(chat(client, session_id, messages)))
    messages.append({"role": "tool", "content": "first result"})
    messages.append(assistant_of(chat(client, session_id, messages)))
    messages.append({"role": "tool", "content": "second result"})
    chat(client, session_id, messages)
    before = client.get(f"/sessions/{session_id}").json()
    assert len(before["records"]) == 3
    # Retry from the second checkpoint with a different tool result.
    retry = [*messages[:5], {"role": "tool", "content": "second result, retried"}]
    response = chat(client, session_id, retry)
    assert response.status_code == 200, response.text
    after = client.get(f"/sessions/{session_id}").json()
    assert len(after["records"]) == 3
    assert after["records"][:2] == before["records"][:2]
    assert trajectory_problems(after) == []
    second_checkpoint = before["records"][1]["request"]["input_ids"] + completion_ids(
        before["records"][1]["response"]
    )
    new_prompt = after["records"][2]["request"]["input_ids"]
    assert new_prompt[: len(second_checkpoint)] == second_checkpoint


def test_repeated_retries_after_many_turns_extend_the_kept_checkpoint(
    client: httpx.Client,
) -> None:
    """Only the last two checkpoints are held: retrying the same step again and again, then
    going on, must still extend the right ones."""
    session_id = new_session(client)
    messages = start_messages()
    for turn in range(6):
        messages.append(assistant_of(chat(client, session_id, messages)))
        messages.append({"role": "tool", "content": f"result {turn}"})
    for attempt in range(3):
        retry = [*messages[:-1], {"role": "tool", "content": f"result 5, attempt {attempt}"}]
        assert chat(client, session_id, retry).status_code == 200
    messages = list(retry)
    messages.append(assistant_of(chat(client, session_id, messages)))
    messages.append({"role": "tool", "content": "after the retries"})
    assert chat(client, session_id, messages).status_code == 200
    document = client.get(f"/sessions/{session_id}").json()
    assert len(document["records"]) == 8
    assert trajectory_problems(document) == []


def test_checkpoints_are_rebuilt_through_their_links() -> None:
    # Only the last checkpoint is held whole; each earlier one is the part it shares with the
    # next plus its own trailing ids (session/state.py): any depth is reachable.
    session = Session(session_id="s", parent_id=None, root_id="s", created_at=0.0)
    lines = [list(range(turn + 1)) for turn in range(5)]
    lines[2] = [0, 1, 99]  # a trailing id the next checkpoint replaced (a trimmed stop token)
    for turn, ids in enumerate(lines):
        session.commit_checkpoint(turn, ids)
    assert [list(session.checkpoint(k + 1)) for k in range(5)] == lines
    assert all(len(tail) <= 1 for _, tail in session.checkpoint_links)
    session.commit_checkpoint(2, [0, 1, 7, 2**40])  # three steps back; beyond int32 stays exact
    assert list(session.accumulated_ids) == [0, 1, 7, 2**40]
    assert [list(session.checkpoint(k + 1)) for k in range(3)] == [*lines[:2], [0, 1, 7, 2**40]]
    with pytest.raises(LookupError, match="no checkpoint 4 of 3"):
        session.checkpoint(4)


def test_a_rollback_of_two_steps_replaces_the_later_records(client: httpx.Client) -> None:
    session_id = new_session(client)
    messages = start_messages()
    for turn in range(3):
        messages.append(assistant_of(chat(client, session_id, messages)))
        messages.append({"role": "tool", "content": f"result {turn}"})
    before = client.get(f"/sessions/{session_id}").json()
    diverged = [*messages[:3], {"role": "tool", "content": "rewritten history"}]
    response = chat(client, session_id, diverged)
    assert response.status_code == 200, response.text
    after = client.get(f"/sessions/{session_id}").json()
    assert after["records"][:1] == before["records"][:1]
    assert [r["rollback_steps"] for r in after["records"]] == [0, 2]
    assert trajectory_problems(after) == []


def test_appended_role_not_allowed_is_400(client: httpx.Client) -> None:
    session_id = new_session(client)
    messages = start_messages()
    messages.append(assistant_of(chat(client, session_id, messages)))
    messages.append({"role": "assistant", "content": "I speak twice"})
    response = chat(client, session_id, messages)
    assert response.status_code == 400
    assert "messages[3] has role 'assistant'" in response.json()["error"]


def test_unknown_and_invalid_session_ids(client: httpx.Client) -> None:
    missing = chat(client, "0" * 32, start_messages())
    assert missing.status_code == 404 and "0" * 32 in missing.json()["error"]
    too_long = client.get("/sessions/" + "a" * 300)
    assert too_long.status_code == 400 and "invalid session id" in too_long.json()["error"]
    unknown_parent = client.post("/sessions", json={"parent_session_id": "f" * 32})
    assert unknown_parent.status_code == 404


def test_child_session_ids_share_the_root(client: httpx.Client) -> None:
    root = new_session(client)
    child = new_session(client, parent=root)
    grandchild = new_session(client, parent=child)
    assert child.startswith(root + ".") and grandchild.startswith(root + ".")
    metadata = client.get(f"/sessions/{child}").json()["metadata"]
    assert metadata["parent_session_id"] == root
    assert metadata["child_session_ids"] == [grandchild]


def test_body_over_limit_is_413(client: httpx.Client) -> None:
    session_id = new_session(client)
    huge = [{"role": "user", "content": "x" * 300_000}]
    response = chat(client, session_id, huge)
    assert response.status_code == 413
    assert "limit of 200000 bytes" in response.json()["error"]


def first_turn(gw: ServerProcess, **extra: Any) -> tuple[str, httpx.Response]:
    """A new session and its first chat turn (`extra` joins the body) through `gw`."""
    session_id: str = httpx.post(gw.url + "/sessions").json()["session_id"]
    response = httpx.post(
        f"{gw.url}/sessions/{session_id}/v1/chat/completions",
        json={"messages": start_messages(), **extra},
    )
    return session_id, response


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_stream_is_one_chunk_and_records_like_a_non_stream_turn(client: httpx.Client) -> None:
    # --stream-upstream buffered (the default, the rollout framework's choice): one non-stream
    # upstream call, answered as one chunk without meta_info (miles/rollout/session/core.py
    # _response_to_stream_chunk); the relayed mode is in tests/end_to_end/test_engine_contracts.py.
    streamed, whole = new_session(client), new_session(client)
    response = chat(client, streamed, start_messages(), stream=True, tools=TOOLS)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-sessiongate-recorded"] == "true"
    events = sse_events(response)
    assert events[-1] == "[DONE]" and len(events) == 2
    chunk = json.loads(events[0])
    assert chunk["object"] == "chat.completion.chunk"
    choice = chunk["choices"][0]
    assert "meta_info" not in choice and "routed_experts" not in events[0]
    assert choice["delta"]["role"] == "assistant"
    for index, call in enumerate(choice["delta"].get("tool_calls") or []):
        assert call["index"] == index

    record = client.get(f"/sessions/{streamed}").json()["records"][0]
    assert record["request"]["stream"] is False  # the upstream call was not streamed
    reply = record["response"]
    assert reply["choices"][0]["message"]["content"] == choice["delta"]["content"]
    assert "routed_experts" in reply["choices"][0]["meta_info"]  # kept in the record

    # The same turn without streaming records the same tokens.
    chat(client, whole, start_messages(), tools=TOOLS)
    other = client.get(f"/sessions/{whole}").json()["records"][0]["response"]
    assert other["choices"][0]["message"] == reply["choices"][0]["message"]
    assert (
        other["choices"][0]["meta_info"]["output_token_logprobs"]
        == reply["choices"][0]["meta_info"]["output_token_logprobs"]
    )


def test_streamed_and_whole_turns_mix_token_exact(client: httpx.Client) -> None:
    session_id = new_session(client)
    messages = start_messages()
    for turn in range(4):
        response = chat(client, session_id, messages, stream=turn % 2 == 0)
        assert response.status_code == 200, response.text
        if turn % 2 == 0:
            chunks = [json.loads(e) for e in sse_events(response)[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            message: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            message = assistant_of(response)
        messages = [*messages, message, {"role": "user", "content": f"go on {turn}"}]
    document = client.get(f"/sessions/{session_id}").json()
    assert len(document["records"]) == 4
    assert trajectory_problems(document) == []


class _QuietEngine(BaseHTTPRequestHandler):
    """A scripted upstream for one test; no request log on stderr."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _JsonEngine(_QuietEngine):
    """Answers every POST with 200 and `reply` as JSON."""

    reply: ClassVar[dict[str, Any]] = {}

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.dumps(self.reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def gateway_over(engine: type[BaseHTTPRequestHandler], *args: str) -> Iterator[ServerProcess]:
    """`serve` over a scripted in-test engine (a handler class on a loopback thread)."""
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), engine)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    try:
        backend = f"http://127.0.0.1:{upstream.server_address[1]}"
        argv = ["serve", "--port", str(port), "--backend", backend, *args]
        with ServerProcess(argv, port) as gw:
            yield gw
    finally:
        upstream.shutdown()


class _CutStreamEngine(_QuietEngine):
    """Streams two content chunks, then `[DONE]` without a finish chunk or ids."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for text in ("Hel", "lo"):
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": text}}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


def test_stream_without_finish_ends_with_an_error_event_unrecorded() -> None:
    with gateway_over(_CutStreamEngine, "--stream-upstream", "relay") as gw:
        session_id, response = first_turn(gw, stream=True)
        assert response.status_code == 200
        events = sse_events(response)
        assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == [
            "Hel",
            "lo",
        ]
        assert "no chunk carried a finish_reason" in json.loads(events[-1])["error"]
        assert httpx.get(f"{gw.url}/sessions/{session_id}").json()["records"] == []


def test_client_gone_mid_stream_leaves_the_session_unrecorded_and_usable() -> None:
    port = free_port()
    # With a parser the engine's stream is relayed (without one the turn is served buffered).
    slow = "--token-delay-ms 20 --completion-tokens 40 --tool-call-parser qwen25"
    argv = ["serve", "--port", str(port), "--mock-args", slow, "--stream-upstream", "relay"]
    with ServerProcess(argv, port) as gw:
        session_id = httpx.post(gw.url + "/sessions").json()["session_id"]
        url = f"{gw.url}/sessions/{session_id}/v1/chat/completions"
        body = {"messages": start_messages(), "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the first event arrived; now hang up
        deadline = time.monotonic() + 10
        while httpx.get(gw.url + "/health").json()["workers"][0]["inflight"]:
            assert time.monotonic() < deadline, "the abandoned turn never ended"
            time.sleep(0.05)
        assert httpx.get(f"{gw.url}/sessions/{session_id}").json()["records"] == []
        again = httpx.post(url, json={"messages": start_messages()}, timeout=30)
        assert again.status_code == 200
        assert len(httpx.get(f"{gw.url}/sessions/{session_id}").json()["records"]) == 1


def test_header_identified_session_and_stateless_proxy(client: httpx.Client) -> None:
    session_id = "agent-run-7/episode-3"
    messages = start_messages()
    first = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8},
        headers={"X-SMG-Routing-Key": session_id},
    )
    messages.append(assistant_of(first))
    messages.append({"role": "user", "content": "again"})
    second = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8},
        headers={"X-Session-ID": session_id},
    )
    assert second.status_code == 200
    quoted = quote(session_id, safe="")
    assert len(client.get(f"/sessions/{quoted}").json()["records"]) == 2
    stateless = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
    assert stateless.status_code == 200 and "choices" in stateless.json()


def test_session_scoped_proxy(client: httpx.Client) -> None:
    session_id = new_session(client)
    models = client.get(f"/sessions/{session_id}/v1/models")
    assert models.status_code == 200 and models.json()["data"]
    assert len(client.get(f"/sessions/{session_id}").json()["records"]) == 0
    # One Date and one Server header: the gateway's, not the upstream's as well.
    names = [name.lower() for name, _ in models.headers.multi_items()]
    assert names.count("date") <= 1 and names.count("server") <= 1


def test_chat_vs_chat_leaves_a_consistent_session(gateway: ServerProcess) -> None:
    import asyncio

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as c:
            session_id = (await c.post("/sessions")).json()["session_id"]
            body = {"messages": start_messages(), "max_tokens": 12}
            path = f"/sessions/{session_id}/v1/chat/completions"
            replies = await asyncio.gather(*(c.post(path, json=body) for _ in range(4)))
            assert all(r.status_code == 200 for r in replies)
            flags = [r.headers["x-sessiongate-recorded"] for r in replies]
            session = (await c.get(f"/sessions/{session_id}")).json()
            # Every request is the same first turn: the session ends with exactly one. A
            # request that starts after another committed is a one-step rollback (a retry)
            # and is recorded in its place; one that raced is answered but not recorded.
            assert len(session["records"]) == 1
            assert flags.count("true") >= 1
            assert trajectory_problems(session) == []

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def slow_gateway() -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--mock-args",
            "--token-delay-ms 20 --completion-tokens 20 --completion-tokens-jitter 0",
        ],
        port,
    ) as proc:
        yield proc


def test_delete_waits_for_in_flight_chat(slow_gateway: ServerProcess) -> None:
    import asyncio

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=slow_gateway.url, timeout=30.0) as c:
            session_id = (await c.post("/sessions")).json()["session_id"]
            path = f"/sessions/{session_id}/v1/chat/completions"
            started = time.monotonic()
            turn = asyncio.create_task(c.post(path, json={"messages": start_messages()}))
            await asyncio.sleep(0.1)
            deleted = await c.delete(f"/sessions/{session_id}")
            # The engine spends >= 20 tokens x 20 ms on the turn, so a DELETE that waited for
            # it cannot return sooner (a lower bound: slowness cannot make this fail).
            assert time.monotonic() - started >= 0.4
            assert deleted.status_code == 204
            reply = await turn
            assert reply.status_code == 200
            assert reply.headers["x-sessiongate-recorded"] == "false"
            # Deleted: reclaimed ids answer 410, so a late turn knows to stop.
            assert (await c.get(f"/sessions/{session_id}")).status_code == 410
            late = await c.post(path, json={"messages": start_messages()})
            assert late.status_code == 410

    asyncio.run(scenario())


def test_upstream_down_is_502() -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    with ServerProcess(["serve", "--port", str(port), "--backend", dead], port) as gw:
        session_id, response = first_turn(gw)
        assert response.status_code == 502
        assert "upstream transport error" in response.json()["error"]
        assert httpx.get(f"{gw.url}/sessions/{session_id}").json()["records"] == []


def test_upstream_non_200_passes_through_unrecorded() -> None:
    port = free_port()
    with ServerProcess(
        ["serve", "--port", str(port), "--mock-args", "--fail-rate 1 --fail-status 429"], port
    ) as gw:
        session_id, response = first_turn(gw)
        assert response.status_code == 429
        # The engine's own error body (SGLang's shape), passed through as it is.
        assert response.json()["message"] == "injected failure"
        assert response.json()["object"] == "error"
        assert httpx.get(f"{gw.url}/sessions/{session_id}").json()["records"] == []


class _BrokenEngine(_JsonEngine):
    """Answers 200 with a reply whose content is null: a contract violation."""

    reply: ClassVar[dict[str, Any]] = {"choices": [{"message": {"content": None}}]}


def test_contract_breaking_200_is_502() -> None:
    with gateway_over(_BrokenEngine) as gw:
        _, response = first_turn(gw)
        assert response.status_code == 502
        assert "content is null" in response.json()["error"]


def test_api_key_required_except_health() -> None:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--api-key", "s3cret"], port) as gw:
        assert httpx.get(gw.url + "/health").status_code == 200
        denied = httpx.post(gw.url + "/sessions")
        assert denied.status_code == 401 and "API key" in denied.json()["error"]
        wrong = httpx.post(gw.url + "/sessions", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = httpx.post(gw.url + "/sessions", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200


class _WholeReplyEngine(_JsonEngine):
    """Ignores `stream: true` and answers every chat with one whole JSON reply."""

    reply: ClassVar[dict[str, Any]] = {
        "id": "w",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
                "meta_info": {
                    "completion_tokens": 2,
                    "output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None]],
                },
            }
        ],
    }


def test_stream_request_answered_whole_is_one_chunk_and_recorded() -> None:
    with gateway_over(_WholeReplyEngine, "--stream-upstream", "relay") as gw:
        session_id, response = first_turn(gw, stream=True)
        assert response.status_code == 200
        assert response.headers["x-sessiongate-recorded"] == "true"
        events = sse_events(response)
        assert events[-1] == "[DONE]" and len(events) == 2
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "ok"
        records = httpx.get(f"{gw.url}/sessions/{session_id}").json()["records"]
        assert len(records) == 1 and records[0]["request"]["stream"] is True


class _TwoChoiceEngine(_JsonEngine):
    """A whole reply with two choices, a tool call, per-choice logprobs and usage: what the
    one-chunk stream keeps of it is the rollout framework's choice, not the reply's."""

    reply: ClassVar[dict[str, Any]] = {
        "id": "r1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "héllo",
                    "reasoning_content": "think",
                    "tool_calls": [
                        {"id": "c0", "type": "function", "function": {"name": "f"}},
                        {"id": "c1", "type": "function", "function": {"name": "g"}},
                    ],
                },
                "logprobs": {"content": []},
                "finish_reason": "tool_calls",
                "matched_stop": None,
                "meta_info": {
                    "completion_tokens": 2,
                    "output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None]],
                    "e2e_latency": 0.5,
                },
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "second"},
                "finish_reason": "stop",
            },
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def test_buffered_stream_is_the_framework_s_one_chunk() -> None:
    # miles/rollout/session/core.py `_chat_client_response` and `_response_to_stream_chunk`:
    # one sized body of one event and `[DONE]`, fresh SSE headers, the first choice only
    # (index 0, no logprobs, no meta_info), the tool calls indexed, then the usage.
    with gateway_over(_TwoChoiceEngine) as gw:
        session_id, response = first_turn(gw, stream=True)
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        assert "transfer-encoding" not in response.headers
        assert int(response.headers["content-length"]) == len(response.content)
        message = _TwoChoiceEngine.reply["choices"][0]["message"]
        chunk = {
            "id": "r1",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "content": "héllo",
                        "reasoning_content": "think",
                        "tool_calls": [
                            {**call, "index": index}
                            for index, call in enumerate(message["tool_calls"])
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }
        event = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
        assert response.content == b"data: " + event + b"\n\ndata: [DONE]\n\n"
        assert len(httpx.get(f"{gw.url}/sessions/{session_id}").json()["records"]) == 1
