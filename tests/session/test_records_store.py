"""Durable records (`--records-dir`), with real processes on loopback: a SIGKILLed worker's
replacement recovers its shard byte for byte and the next turn continues token-exactly; the
same for a restarted `sessiongate worker`; a torn last entry is dropped, never served;
records over `--records-memory` are served from their files; DELETE removes the file."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.demo.verify import trajectory_problems
from sessiongate.primitives import shard_index, shard_key
from sessiongate.session.store.records_store import session_file_name
from support.procs import ServerProcess, free_port
from support.samples import decode_samples_payload
from support.tcp_workers import SECRET, WorkerProcess, eventually, router

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

R3_MOCK = "--r3-layers 8 --r3-topk 2"
CHILDREN = re.compile(r'"child_session_ids":\[[^\]]*\]')
VOLATILE = re.compile(
    r'"(id|created|timestamp|request_timestamp|e2e_latency|response_sent_to_client_ts|session_id|parent_session_id)":'
    r'("[^"]*"|[0-9.e-]+|\[[^\]]*\])'
)
SESSIONS = 20
TURNS = 5


def serve(records: Path, *extra: str, workers: int = 2) -> ServerProcess:
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", str(workers), "--records-dir"]
    return ServerProcess([*args, str(records), "--r3", "--mock-args", R3_MOCK, *extra], port)


def turn(client: httpx.Client, sid: str, messages: list[dict[str, Any]], n: int) -> None:
    """One tool-loop turn; appends the reply and the next tool result to `messages`."""
    reply = client.post(
        f"/sessions/{sid}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8, "seed": n},
    )
    assert reply.status_code == 200, reply.text
    messages.append(reply.json()["choices"][0]["message"])
    messages.append({"role": "tool", "content": f"result {n}"})


def rollouts(url: str, sessions: int, turns: int) -> dict[str, list[dict[str, Any]]]:
    """Tool loops; the first session also retries its second turn (a rollback, recorded as
    a replacing entry) and gets a child session with a turn of its own."""
    histories: dict[str, list[dict[str, Any]]] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for index in range(sessions):
            sid = client.post("/sessions").json()["session_id"]
            histories[sid] = [{"role": "user", "content": f"task {index}"}]
        first = next(iter(histories))
        for n in range(turns):
            for sid, messages in histories.items():
                turn(client, sid, messages, n)
            if n == 1 and turns > 2:
                retried = [*histories[first][:-3], {"role": "tool", "content": "retried"}]
                turn(client, first, retried, 100)
                histories[first] = retried
        child = client.post("/sessions", json={"parent_session_id": first}).json()["session_id"]
        histories[child] = [{"role": "user", "content": "child task"}]
        turn(client, child, histories[child], 0)
    return histories


def fetch(url: str, sid: str) -> tuple[bytes, bytes]:
    """The session's GET body and its trajectory export."""
    with httpx.Client(base_url=url, timeout=60) as client:
        got = client.get(f"/sessions/{sid}")
        trajectory = client.get(f"/sessions/{sid}/trajectory")
    assert got.status_code == 200 and trajectory.status_code == 200, (got.text, trajectory.text)
    return got.content, trajectory.content


def wait_healthy(url: str) -> None:
    eventually(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, "healthy")


