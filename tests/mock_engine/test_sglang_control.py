"""The mock engine against SGLang 0.5.23's generation control routes, over real HTTP:
`/pause_generation`, `/continue_generation`, `/ready`, `/health_generate`,
`/update_weights_from_disk`, `/update_weight_version`, `/get_model_info`.

Every test names the SGLang source the fact was read from; paths are under `sglang/srt/` in
the sglang-0.5.23 wheel. No test waits for time to pass to see something happen: a test
waits for the mock's own counters (`/mock/stats` `held`, `in_flight`) and orders events with
round trips through the engine's event loop; the few fixed sleeps only give a broken mock
the chance to show bytes it should not send.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from support.procs import ServerProcess, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

MODEL = "sessiongate-mock"
TOKENS = 30  # natural completion length; at 20 ms a token a request runs ~0.6 s
PAUSED_OK = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED_OK = {"message": "Generation continued successfully.", "status": "ok"}
WAIT_S = 10.0  # generous: how long a test waits for something that must happen


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    args = ["--token-delay-ms", "20", "--completion-tokens", str(TOKENS)]
    args += ["--weight-version", "w0", "--health-check-timeout", "0.3"]
    args += ["--reject-model-path", "/no/such/model"]
    with mock_engine(*args) as proc:
        yield proc


@pytest.fixture(scope="module")
def fast() -> Iterator[ServerProcess]:
    """The same engine without delays: the replies a paused request must end up with."""
    with mock_engine("--completion-tokens", str(TOKENS)) as proc:
        yield proc


@pytest.fixture(scope="module")
def stepper() -> Iterator[ServerProcess]:
    args = ["--step-scheduler", "--decode-step-ms", "20", "--completion-tokens", str(TOKENS)]
    with mock_engine(*args) as proc:
        yield proc


@pytest.fixture(autouse=True)
def unpaused(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves its engines running, whatever it asserted."""
    yield
    for name in ("engine", "stepper"):
        if name in request.fixturenames:
            proc: ServerProcess = request.getfixturevalue(name)
            httpx.post(proc.url + "/continue_generation", json={}, timeout=WAIT_S)


def control(engine: ServerProcess, path: str, body: Any = None) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=WAIT_S)


def stats(engine: ServerProcess) -> dict[str, Any]:
    return httpx.get(engine.url + "/mock/stats", timeout=WAIT_S).json()


def loads(engine: ServerProcess) -> dict[str, Any]:
    load: dict[str, Any] = httpx.get(engine.url + "/v1/loads", timeout=WAIT_S).json()["loads"][0]
    return load


def wait_for(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], "seed": 1, **extra}


class Raw:
    """One HTTP request on its own socket, so a test can see which bytes did (not) arrive."""

    def __init__(self, engine: ServerProcess, path: str, body: Any) -> None:
        self.engine = engine
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        host, port = engine.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        self.sock.sendall(head + payload)
        self.data = b""

    def pending(self) -> bytes:
        """What arrived so far. The /health round trip first: bytes the engine had already
        queued are written by the time it answers (one event loop)."""
        httpx.get(self.engine.url + "/health", timeout=WAIT_S)
        self.sock.setblocking(False)
        try:
            while piece := self.sock.recv(65536):
                self.data += piece
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(WAIT_S)
        return self.data

    def until(self, marker: bytes) -> bytes:
        while marker not in self.data:
            piece = self.sock.recv(65536)
            assert piece, self.data
            self.data += piece
        return self.data

    def rest(self) -> tuple[int, bytes]:
        """The whole response once the engine closes it: (status, decoded body)."""
        while piece := self.sock.recv(65536):
            self.data += piece
        self.sock.close()
        head, _, body = self.data.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            body = _unchunk(body)
        return int(head.split(b" ", 2)[1]), body


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, body = out + body[:size], body[size + 2 :]
    return out


def sse_data(body: bytes) -> list[Any]:
    out: list[Any] = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[len(b"data: ") :]
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def stream_text(body: bytes) -> tuple[str, str | None]:
    """A chat stream's content and its finish reason."""
    text, finish = "", None
    for event in sse_data(body):
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def posting(url: str, body: Any) -> Callable[[], httpx.Response]:
    return lambda: httpx.post(url, json=body, timeout=WAIT_S)


