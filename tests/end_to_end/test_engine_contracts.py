"""What sessiongate sends to and keeps from a real SGLang, end to end: real `serve` and
`mock-engine` processes on loopback, the mock holding SGLang 0.5.23's contracts
(tests/mock_engine/test_sglang_conformance.py), the engine's captured requests as the witness.

Each test names the rollout framework's or SGLang's behaviour it follows.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import R3_ENGINE, gateway_over
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with mock_engine(*R3_ENGINE) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(engine: ServerProcess) -> Iterator[httpx.Client]:
    with gateway_over(engine, "--r3", "--r3-topk", "2") as c:
        yield c


st_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is in the test extra")


def last_upstream(engine: ServerProcess) -> tuple[dict[str, Any], dict[str, str]]:
    """The last chat request the engine received: (body, lower-cased headers)."""
    log = httpx.get(engine.url + "/mock/requests", params={"last": 1}).json()
    return log["requests"][-1], log["headers"][-1]


def new_session(client: httpx.Client) -> str:
    sid: str = client.post("/sessions", json={}).json()["session_id"]
    return sid


def turn(
    client: httpx.Client,
    sid: str,
    messages: list[dict[str, Any]],
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> httpx.Response:
    return client.post(
        f"/sessions/{sid}/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 8, **extra},
        headers=headers,
    )


def run_session(client: httpx.Client, sid: str, turns: int, **extra: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start the task"}]
    for index in range(turns):
        reply = turn(client, sid, messages, **extra)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        messages.append({"role": "tool", "content": f"observation {index}"})
    return messages


# -- headers ------------------------------------------------------------------------------


def test_client_headers_reach_the_engine_with_the_routing_key(
    client: httpx.Client, engine: ServerProcess
) -> None:
    # The rollout framework forwards the client's headers (miles/rollout/session/server.py
    # drops only content-length, transfer-encoding and host) and adds X-SMG-Routing-Key
    # (miles/rollout/session/core.py chat_completions), which SGLang reads as routing_key.
    sid = new_session(client)
    headers = {"Authorization": "Bearer engine-key", "X-Trace-Id": "t-1", "Connection": "close"}
    assert turn(client, sid, [{"role": "user", "content": "hi"}], headers).status_code == 200
    _, received = last_upstream(engine)
    assert received["authorization"] == "Bearer engine-key"
    assert received["x-trace-id"] == "t-1"
    assert received["x-smg-routing-key"] == sid
    assert received["content-type"] == "application/json"
    assert received.get("connection", "") != "close"  # hop-by-hop: not the client's


def test_routing_key_can_be_turned_off(engine: ServerProcess) -> None:
    with gateway_over(engine, "--no-smg-routing-key", workers="0") as gw:
        sid = new_session(gw)
        assert turn(gw, sid, [{"role": "user", "content": "hi"}]).status_code == 200
        _, received = last_upstream(engine)
        assert "x-smg-routing-key" not in received


def test_routing_mode_header_replaces_the_default_one(engine: ServerProcess) -> None:
    with gateway_over(engine, "--session-routing", "smg_routing_key", workers="0") as gw:
        sid = new_session(gw)
        assert turn(gw, sid, [{"role": "user", "content": "hi"}]).status_code == 200
        log = httpx.get(engine.url + "/mock/requests", params={"last": 1}).json()
        assert log["headers"][-1]["x-smg-routing-key"] == sid


# -- R3 -----------------------------------------------------------------------------------


def test_r3_missing_from_the_reply_is_a_502_and_nothing_is_recorded() -> None:
    with mock_engine() as no_r3, gateway_over(no_r3, "--r3", "--r3-topk", "2") as gw:
        sid = new_session(gw)
        reply = turn(gw, sid, [{"role": "user", "content": "hi"}])
        assert reply.status_code == 502
        assert "routed_experts" in reply.json()["error"]
        assert "--enable-return-routed-experts" in reply.json()["error"]
        assert gw.get(f"/sessions/{sid}").json()["records"] == []


def test_r3_missing_warn_records_and_counts() -> None:
    with (
        mock_engine() as no_r3,
        gateway_over(no_r3, "--r3", "--r3-topk", "2", "--r3-missing", "warn", workers="0") as gw,
    ):
        sid = new_session(gw)
        assert turn(gw, sid, [{"role": "user", "content": "hi"}]).status_code == 200
        assert len(gw.get(f"/sessions/{sid}").json()["records"]) == 1
        assert gw.get("/health").json()["r3_missing_turns"] == 1


def _rows(meta: dict[str, Any]) -> int:
    return len(base64.b64decode(meta["routed_experts"])) // (3 * 2 * 4)


def test_addition_r3_asks_for_new_rows_only_and_trajectories_match_full_r3(
    engine: ServerProcess, client: httpx.Client
) -> None:
    # miles/rollout/session/core.py _maybe_request_addition_r3: routed_experts_start_len =
    # len(checkpoint) - 1; samples/merge.py merge_samples_with_addition_r3 concatenates.
    with gateway_over(engine, "--r3", "--r3-topk", "2", "--r3-addition") as addition:
        full_sid, add_sid = new_session(client), new_session(addition)
        run_session(client, full_sid, 4, seed=7)
        run_session(addition, add_sid, 4, seed=7)
        full = client.get(f"/sessions/{full_sid}").json()
        added = addition.get(f"/sessions/{add_sid}").json()
        assert (
            full["metadata"]["accumulated_token_ids"] == added["metadata"]["accumulated_token_ids"]
        )
        checkpoint = 0
        for record in added["records"]:
            request, meta = record["request"], record["response"]["choices"][0]["meta_info"]
            assert request["routed_experts_start_len"] == max(0, checkpoint - 1)
            end = len(request["input_ids"]) + meta["completion_tokens"] - 1
            assert _rows(meta) == end - request["routed_experts_start_len"]
            checkpoint = end + 1
        full_file = st_numpy.load(client.get(f"/sessions/{full_sid}/trajectory").content)
        added_file = st_numpy.load(addition.get(f"/sessions/{add_sid}/trajectory").content)
        assert sorted(full_file) == sorted(added_file) and "routed_experts" in full_file
        for name, tensor in full_file.items():
            assert tensor.dtype == added_file[name].dtype
            assert tensor.tobytes() == added_file[name].tobytes(), name


def test_addition_r3_needs_r3(engine: ServerProcess) -> None:
    port = free_port()
    proc = ServerProcess(
        ["serve", "--port", str(port), "--backend", engine.url, "--r3-addition"], port
    )
    with pytest.raises(RuntimeError, match="--r3-addition needs --r3"):
        proc.start()


# -- the upstream body ----------------------------------------------------------------------


def test_template_kwargs_reach_the_prompt_and_the_engine(engine: ServerProcess) -> None:
    # miles/rollout/session/core.py prepare_chat_request: the request's chat_template_kwargs
    # over the server's, rendered into the prompt and sent on to the engine.
    with gateway_over(
        engine, "--chat-template-kwargs", '{"enable_thinking": true}', workers="0"
    ) as gw:
        messages = [{"role": "user", "content": "think about it"}]
        on = turn(gw, new_session(gw), messages)
        body_on, _ = last_upstream(engine)
        off = turn(gw, new_session(gw), messages, chat_template_kwargs={"enable_thinking": False})
        body_off, _ = last_upstream(engine)
        assert on.status_code == off.status_code == 200
        assert body_on["chat_template_kwargs"] == {"enable_thinking": True}
        assert body_off["chat_template_kwargs"] == {"enable_thinking": False}
        assert body_on["input_ids"] != body_off["input_ids"]
        bad = turn(gw, new_session(gw), messages, chat_template_kwargs=["x"])
        assert bad.status_code == 400
        assert "chat_template_kwargs must be an object" in bad.json()["error"]


def test_client_fields_pass_through_and_tito_fields_win(
    client: httpx.Client, engine: ServerProcess
) -> None:
    sid = new_session(client)
    reply = turn(
        client,
        sid,
        [{"role": "user", "content": "hi"}],
        return_meta_info=False,
        logprobs=False,
        input_ids=[1, 2, 3],
        lora_path="client-adapter",
        custom_field={"kept": True},
    )
    assert reply.status_code == 200, reply.text
    body, _ = last_upstream(engine)
    assert body["return_meta_info"] is True and body["logprobs"] is True
    assert body["input_ids"] != [1, 2, 3]
    assert body["lora_path"] == "client-adapter"
    assert body["custom_field"] == {"kept": True}
    assert body["stream"] is False


def test_lora_path_flag_serves_every_turn_with_the_adapter(engine: ServerProcess) -> None:
    # miles/rollout/session/core.py prepare_chat_request: lora_path = the trained adapter.
    with gateway_over(engine, "--lora-path", "trained", workers="0") as gw:
        assert turn(gw, new_session(gw), [{"role": "user", "content": "hi"}]).status_code == 200
        body, _ = last_upstream(engine)
        assert body["lora_path"] == "trained"


# -- what a record keeps -------------------------------------------------------------------


def test_weight_version_and_cached_tokens_are_in_records_and_samples() -> None:
    # SGLang: meta_info.weight_version and metadata.weight_version (utils/weight_versions.py),
    # meta_info.cached_tokens (managers/tokenizer_manager.py); the framework's samples carry
    # weight_versions and prefix_cache_info (miles/rollout/session/samples/merge.py).
    with mock_engine("--weight-version", "step-7") as eng, gateway_over(eng, workers="0") as gw:
        sid = new_session(gw)
        # Natural stops (a "length" turn would end the merged sample, as in the framework).
        messages = run_session(gw, sid, 1, max_tokens=64)
        update = httpx.post(eng.url + "/update_weight_version", json={"new_version": "step-8"})
        assert update.status_code == 200
        assert turn(gw, sid, messages, max_tokens=64).status_code == 200
        records = gw.get(f"/sessions/{sid}").json()["records"]
        assert [r["weight_version"] for r in records] == ["step-7", "step-8"]
        assert records[0]["cached_tokens"] == 0
        # The second prompt extends the first sequence: the engine's prefix cache served it.
        assert records[1]["cached_tokens"] > 0
        meta = records[1]["response"]["choices"][0]["meta_info"]
        assert records[1]["cached_tokens"] == meta["cached_tokens"]
        samples = gw.post(f"/sessions/{sid}/samples", json={})
        assert samples.status_code == 200
        assert b'"weight_versions":["step-7","step-8"]' in samples.content


def test_an_aborted_turn_is_recorded_and_marked() -> None:
    # SGLang's graceful abort (managers/schedule_batch.py FINISH_ABORT, tokenizer_manager.py
    # _handle_abort_finish_reason): 200 with finish_reason "abort"; the framework's sample
    # status is ABORTED (miles/rollout/session/samples/merge.py).
    with mock_engine() as eng, gateway_over(eng, workers="0") as gw:
        sid = new_session(gw)
        assert httpx.post(eng.url + "/mock/abort_next", json={"after_tokens": 2}).status_code == 200
        reply = turn(gw, sid, [{"role": "user", "content": "hi"}])
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "abort"
        record = gw.get(f"/sessions/{sid}").json()["records"][0]
        assert record["status"] == "aborted" and record["finish_reason"] == "abort"
        assert gw.get("/health").json()["turns_aborted"] == 1
        samples = gw.post(f"/sessions/{sid}/samples", json={}).content
        assert b'"status":"aborted"' in samples


def test_reasoning_content_is_kept_and_compared_strictly() -> None:
    # SGLang's reasoning parser (parser/reasoning_parser.py) splits reasoning_content out of
    # the message; the framework's strict matcher compares it (message_matcher_hub).
    with (
        mock_engine("--reasoning-parser", "qwen3") as eng,
        gateway_over(eng, workers="0") as gw,
    ):
        sid = new_session(gw)
        messages = run_session(gw, sid, 2)
        assert messages[1]["reasoning_content"]
        stored = gw.get(f"/sessions/{sid}").json()
        record_message = stored["records"][0]["response"]["choices"][0]["message"]
        assert record_message["reasoning_content"] == messages[1]["reasoning_content"]
        # The re-render puts the thinking back through the template (its newlines around the
        # block differ from what was sampled): reported, never re-tokenized into the prompt.
        assert {m["type"] for m in stored["metadata"]["tito_session_mismatch_detail"]} <= {
            "assistant_text"
        }
        # The framework's report also counts a last turn max_tokens cut off before its
        # end-of-turn token (special_token_count).
        assert {m["type"] for m in stored["metadata"]["tito_session_mismatch"]} <= {
            "assistant_text",
            "special_token_count",
        }
        # An echo without the first turn's reasoning diverges two assistant steps back: the
        # strict matcher sees it, and the turn rolls back to before that step.
        dropped = [messages[0], {**messages[1], "reasoning_content": None}, *messages[2:]]
        assert turn(gw, sid, dropped).status_code == 200
        records = gw.get(f"/sessions/{sid}").json()["records"]
        assert [r["rollback_steps"] for r in records] == [2]
    with (
        mock_engine("--reasoning-parser", "qwen3") as eng,
        gateway_over(eng, "--message-matcher", "role_content_only", workers="0") as gw,
    ):
        sid = new_session(gw)
        messages = run_session(gw, sid, 2)
        loose = [messages[0], {**messages[1], "reasoning_content": None}, *messages[2:]]
        assert turn(gw, sid, loose).status_code == 200
        assert len(gw.get(f"/sessions/{sid}").json()["records"]) == 3


def test_unknown_message_matcher_is_refused_at_start(engine: ServerProcess) -> None:
    port = free_port()
    argv = ["serve", "--port", str(port), "--backend", engine.url, "--message-matcher", "nope"]
    with pytest.raises(RuntimeError, match="--message-matcher"):
        ServerProcess(argv, port).start()


def test_indexer_top_k_is_recorded_and_in_samples() -> None:
    # The framework's indexer replay: return_indexer_topk, meta_info.indexer_topk decoded
    # with indexer_topk_num_layers (miles/rollout/generate_utils/generate_endpoint_utils.py).
    np = pytest.importorskip("numpy")
    with (
        mock_engine("--indexer-layers", "2", "--indexer-topk", "4") as eng,
        gateway_over(eng, "--indexer-replay", "--indexer-topk", "4", workers="0") as gw,
    ):
        sid = new_session(gw)
        reply = turn(gw, sid, [{"role": "user", "content": "hi"}], max_tokens=64)
        assert reply.status_code == 200
        assert "indexer_topk" not in reply.json()["choices"][0]["meta_info"]  # the record's
        body, _ = last_upstream(eng)
        assert body["return_indexer_topk"] is True
        record = gw.get(f"/sessions/{sid}").json()["records"][0]
        assert record["response"]["choices"][0]["meta_info"]["indexer_topk"]
        tensors = st_numpy.load(gw.post(f"/sessions/{sid}/samples", json={}).content)
        tokens = tensors["tokens.0"]
        assert tensors["rollout_indexer_topk.0"].shape == (len(tokens) - 1, 2, 4)
        assert tensors["rollout_indexer_topk.0"].dtype == np.int32


# -- streamed turns ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parser_engine() -> Iterator[ServerProcess]:
    # Relayed turns need an engine whose stream carries every logprob: one with a parser
    # (against others the gateway serves streamed turns buffered; test_relay_exact.py).
    with mock_engine(*R3_ENGINE, "--tool-call-parser", "qwen25") as proc:
        yield proc


def sse_data(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_relayed_stream_is_recorded_token_exactly_like_a_whole_turn(
    parser_engine: ServerProcess,
) -> None:
    # SGLang rejects return_meta_info with stream (serving_chat.py); the relay asks for the
    # ids in sglext and the usage, and rebuilds the record (session/stream.py).
    engine = parser_engine
    with (
        gateway_over(engine, "--r3", "--r3-topk", "2", "--stream-upstream", "relay") as gw,
        gateway_over(engine, "--r3", "--r3-topk", "2") as client,
    ):
        streamed, whole = new_session(gw), new_session(client)
        messages = [{"role": "user", "content": "tell me"}]
        reply = turn(gw, streamed, messages, stream=True, seed=3)
        assert reply.status_code == 200
        events = sse_data(reply)
        assert events[-1] == "[DONE]" and len(events) > 3
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["choices"] for c in chunks)  # no sglext (R3) or unasked-for usage chunk
        assert all("meta_info" not in json.dumps(c) for c in chunks)
        sent, _ = last_upstream(engine)
        assert sent["stream"] is True and sent["return_meta_info"] is False
        assert sent["return_output_ids_in_sglext"] is True
        assert sent["stream_options"] == {"include_usage": True}

        assert turn(client, whole, messages, seed=3).status_code == 200
        relayed = gw.get(f"/sessions/{streamed}").json()
        buffered = client.get(f"/sessions/{whole}").json()
        assert (
            relayed["metadata"]["accumulated_token_ids"]
            == buffered["metadata"]["accumulated_token_ids"]
        )
        relayed_meta = relayed["records"][0]["response"]["choices"][0]["meta_info"]
        whole_meta = buffered["records"][0]["response"]["choices"][0]["meta_info"]
        assert relayed_meta["output_token_logprobs"] == whole_meta["output_token_logprobs"]
        assert relayed_meta["routed_experts"] == whole_meta["routed_experts"]
        assert relayed["records"][0]["weight_version"] is None  # SGLang streams none
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert content == buffered["records"][0]["response"]["choices"][0]["message"]["content"]


def test_relayed_stream_usage_only_when_asked(parser_engine: ServerProcess) -> None:
    with gateway_over(parser_engine, "--stream-upstream", "relay", workers="0") as gw:
        sid = new_session(gw)
        options = {"include_usage": True}
        reply = turn(
            gw, sid, [{"role": "user", "content": "hi"}], stream=True, stream_options=options
        )
        usage = [json.loads(e) for e in sse_data(reply)[:-1] if not json.loads(e)["choices"]]
        assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] > 0