@pytest.fixture()
def records(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "records"


def test_killed_worker_recovers_its_shard_and_sessions_continue(records: Path) -> None:
    with serve(records) as gateway:
        histories = rollouts(gateway.url, SESSIONS, TURNS)
        before = {sid: fetch(gateway.url, sid) for sid in histories}
        victim = 1
        pid = httpx.get(gateway.url + "/health").json()["workers"][victim]["pid"]
        os.kill(pid, signal.SIGKILL)
        eventually(
            lambda: (
                httpx.get(gateway.url + "/health").json()["workers"][victim].get("pid")
                not in (None, pid)
            ),
            "the worker restarted",
        )
        wait_healthy(gateway.url)
        on_victim = [s for s in histories if shard_index(shard_key(s), 2) == victim]
        assert on_victim, "no session landed on the killed worker"
        for sid in histories:
            assert fetch(gateway.url, sid) == before[sid], sid
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            for sid in on_victim:
                turn(client, sid, histories[sid], TURNS)
                document = client.get(f"/sessions/{sid}").json()
                assert len(document["records"]) == len(json.loads(before[sid][0])["records"]) + 1
                assert trajectory_problems(document) == []
                # max_tokens cuts turns off: the detail, not the framework's report, is empty.
                assert document["metadata"]["tito_session_mismatch_detail"] == []
        assert f"worker {victim}: recovered {len(on_victim)} sessions" in gateway.output()
        # DELETE removes the session's file.
        files = list((records / f"worker-{victim}" / "sessions").glob("*.rec"))
        assert len(files) == len(on_victim)
        assert httpx.delete(f"{gateway.url}/sessions/{on_victim[0]}").status_code == 204
        assert len(list(files[0].parent.glob("*.rec"))) == len(on_victim) - 1


def test_restarted_standalone_worker_recovers(records: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    port = free_port()
    with ServerProcess(["mock-engine", "--port", str(port), *R3_MOCK.split()], port) as engine:
        worker_port = free_port()
        extra = ("--records-dir", str(records), "--r3", "--r3-topk", "2")
        with WorkerProcess(worker_port, secret, engine.url, *extra) as worker:
            with router(secret, worker.endpoint) as gateway:
                wait_healthy(gateway.url)
                histories = rollouts(gateway.url, 4, 3)
                before = {sid: fetch(gateway.url, sid) for sid in histories}
                assert worker.proc is not None
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
                with WorkerProcess(worker_port, secret, engine.url, *extra) as again:
                    wait_healthy(gateway.url)
                    for sid, messages in histories.items():
                        assert fetch(gateway.url, sid) == before[sid]
                        with httpx.Client(base_url=gateway.url, timeout=60) as client:
                            turn(client, sid, messages, 3)
                            assert trajectory_problems(client.get(f"/sessions/{sid}").json()) == []
                    assert "recovered 5 sessions" in again.output()


def test_torn_last_entry_is_dropped_on_recovery(records: Path) -> None:
    with serve(records, workers=1) as gateway:
        histories = rollouts(gateway.url, 2, 3)
        full = {sid: httpx.get(f"{gateway.url}/sessions/{sid}").json() for sid in histories}
    first, second, child = histories
    sessions = records / "worker-0" / "sessions"
    # A crash mid-append: the second session's last entry cut short; half an entry header
    # and garbage after the child's only turn.
    cut = sessions / session_file_name(second)
    with cut.open("r+b") as handle:
        handle.truncate(cut.stat().st_size - 100)
    with (sessions / session_file_name(child)).open("ab") as handle:
        handle.write(b"SGRE\x02\x00\x00\x00" + os.urandom(64))
    with serve(records, workers=1) as gateway:
        output = gateway.output()
        assert "2 torn tails dropped" in output, output
        for sid, messages in histories.items():
            document = httpx.get(f"{gateway.url}/sessions/{sid}").json()
            kept = len(document["records"])
            assert kept == {first: 3, second: 2, child: 1}[sid]
            assert document["records"] == full[sid]["records"][:kept]
            # The torn session is back at its last whole turn: redo the lost one and go on.
            with httpx.Client(base_url=gateway.url, timeout=60) as client:
                turn(client, sid, messages[: 1 + 2 * kept], 10)
                assert trajectory_problems(client.get(f"/sessions/{sid}").json()) == []


@pytest.mark.parametrize("durability", ["none", "fsync"])
def test_durability_modes_record_and_recover(records: Path, durability: str) -> None:
    with serve(records, "--records-durability", durability, workers=1) as gateway:
        histories = rollouts(gateway.url, 3, 2)
        before = {sid: fetch(gateway.url, sid) for sid in histories}
    with serve(records, "--records-durability", durability, workers=1) as gateway:
        for sid in histories:
            assert fetch(gateway.url, sid) == before[sid]


def test_samples_lifecycle_survives_recovery(records: Path) -> None:
    """miles/utils/lifecycle.py: a segment starts the engine's meta_info.e2e_latency before
    the record's timestamp. The records file keeps that latency, so the samples of records
    read back from disk (--records-memory 0) and of a restarted gateway start where the
    engine's reply says, byte for byte the same."""
    with serve(records, "--records-memory", "0", workers=1) as gateway:
        histories = rollouts(gateway.url, 2, 3)
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            documents = {sid: client.get(f"/sessions/{sid}").json() for sid in histories}
            before = {sid: client.post(f"/sessions/{sid}/samples").content for sid in histories}
    with serve(records, workers=1) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            for sid in histories:
                assert client.post(f"/sessions/{sid}/samples").content == before[sid], sid
    for sid, payload in before.items():
        (sample,) = decode_samples_payload(payload)["samples"]
        segments = sample["metadata"]["lifecycle"]
        # One turn's sample keeps its one segment; merged turns list theirs.
        for segment in segments if isinstance(segments, list) else [segments]:
            record = documents[sid]["records"][segment["turn"] - 1]
            latency = record["response"]["choices"][0]["meta_info"]["e2e_latency"]
            assert segment["t0"] == record["timestamp"] - latency
            assert segment["t1"] == record["timestamp"]


def test_records_over_the_memory_budget_are_served_from_disk(records: Path) -> None:
    """--records-memory 0: every record is read back from its file for GET, trajectory and
    samples, and the answers equal those of a gateway that keeps everything in memory (the
    mock engine is deterministic per seed; ids and clocks are masked)."""
    answers: list[list[str]] = []
    for extra in (("--records-memory", "0"), ("--records-memory", "1G")):
        with serve(records / str(len(answers)), *extra, "--r3-topk", "2") as gateway:
            histories = rollouts(gateway.url, 3, 3)
            texts = []
            with httpx.Client(base_url=gateway.url, timeout=60) as client:
                for sid in histories:
                    texts.append(
                        VOLATILE.sub(
                            r'"\1":0', CHILDREN.sub("", client.get(f"/sessions/{sid}").text)
                        )
                    )
                    samples = client.post(f"/sessions/{sid}/samples", json={})
                    assert samples.status_code == 200, samples.text
                    decoded = decode_samples_payload(samples.content)
                    texts.append(repr([s["tokens"] for s in decoded["samples"]]))
                    texts.append(repr([s["rollout_routed_experts"] for s in decoded["samples"]]))
            # Budget 0: every record lives in its file only; 1 GiB: all in RAM.
            # 3 sessions x 3 turns, a retried turn and a child's turn: 11 commits.
            wanted = (11, True) if extra[1] == "0" else (0, False)

            def store_state(url: str = gateway.url, wanted: tuple[int, bool] = wanted) -> bool:
                workers = httpx.get(url + "/health").json()["workers"]
                spilled = sum(w["records_spilled"] for w in workers)
                resident = sum(w["records_resident_bytes"] for w in workers)
                return (spilled, resident == 0) == wanted

            eventually(store_state, f"heartbeats report {wanted}")
            answers.append(texts)
    assert answers[0] == answers[1]


def test_records_dir_options_are_checked(tmp_path: Path) -> None:
    port = free_port()
    process = ServerProcess(
        ["serve", "--port", str(port), "--ray", "--records-dir", str(tmp_path)], port, timeout=5
    )
    with pytest.raises(RuntimeError, match="records-dir"):
        process.start()
    # The store's options without a directory are a mistake, not a no-op.
    port = free_port()
    process = ServerProcess(["serve", "--port", str(port), "--records-memory", "1G"], port)
    with pytest.raises(RuntimeError, match="apply with --records-dir only"):
        process.start()
    # Not a directory, or a manifest that is not ours: one clear message before any worker.
    (tmp_path / "a-file").write_text("x")
    process = serve(tmp_path / "a-file", workers=2)
    with pytest.raises(RuntimeError, match=r"--records-dir .*a-file"):
        process.start()
    assert "Traceback" not in process.output()
    (tmp_path / "bad" / "worker-0").mkdir(parents=True)
    (tmp_path / "bad" / "worker-0" / "store.json").write_text("{not json")
    for workers in (1, 0):
        process = serve(tmp_path / "bad", workers=workers)
        with pytest.raises(RuntimeError, match=r"store\.json"):
            process.start()
        assert "Traceback" not in process.output()
    # A directory written by 2 workers refuses a different worker count.
    with serve(tmp_path / "r", workers=2):
        pass
    process = serve(tmp_path / "r", workers=1)
    with pytest.raises(RuntimeError, match="same --workers"):
        process.start()


def test_a_refused_write_is_a_507_and_records_nothing(records: Path) -> None:
    """The disk refuses the entry (here: a file size limit on the worker, EFBIG): the turn
    is a 507, the session is unchanged, and once writes succeed again it goes on, with
    nothing torn left in its file for recovery to trip over."""
    with serve(records, workers=1) as gateway:
        histories = rollouts(gateway.url, 1, 1)
        sid = next(s for s in histories if "." not in s)
        before = fetch(gateway.url, sid)
        pid = httpx.get(gateway.url + "/health").json()["workers"][0]["pid"]
        size = (records / "worker-0" / "sessions" / session_file_name(sid)).stat().st_size
        limits = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (size + 64, limits[1]))
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            refused = client.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": histories[sid], "max_tokens": 8},
            )
            assert refused.status_code == 507, refused.text
            assert "records directory write failed" in refused.json()["error"]
            assert fetch(gateway.url, sid) == before
            resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)
            turn(client, sid, histories[sid], 1)
        after = fetch(gateway.url, sid)
        eventually(
            lambda: (
                httpx.get(gateway.url + "/health").json()["workers"][0]["records_write_errors"] == 1
            ),
            "the error is counted",
        )
    with serve(records, workers=1) as gateway:
        assert fetch(gateway.url, sid) == after
        assert "(0 torn tails dropped)" in gateway.output()