def in_thread(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        result["reply"] = call()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, result


# ---------------------------------------------------------------- the routes' replies


def test_pause_continue_ready_replies(engine: ServerProcess) -> None:
    # entrypoints/http_server.py `pause_generation`, `continue_generation` (their replies),
    # `ready` (tokenizer_manager.py `is_ready` = not is_pause and healthy; empty body) and
    # `health_generate` (GET /health answers 200 without generating unless
    # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is set, paused or not).
    assert httpx.get(engine.url + "/ready").status_code == 200
    paused = control(engine, "/pause_generation", {})
    assert (paused.status_code, paused.json()) == (200, PAUSED_OK)
    now = stats(engine)
    assert (now["paused"], now["pause_mode"]) == (True, "abort")  # io_struct.py default
    ready = httpx.get(engine.url + "/ready")
    assert (ready.status_code, ready.content) == (503, b"")
    assert httpx.get(engine.url + "/health").status_code == 200
    go = control(engine, "/continue_generation", {"torch_empty_cache": False})
    assert (go.status_code, go.json()) == (200, CONTINUED_OK)
    assert (stats(engine)["paused"], stats(engine)["pause_mode"]) == (False, None)
    ready = httpx.get(engine.url + "/ready")
    assert (ready.status_code, ready.content) == (200, b"")
    # tokenizer_manager.py `continue_generation` just clears is_pause: fine when not paused.
    assert control(engine, "/continue_generation", {}).json() == CONTINUED_OK


@pytest.mark.parametrize(
    ("path", "body", "problem"),
    [
        # FastAPI requires a Body() parameter even when all its fields have defaults;
        # http_server.py's RequestValidationError handler answers 400 "Bad Request".
        ("/pause_generation", None, "Field required"),
        ("/continue_generation", None, "Field required"),
        ("/update_weights_from_disk", None, "Field required"),
        ("/pause_generation", [], "Input should be an object"),
        # io_struct.py PauseGenerationReqInput.mode: Literal["abort", "retract", "in_place"].
        ("/pause_generation", {"mode": "sleep"}, "literal_error"),
        # ContinueGenerationReqInput.torch_empty_cache: bool.
        ("/continue_generation", {"torch_empty_cache": "yes"}, "bool_type"),
        # UpdateWeightFromDiskReqInput.model_path: str, required.
        ("/update_weights_from_disk", {}, "'missing', 'loc': ('body', 'model_path')"),
        ("/update_weights_from_disk", {"model_path": 7}, "string_type"),
        ("/update_weights_from_disk", {"model_path": "m", "flush_cache": 1}, "bool_type"),
    ],
)
def test_control_bodies_are_validated(
    engine: ServerProcess, path: str, body: Any, problem: str
) -> None:
    reply = control(engine, path, body)
    assert reply.status_code == 400
    error = reply.json()
    assert (error["type"], error["code"]) == ("Bad Request", 400)
    assert problem in error["message"]
    assert stats(engine)["paused"] is False  # a refused pause does not pause


def test_model_and_server_info_aliases_agree(engine: ServerProcess) -> None:
    # http_server.py: `/get_model_info` returns `model_info()`, `/get_server_info` returns
    # `server_info()` (both deprecated aliases).
    for new, old in (("/model_info", "/get_model_info"), ("/server_info", "/get_server_info")):
        assert httpx.get(engine.url + new).json() == httpx.get(engine.url + old).json()


def test_health_generate(engine: ServerProcess) -> None:
    # http_server.py `health_generate`: a one-token generation through generate_request,
    # which waits on is_pause_cond while paused; no output within HEALTH_CHECK_TIMEOUT
    # (SGLANG_HEALTH_CHECK_TIMEOUT, default 20; the mock's --health-check-timeout) -> 503.
    assert httpx.get(engine.url + "/health_generate", timeout=WAIT_S).status_code == 200
    control(engine, "/pause_generation", {"mode": "in_place"})
    probe = httpx.get(engine.url + "/health_generate", timeout=WAIT_S)
    assert (probe.status_code, probe.content) == (503, b"")
    control(engine, "/continue_generation", {})
    assert httpx.get(engine.url + "/health_generate", timeout=WAIT_S).status_code == 200


# ---------------------------------------------------------------- requests in flight


def test_abort_pause_aborts_requests_in_flight(engine: ServerProcess) -> None:
    # tokenizer_manager.py `pause_generation` (mode "abort"): abort_request(abort_all=True)
    # until the model_update_lock has no reader left, then the reply; the requests finish
    # with FINISH_ABORT (a 200 whose finish_reason is "abort", like /abort_request).
    aborted = stats(engine)["aborted"]
    url = engine.url + "/v1/chat/completions"
    body = chat("abort me", return_meta_info=True)
    worker, result = in_thread(lambda: httpx.post(url, json=body, timeout=WAIT_S))
    wait_for(lambda: stats(engine)["in_flight"] == 1)
    assert control(engine, "/pause_generation", {"mode": "abort"}).json() == PAUSED_OK
    assert stats(engine)["in_flight"] == 0  # answered once nothing runs
    worker.join(WAIT_S)
    reply = result["reply"]
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert choice["meta_info"]["completion_tokens"] < TOKENS
    assert stats(engine)["aborted"] == aborted + 1


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_halting_pause_stops_a_stream_until_continue(
    engine: ServerProcess, fast: ServerProcess, mode: str
) -> None:
    # scheduler.py `pause_generation`: in_place leaves the running batch as it is, retract
    # moves it back to the waiting queue; either way `event_loop_normal` runs no batch
    # while _engine_paused, and `continue_generation` resumes it. The request finishes as
    # it would have without the pause (same text, natural stop), after the continue.
    body = chat(f"halt {mode}", stream=True)
    reference = httpx.post(fast.url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    stream = Raw(engine, "/v1/chat/completions", body)
    stream.until(b"data: ")  # the role chunk: the request runs
    assert control(engine, "/pause_generation", {"mode": mode}).json() == PAUSED_OK
    seen = stream.pending()
    assert b"[DONE]" not in seen
    time.sleep(0.3)  # 15 token delays: a stream that was not halted would show chunks
    assert stream.pending() == seen
    load = loads(engine)
    # load_inquirer.py `get_loads`: retracted requests are in the waiting queue.
    running, waiting = (0, 1) if mode == "retract" else (1, 0)
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (running, waiting)
    control(engine, "/continue_generation", {})
    status, raw = stream.rest()
    assert status == 200
    assert stream_text(raw) == stream_text(reference.content)
    assert stream_text(raw)[1] == "stop"


def test_halting_pause_stops_the_step_scheduler(stepper: ServerProcess) -> None:
    # scheduler.py `pause_generation` / `event_loop_normal` with the step scheduler: no
    # step runs while paused (its step counter stands still), retract moves the running
    # request to the waiting queue and it is admitted again (once counted) after continue.
    url = stepper.url + "/v1/chat/completions"
    before = stats(stepper)["adapter_requests"].get("", 0)
    body = chat("step halt", return_meta_info=True)
    worker, result = in_thread(lambda: httpx.post(url, json=body, timeout=WAIT_S))
    wait_for(lambda: loads(stepper)["num_running_reqs"] == 1)
    control(stepper, "/pause_generation", {"mode": "in_place"})
    steps = stats(stepper)["scheduler_steps"]
    time.sleep(0.2)  # 10 decode steps
    assert stats(stepper)["scheduler_steps"] == steps
    control(stepper, "/pause_generation", {"mode": "retract"})
    load = loads(stepper)
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
    assert worker.is_alive()
    control(stepper, "/continue_generation", {})
    worker.join(WAIT_S)
    choice = result["reply"].json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["meta_info"]["completion_tokens"] == TOKENS
    assert stats(stepper)["adapter_requests"][""] == before + 1


# ---------------------------------------------------------------- requests arriving paused

ARRIVALS = [
    ("/v1/chat/completions", chat("late", max_tokens=3), False),
    ("/v1/chat/completions", chat("late", max_tokens=3, stream=True), False),
    ("/generate", {"text": "late", "sampling_params": {"max_new_tokens": 3}}, False),
    # http_server.py `serve_generate_request` returns the StreamingResponse before
    # generate_request runs: a held /generate stream has its 200 and headers already.
    ("/generate", {"text": "late", "sampling_params": {"max_new_tokens": 3}, "stream": True}, True),
    (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "late"}]},
        False,
    ),
    ("/v1/responses", {"input": "late", "max_output_tokens": 3}, False),
]


