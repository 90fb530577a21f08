"""`mock-engine --sglang-version`: the mock reports the SGLang release it stands in for
where SGLang does, and renders chat prompts by that release's rules.

Sources: sglang/srt/entrypoints/http_server.py `server_info` (also `/get_server_info`) and
sglang/srt/entrypoints/v1_loads.py both carry `"version": __version__` (sglang/version.py),
in the 0.5.16 and 0.5.23 wheels alike; the rules are sglang_rules.py's
(tests/tokenizer/test_sglang_rules.py holds them to each wheel).
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from sessiongate.mock_engine.app import create_app
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.sglang_rules import rules_for
from sessiongate.tokenizer import load_tokenizer

SEARCH = {
    "type": "function",
    "function": {"name": "search", "description": "Search.", "parameters": {"type": "object"}},
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("version", ["0.5.16", "0.5.23"])
def test_the_version_is_reported_and_renders_the_prompt(version: str) -> None:
    with TestClient(create_app(MockEngineConfig(sglang_version=version))) as client:
        for path in ("/server_info", "/get_server_info", "/v1/loads"):
            assert client.get(path).json()["version"] == version, path
        body = {
            "messages": MESSAGES,
            "tools": [SEARCH],
            "max_tokens": 1,
            "return_input_ids_in_sglext": True,
        }
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
    tok = load_tokenizer(None, sglang_rules=rules_for(version))
    expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tools=[SEARCH])
    assert reply.json()["sglext"]["input_ids"] == expected


def test_the_default_is_0_5_23() -> None:
    assert MockEngineConfig().sglang_version == "0.5.23"


def test_a_version_must_be_one() -> None:
    with pytest.raises(ValueError, match="sglang_version 'latest' is not a release number"):
        MockEngineConfig(sglang_version="latest")
