"""Dialect turns survive a restart with --records-dir through a real `serve`: an Anthropic
Messages turn and an OpenAI Responses turn come back with their records whole (the dialect
and the client's body included), and the session goes on in the same dialect."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sessiongate.demo.verify import trajectory_problems
from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs


def test_dialect_records_are_recovered_and_the_session_goes_on(tmp_path: Path) -> None:
    with mock_engine("--completion-tokens", "6") as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--backend", engine.url, "--workers", "0"]
        argv += ["--records-dir", str(tmp_path)]
        history = [{"role": "user", "content": "Hello"}]
        with (
            ServerProcess(argv, port, timeout=60) as proc,
            httpx.Client(base_url=proc.url, timeout=30) as client,
        ):
            sid = client.post("/sessions", json={}).json()["session_id"]
            said = client.post(
                f"/sessions/{sid}/v1/messages",
                json={"model": "m", "max_tokens": 16, "messages": history},
            )
            assert said.status_code == 200, said.text
            text = "".join(b["text"] for b in said.json()["content"] if b["type"] == "text")
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": "On?"}]
            answered = client.post(
                f"/sessions/{sid}/v1/responses",
                json={"model": "m", "input": history, "store": False},
            )
            assert answered.status_code == 200, answered.text
            before = client.get(f"/sessions/{sid}").json()
        with (
            ServerProcess(argv, port, timeout=60) as proc,
            httpx.Client(base_url=proc.url, timeout=30) as client,
        ):
            after = client.get(f"/sessions/{sid}").json()
            message = next(i for i in answered.json()["output"] if i["type"] == "message")
            history += [
                {"role": "assistant", "content": message["content"][0]["text"]},
                {"role": "user", "content": "Last?"},
            ]
            again = client.post(
                f"/sessions/{sid}/v1/responses",
                json={"model": "m", "input": history, "store": False},
            )
            assert again.status_code == 200, again.text
            final = client.get(f"/sessions/{sid}").json()
    assert after["records"] == before["records"]
    assert [r["dialect"] for r in after["records"]] == ["anthropic", "responses"]
    assert after["records"][1]["client_request"]["input"] == history[:3]
    assert [r["rollback_steps"] for r in final["records"]] == [0, 0, 0]
    assert trajectory_problems(final) == []