@pytest.mark.parametrize(("path", "body", "headers_first"), ARRIVALS)
def test_requests_arriving_while_paused_wait_for_continue(
    engine: ServerProcess, path: str, body: dict[str, Any], headers_first: bool
) -> None:
    # tokenizer_manager.py `generate_request`: after the request is checked, `async with
    # is_pause_cond: await is_pause_cond.wait_for(lambda: not is_pause)`; nothing refuses
    # it. `continue_generation` notifies the condition and it is served. serving_chat.py
    # `_handle_streaming_request` awaits the first chunk before its 200.
    before = stats(engine)["arrived_while_paused_by_route"].get(path, 0)
    control(engine, "/pause_generation", {"mode": "retract"})
    request = Raw(engine, path, body)
    wait_for(lambda: stats(engine)["held"] == 1)
    seen = request.pending()
    if headers_first:
        assert seen.startswith(b"HTTP/1.1 200") and b"data: " not in seen
    else:
        assert seen == b""
    now = stats(engine)
    assert now["arrived_while_paused_by_route"][path] == before + 1
    assert now["in_flight"] == 0  # nothing reached the scheduler
    control(engine, "/continue_generation", {})
    status, raw = request.rest()
    assert status == 200, raw
    assert stats(engine)["held"] == 0
    if body.get("stream"):
        assert sse_data(raw)[-1] == "[DONE]"
    else:
        assert json.loads(raw)