def test_reads_from_disk_survive_a_delete_and_fail_clearly_without_their_file(
    records: Path,
) -> None:
    """Regressions: a DELETE during a records GET served from disk cut the GET off and the
    worker dropped the request silently (the client hung); a records file gone from under a
    live session hung the GET too. Now the GET reads through a descriptor it opened under
    the session's lock, and an unreadable file is a clear 500."""
    mock = "--r3-layers 256 --r3-topk 8"
    with serve(records, "--records-memory", "0", "--mock-args", mock, workers=1) as gateway:
        histories = rollouts(gateway.url, 2, 2)
        big, other = (s for s in histories if "." not in s)
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            with client.stream("GET", f"/sessions/{big}") as reply:
                chunks = reply.iter_bytes()
                first = next(chunks)
                assert client.delete(f"/sessions/{big}").status_code == 204
                document = json.loads(first + b"".join(chunks))
            assert len(document["records"]) == 2
            assert client.get(f"/sessions/{big}").status_code == 410  # deleted: reclaimed
            (records / "worker-0" / "sessions" / session_file_name(other)).unlink()
            broken = client.get(f"/sessions/{other}")
            assert broken.status_code == 500
            assert "cannot be opened" in broken.json()["error"]
            assert client.get("/health").status_code == 200


def test_in_process_gateway_recovers_header_sessions(records: Path) -> None:
    """`serve --workers 0` keeps its records in DIR/worker-0; a session created by its
    X-Session-ID header comes back as one (it may expire by --header-session-ttl)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    headers = {"X-Session-ID": "agent-7/run-1"}
    with serve(records, workers=0) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60, headers=headers) as client:
            reply = client.post("/v1/chat/completions", json={"messages": messages})
            assert reply.status_code == 200, reply.text
            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "go"}]
        before = fetch(gateway.url, "agent-7%2Frun-1")
    assert (records / "worker-0" / "sessions").is_dir()
    with serve(records, workers=0) as gateway:
        assert fetch(gateway.url, "agent-7%2Frun-1") == before
        with httpx.Client(base_url=gateway.url, timeout=60, headers=headers) as client:
            assert (
                client.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
            )
            document = client.get("/sessions/agent-7%2Frun-1").json()
        assert len(document["records"]) == 2 and trajectory_problems(document) == []
