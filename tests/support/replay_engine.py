"""A replay engine: an SGLang stand-in that answers each session's chat turns with a script the
test loads, and records the prompt ids it receives.

The peer test (tests/peer/test_framework_tito.py) drives the rollout framework's mock
trajectories through a real gateway and needs an engine that (1) answers turn N of a session
with the trajectory's assistant message and the ids a real model would have sampled for it
(the test computes them with the framework's package) and (2) shows exactly which prompt ids
the gateway sent. Sessions are told apart by `X-SMG-Routing-Key`, which the gateway stamps
with the session id on every session turn, as the rollout framework does.

Run as its own process: `python -m support.replay_engine --port N` (tests/ on the path). It
is the standard library only, so it shares nothing with the gateway it checks. Routes:

- `POST /replay/{session}` `{"turns": [{"message", "ids", "texts"}, ...]}`: the script.
- `GET /replay/{session}`: `{"prompts": [[ids of turn 1], ...], "kwargs": [...]}`, each turn's
  `input_ids` and `chat_template_kwargs` as received.
- `POST /v1/chat/completions`: the next scripted turn of the routing key's session, in SGLang
  0.5.23's non-stream reply shape (serving_chat.py `_build_chat_response`, meta_info as
  tokenizer_manager.py fills it with `return_meta_info` and `logprobs`; the gateway reads
  `meta_info.output_token_logprobs` for the sampled ids). A turn past the script, or a
  request without `input_ids` or a known routing key, is a 400 naming why.
- `GET /health` (200), `/model_info`, `/server_info` (and their `/get_` forms): the
  gateway's probes.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "replay"
WEIGHT_VERSION = "default"


@dataclass
class Script:
    turns: list[dict[str, Any]]
    prompts: list[list[int]] = field(default_factory=list)
    kwargs: list[Any] = field(default_factory=list)


class ReplayServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int) -> None:
        self.scripts: dict[str, Script] = {}
        self.lock = threading.Lock()
        self.counter = 0
        super().__init__(("127.0.0.1", port), _Handler)


def reply(rid: str, prompt_tokens: int, turn: dict[str, Any]) -> dict[str, Any]:
    """SGLang 0.5.23's chat reply for one scripted turn (keys in its order)."""
    message = turn["message"]
    ids: list[int] = turn["ids"]
    texts: list[str] = turn["texts"]
    calls = message.get("tool_calls") or []
    out_message: dict[str, Any] = {
        "role": "assistant",
        "content": message.get("content") or "",
        "reasoning_content": message.get("reasoning_content") or None,
    }
    if calls:
        out_message["tool_calls"] = [
            {
                "id": call.get("id"),
                "index": index,
                "type": "function",
                "function": call["function"],
            }
            for index, call in enumerate(calls)
        ]
        # The tool-call parser rewrites the stop to tool_calls (serving_chat.py).
        finish, matched, meta_finish = "tool_calls", None, {"type": "tool_calls", "matched": None}
    else:
        finish, matched = "stop", ids[-1]
        meta_finish = {"type": "stop", "matched": ids[-1]}
    spans = [{"version": WEIGHT_VERSION, "start": 0, "end": len(ids)}]
    meta = {
        "id": rid,
        "finish_reason": meta_finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": WEIGHT_VERSION,
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [[-0.5, i, t] for i, t in zip(ids, texts, strict=True)],
        "output_token_logprobs_length": len(ids),
        "reasoning_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_versions": spans,
        "cached_tokens_details": None,
        "e2e_latency": 0.001,
        "response_sent_to_client_ts": time.time(),
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": out_message,
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": matched,
                "meta_info": meta,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        },
        "metadata": {"weight_version": WEIGHT_VERSION, "weight_versions": spans},
    }


class _Handler(BaseHTTPRequestHandler):
    server: ReplayServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: object = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"null")

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200)
        elif path in ("/model_info", "/get_model_info"):
            self._send(200, {"model_path": MODEL, "is_generation": True})
        elif path in ("/server_info", "/get_server_info"):
            self._send(200, {"model_path": MODEL})
        elif path.startswith("/replay/"):
            with self.server.lock:
                script = self.server.scripts.get(path[len("/replay/") :])
                if script is None:
                    self._send(404, {"error": "no such session"})
                    return
                self._send(200, {"prompts": script.prompts, "kwargs": script.kwargs})
        else:
            self._send(404, {"error": f"no route {path}"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        body = self._body()
        if path.startswith("/replay/"):
            with self.server.lock:
                self.server.scripts[path[len("/replay/") :]] = Script(body["turns"])
            self._send(200, {})
        elif path == "/v1/chat/completions":
            self._chat(body)
        else:
            self._send(404, {"error": f"no route {path}"})

    def _chat(self, body: Any) -> None:
        key = self.headers.get("X-SMG-Routing-Key")
        prompt = body.get("input_ids") if isinstance(body, dict) else None
        with self.server.lock:
            script = self.server.scripts.get(key or "")
            if script is None:
                self._send(400, {"error": f"no script for routing key {key!r}"})
                return
            if not isinstance(prompt, list):
                self._send(400, {"error": "the request has no input_ids"})
                return
            turn = len(script.prompts)
            if turn >= len(script.turns):
                self._send(400, {"error": f"session {key} has {len(script.turns)} turns"})
                return
            script.prompts.append(prompt)
            script.kwargs.append(body.get("chat_template_kwargs"))
            self.server.counter += 1
            rid = f"replay-{self.server.counter}"
        self._send(200, reply(rid, len(prompt), script.turns[turn]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    server = ReplayServer(parser.parse_args().port)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