def test_count_tokens_and_control_routes_are_not_counted(engine: ServerProcess) -> None:
    # Only generation routes wait at the pause (control, health, count_tokens do not).
    control(engine, "/pause_generation", {})
    before = stats(engine)["arrived_while_paused"]
    count = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(engine.url + "/v1/messages/count_tokens", json=count, timeout=WAIT_S)
    assert reply.status_code == 200
    assert httpx.get(engine.url + "/v1/loads", timeout=WAIT_S).status_code == 200
    assert stats(engine)["arrived_while_paused"] == before


# ---------------------------------------------------------------- weight updates


def version_of(engine: ServerProcess) -> tuple[str, str]:
    """(meta_info.weight_version, metadata.weight_version) of a fresh chat reply."""
    reply = httpx.post(
        engine.url + "/v1/chat/completions",
        json=chat("which version", max_tokens=1, return_meta_info=True),
        timeout=WAIT_S,
    ).json()
    return reply["choices"][0]["meta_info"]["weight_version"], reply["metadata"]["weight_version"]


def test_update_weights_from_disk(engine: ServerProcess) -> None:
    # http_server.py `update_weights_from_disk` (200 on success, 400 on failure, body
    # success/message/num_paused_requests); weight_updater.py (message, num_paused_requests
    # 0); tokenizer_manager.py `update_weights_from_disk` (weight_version set on success
    # only) and `_update_model_path_info` (model_path and served_model_name move);
    # http_server.py `model_info` / `available_models` read them; `server_info` keeps the
    # startup arguments (its docstring: control-plane changes are /model_info's).
    assert version_of(engine) == ("w0", "w0")
    url = engine.url + "/update_weights_from_disk"
    try:
        done = httpx.post(url, json={"model_path": "org/next", "weight_version": "w7"}).json()
        assert done == {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to w7.",
            "num_paused_requests": 0,
        }
        info = httpx.get(engine.url + "/model_info").json()
        assert (info["model_path"], info["served_model_name"]) == ("org/next", "org/next")
        assert info["weight_version"] == "w7"
        assert httpx.get(engine.url + "/get_model_info").json() == info
        assert httpx.get(engine.url + "/v1/models").json()["data"][0]["id"] == "org/next"
        server = httpx.get(engine.url + "/server_info").json()
        assert (server["model_path"], server["weight_version"]) == (MODEL, "w0")
        assert version_of(engine) == ("w7", "w7")
        # Without weight_version the version stays.
        same = httpx.post(url, json={"model_path": "org/other"})
        assert (same.status_code, same.json()["message"]) == (
            200,
            "Succeeded to update model weights.",
        )
        assert version_of(engine) == ("w7", "w7")
        # A failed load changes nothing.
        for path in ("/no/such/model", ""):
            failed = httpx.post(url, json={"model_path": path, "weight_version": "bad"})
            assert failed.status_code == 400
            assert failed.json()["success"] is False
            assert failed.json()["num_paused_requests"] == 0
        info = httpx.get(engine.url + "/model_info").json()
        assert (info["model_path"], info["weight_version"]) == ("org/other", "w7")
    finally:
        httpx.post(url, json={"model_path": MODEL, "weight_version": "w0"})


