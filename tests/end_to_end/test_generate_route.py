"""SGLang's native `POST /generate` is routed by every layout, byte for byte.

The rollout framework's rollouts call `/generate` on their router (SGLang's native API:
`input_ids`, `sampling_params`, `return_logprob`, RL fields the router does not know). The
gateway relays it as it relays `/v1/...`: the body reaches the engine unchanged, unknown
fields included, and the engine's reply comes back as the engine sent it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from support.procs import ServerProcess, free_port
from support.raw_engine import RawEngine, recording_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

LAYOUTS = {
    "workers 0, compiled front": ("--workers", "0", "--front", "compiled"),
    "workers 0, python front": ("--workers", "0", "--front", "python"),
    "workers 1, compiled front": ("--workers", "1", "--front", "compiled"),
    "workers 1, python front": ("--workers", "1", "--front", "python"),
}
# A body as the rollout framework sends it, with fields no router knows about: they must
# reach the engine (the framework keeps a fork of the SGLang router to add such fields back).
BODY = json.dumps(
    {
        "input_ids": [101, 2023, 2003, 1037, 3231],
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
        "return_logprob": True,
        "return_routed_experts": False,
        "lora_path": None,
        "extra_key": "grpo-step-3",
        "rid": "rollout-7-sample-2",
        # Unknown top-level fields are ignored by SGLang (and must be relayed by the router).
        "an_rl_field_of_tomorrow": {"nested": [1, 2.5, "x"]},
    },
    separators=(", ", ": "),  # not compact: the bytes must survive as sent
).encode()


@pytest.fixture(scope="module")
def engine() -> Iterator[RawEngine]:
    with recording_engine() as raw:
        yield raw


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gateway(request: pytest.FixtureRequest, engine: RawEngine) -> Iterator[ServerProcess]:
    port = free_port()
    argv = ["serve", "--port", str(port), "--backend", engine.url, *LAYOUTS[request.param]]
    with ServerProcess(argv, port, timeout=60) as proc:
        yield proc


def test_generate_reaches_the_engine_verbatim(gateway: ServerProcess, engine: RawEngine) -> None:
    engine.clear()
    direct = httpx.post(
        f"{engine.url}/generate", content=BODY, headers={"content-type": "application/json"}
    )
    engine.clear()
    reply = httpx.post(
        f"{gateway.url}/generate",
        content=BODY,
        headers={"content-type": "application/json", "x-trace": "t1"},
        timeout=30,
    )
    arrived = engine.to("/generate")
    assert len(arrived) == 1, arrived
    assert arrived[0].method == "POST"
    assert arrived[0].body == BODY
    assert ("x-trace", "t1") in arrived[0].headers
    # The engine's answer comes back as the engine gave it (whatever it is: the reply of an
    # engine without the route is its 404, relayed, not the gateway's own).
    assert reply.status_code == direct.status_code == 200, reply.text
    assert reply.headers.get("content-type") == direct.headers.get("content-type")
    # The mock generates from the request alone, so the same body gives the same tokens.
    assert reply.json()["output_ids"] == direct.json()["output_ids"]
    assert reply.json()["meta_info"]["id"] == "rollout-7-sample-2"


def test_generate_with_a_query_keeps_it(gateway: ServerProcess, engine: RawEngine) -> None:
    engine.clear()
    httpx.post(f"{gateway.url}/generate?trace=1&x=%2F", content=BODY, timeout=30)
    arrived = engine.to("/generate")
    assert [a.target for a in arrived] == ["/generate?trace=1&x=%2F"]


def test_paths_next_to_generate_are_not_relayed(gateway: ServerProcess, engine: RawEngine) -> None:
    engine.clear()
    for path in ("/generate/", "/generatex", "/Generate"):
        reply = httpx.post(f"{gateway.url}{path}", content=BODY, timeout=30)
        assert reply.status_code == 404, (path, reply.text)
        assert "no route" in reply.json()["error"]
    assert engine.to("/generate/") == [] and engine.to("/Generate") == []
