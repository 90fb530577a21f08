"""The gateway renders prompts by the rules of the SGLang version its engines run: real
`serve` and mock-engine processes on loopback, the mock standing in for SGLang 0.5.16 or
0.5.23 (`--sglang-version`, reported by its `/server_info` as SGLang's http_server.py does).

A turn with a tool: the prompt ids the engine received are the mock's own render of the same
request (the mock renders with that version's rules), and they differ between the versions
(0.5.16 writes `"strict": false` and puts `description` first). Engines of two versions
behind one gateway: the start is refused, naming each engine's version. A registered engine
whose version renders differently from the gateway's rules: refused with 409.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sessiongate.sglang_rules import rules_for
from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Find the news."}],
    "tools": [SEARCH],
    "max_tokens": 4,
}

OTHER = {"0.5.16": "0.5.23", "0.5.23": "0.5.16"}


@contextmanager
def gateway(workers: str, *extra: str) -> Iterator[ServerProcess]:
    port = free_port()
    args = ["serve", "--workers", workers, "--port", str(port), "--health-interval", "0.5"]
    with ServerProcess([*args, *extra], port, timeout=60.0) as server:
        yield server


@pytest.mark.parametrize(
    ("version", "workers"), [("0.5.16", "1"), ("0.5.23", "1"), ("0.5.16", "0")]
)
def test_a_turn_renders_by_the_engines_version(version: str, workers: str) -> None:
    with (
        mock_engine("--sglang-version", version) as engine,
        gateway(workers, "--backend", engine.url) as gw,
    ):
        assert httpx.get(engine.url + "/server_info").json()["version"] == version
        assert f"prompts render by SGLang {version} rules (the engines run SGLang {version})" in (
            gw.output()
        )
        client = httpx.Client(base_url=gw.url, timeout=30.0)
        sid = client.post("/sessions", json={}).json()["session_id"]
        reply = client.post(f"/sessions/{sid}/v1/chat/completions", json=BODY)
        assert reply.status_code == 200, reply.text
        (sent,) = httpx.get(engine.url + "/mock/requests", params={"last": 1}).json()["requests"]
        direct = httpx.post(
            engine.url + "/v1/chat/completions",
            json={**BODY, "return_input_ids_in_sglext": True},
        )
        assert direct.status_code == 200, direct.text
        assert sent["input_ids"] == direct.json()["sglext"]["input_ids"]
        # The version's own render, and not the other version's.
        tok = load_tokenizer(None, sglang_rules=rules_for(version))
        ids = tok.apply_chat_template(BODY["messages"], add_generation_prompt=True, tools=[SEARCH])
        assert sent["input_ids"] == ids
        other = load_tokenizer(None, sglang_rules=rules_for(OTHER[version]))
        assert (
            other.apply_chat_template(BODY["messages"], add_generation_prompt=True, tools=[SEARCH])
            != ids
        )
        assert ('"strict": false' in tok.decode(ids)) == (version == "0.5.16")


def test_engines_of_two_versions_refuse_the_start() -> None:
    with (
        mock_engine("--sglang-version", "0.5.16") as old,
        mock_engine("--sglang-version", "0.5.23") as new,
    ):
        argv = ["serve", "--workers", "1", "--port", str(free_port())]
        argv += ["--backend", old.url, "--backend", new.url]
        done = subprocess.run(
            [sys.executable, "-m", "sessiongate", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "the engines run different SGLang versions" in said, said
    assert f"{old.url} runs 0.5.16" in said and f"{new.url} runs 0.5.23" in said, said


def test_a_given_version_needs_no_engine_and_reaches_the_embedded_mock() -> None:
    with gateway("1", "--sglang-version", "0.5.16") as gw:
        assert "prompts render by SGLang 0.5.16 rules (--sglang-version 0.5.16)" in gw.output()
        client = httpx.Client(base_url=gw.url, timeout=30.0)
        sid = client.post("/sessions", json={}).json()["session_id"]
        reply = client.post(f"/sessions/{sid}/v1/chat/completions", json=BODY)
        assert reply.status_code == 200, reply.text


def test_a_registered_engine_of_another_rule_set_is_refused() -> None:
    with (
        mock_engine("--sglang-version", "0.5.16") as old,
        mock_engine("--sglang-version", "0.5.24") as newer,
        gateway("1", "--backend", "none") as gw,
    ):
        # No engine at start: the newest rules, said so.
        assert "no engine configured yet" in gw.output()
        client = httpx.Client(base_url=gw.url, timeout=30.0)
        reply = client.post("/workers", json={"url": old.url, "worker_type": "regular"})
        assert reply.status_code == 409, reply.text
        error = reply.json()["error"]
        assert "runs SGLang 0.5.16" in error and "SGLang 0.5.23 rules" in error, error
        assert client.get("/list_workers").json() == {"urls": []}
        # A newer release with the same rules is welcome.
        reply = client.post("/workers", json={"url": newer.url, "worker_type": "regular"})
        assert reply.status_code == 202, reply.text
        assert client.get("/list_workers").json() == {"urls": [newer.url]}