def test_update_weights_from_disk_waits_for_running_requests(engine: ServerProcess) -> None:
    # tokenizer_manager.py `update_weights_from_disk` not paused: the model_update_lock's
    # writer side waits for the running requests (readers) to finish, which answer with
    # the old version; with abort_all_requests they are aborted first.
    url = engine.url + "/update_weights_from_disk"
    chat_url = engine.url + "/v1/chat/completions"
    try:
        for abort, finish in ((False, "stop"), (True, "abort")):
            body = chat(f"drain {abort}", return_meta_info=True)
            worker, result = in_thread(posting(chat_url, body))
            wait_for(lambda: stats(engine)["in_flight"] == 1)
            update = {"model_path": MODEL, "weight_version": f"w-{abort}"}
            assert httpx.post(url, json={**update, "abort_all_requests": abort}).status_code == 200
            assert stats(engine)["in_flight"] == 0
            worker.join(WAIT_S)
            choice = result["reply"].json()["choices"][0]
            assert choice["finish_reason"] == finish
            # Answered before the update: the version of the one before.
            assert choice["meta_info"]["weight_version"] == ("w-False" if abort else "w0")
    finally:
        httpx.post(url, json={"model_path": MODEL, "weight_version": "w0"})


def test_update_under_pause_and_the_cache_flush(engine: ServerProcess) -> None:
    # tokenizer_manager.py `update_weights_from_disk` paused: at once, no lock; weight_updater
    # `flush_cache_after_weight_update` + scheduler.py `flush_cache`: with requests still in
    # the running batch (an in_place pause) the flush fails and so does the update; a
    # retract pause moved them to the waiting queue, which a paused flush ignores. A
    # request finishing after the update reports the new version (meta_info's
    # weight_version is read when the output is handled).
    url = engine.url + "/update_weights_from_disk"
    chat_url = engine.url + "/v1/chat/completions"
    body = chat("across an update", return_meta_info=True)
    worker, result = in_thread(lambda: httpx.post(chat_url, json=body, timeout=WAIT_S))
    try:
        wait_for(lambda: stats(engine)["in_flight"] == 1)
        control(engine, "/pause_generation", {"mode": "in_place"})
        refused = httpx.post(url, json={"model_path": MODEL, "weight_version": "w1"})
        assert refused.status_code == 400
        assert refused.json()["message"].startswith("Weights were updated, but the cache")
        assert httpx.get(engine.url + "/model_info").json()["weight_version"] == "w0"
        control(engine, "/pause_generation", {"mode": "retract"})
        assert httpx.post(url, json={"model_path": MODEL, "weight_version": "w1"}).json()["success"]
        assert worker.is_alive()
        control(engine, "/continue_generation", {})
        worker.join(WAIT_S)
        choice = result["reply"].json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["meta_info"]["weight_version"] == "w1"
    finally:
        control(engine, "/continue_generation", {})
        httpx.post(url, json={"model_path": MODEL, "weight_version": "w0"})


def test_update_weight_version_aborts_unless_told_not_to(engine: ServerProcess) -> None:
    # http_server.py `update_weight_version`: abort_all_requests (default True,
    # io_struct.py UpdateWeightVersionReqInput) aborts every request first; the reply.
    chat_url = engine.url + "/v1/chat/completions"
    try:
        for abort, finish in ((None, "abort"), (False, "stop")):
            body = chat(f"version {abort}", return_meta_info=True)
            worker, result = in_thread(posting(chat_url, body))
            wait_for(lambda: stats(engine)["in_flight"] == 1)
            update: dict[str, Any] = {"new_version": "v9"}
            if abort is not None:
                update["abort_all_requests"] = abort
            reply = control(engine, "/update_weight_version", update)
            assert reply.json() == {
                "success": True,
                "message": "Weight version updated to v9",
                "new_version": "v9",
            }
            worker.join(WAIT_S)
            choice = result["reply"].json()["choices"][0]
            assert choice["finish_reason"] == finish
            assert choice["meta_info"]["weight_version"] == "v9"
    finally:
        control(engine, "/update_weight_version", {"new_version": "w0"})
