"""The RL control plane (`--enable-rl`, smg 1.13's `/v1/rl` contract) driven by a stdlib
client written from smg's documented behaviour (tests/support/rl_client.py), in every layout:
a real `sessiongate serve` in front of two real mock engines and one registered engine that
is not there.

The last test is a trainer's step with rollouts running: pause (retract) -> update the weight
version -> continue, while `/generate` and session turns keep coming. No request fails, none
reaches an engine while it is paused (the mock counts arrivals during a pause), and the
router reports the new version on every engine afterwards.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine
from support.rl_client import PartialFanout, PlaneClient, PlaneError, paused

pytestmark = pytest.mark.procs

LAYOUTS = {
    "workers 0, compiled front": ("--workers", "0", "--front", "compiled"),
    "workers 0, python front": ("--workers", "0", "--front", "python"),
    "workers 2, compiled front": ("--workers", "2", "--front", "compiled"),
}
ADMIN = "adm1n"
LIVE = "health=ready"


@dataclass
class Setup:
    gateway: ServerProcess
    engines: list[ServerProcess]
    dead: str
    plane: PlaneClient = field(init=False)

    def __post_init__(self) -> None:
        self.plane = PlaneClient(self.gateway.url, api_key=ADMIN)

    def ids(self) -> dict[str, str]:
        return {w["url"]: w["id"] for w in self.plane.workers()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    with ExitStack() as stack:
        engines = [stack.enter_context(mock_engine("--token-delay-ms", "2")) for _ in range(2)]
        port = free_port()
        argv = [
            "serve",
            "--port",
            str(port),
            "--health-interval",
            "0.5",
            "--enable-rl",
            "--admin-key",
            ADMIN,
            "--engine-label",
            "pool=rollout",
            *LAYOUTS[request.param],
        ]
        for engine in engines:
            argv += ["--backend", engine.url]
        gateway = stack.enter_context(ServerProcess(argv, port, timeout=60))
        dead = f"http://127.0.0.1:{free_port()}"
        reply = httpx.post(
            f"{gateway.url}/workers",
            json={"url": dead, "labels": {"pool": "rollout", "role": "spare"}},
            headers={"authorization": f"Bearer {ADMIN}"},
            timeout=30,
        )
        assert reply.status_code == 202, reply.text
        yield Setup(gateway, engines, dead)


def test_discovery_lists_every_engine_with_labels_and_versions(setup: Setup) -> None:
    rows = {w["url"]: w for w in setup.plane.workers()}
    assert set(rows) == {*(e.url for e in setup.engines), setup.dead}
    for engine in setup.engines:
        row = rows[engine.url]
        assert row["health"] == "ready" and row["engine"] == "sglang"
        assert row["weight_version"] == "default" and row["labels"]["pool"] == "rollout"
        assert row["capabilities"]["pause_modes"] == ["abort", "retract", "in_place"]
        assert row["paused"] is False and setup.plane.worker(row["id"]) == row
    spare = rows[setup.dead]
    assert spare["health"] == "unhealthy" and spare["role"] == "spare"
    with pytest.raises(PlaneError) as missing:
        setup.plane.worker("engine-nope")
    assert (missing.value.status, missing.value.code) == (404, "worker_not_found")


def test_the_plane_takes_the_admin_key(setup: Setup) -> None:
    for key in (None, "wrong"):
        status, _ = PlaneClient(setup.gateway.url, api_key=key).request("GET", "/v1/rl/workers")
        assert status == 401


def test_one_engine_call_mirrors_the_engine(setup: Setup) -> None:
    worker_id = setup.ids()[setup.engines[0].url]
    info = setup.plane.call(worker_id, "model_info", method="GET")
    assert info["status"] == 200 and info["body"]["weight_version"] == "default"
    missing = setup.plane.call(worker_id, "no_such_route", method="GET")
    assert missing["status"] == 404 and missing["worker_id"] == worker_id
    with pytest.raises(PlaneError) as bad_path:
        setup.plane.call(worker_id, "a/b/c/d/e")
    assert (bad_path.value.status, bad_path.value.code) == (400, "invalid_engine_path")
    with pytest.raises(PlaneError) as dead:
        setup.plane.call(setup.ids()[setup.dead], "flush_cache", {})
    assert (dead.value.status, dead.value.code) == (502, "upstream_unreachable")


def test_a_fanout_goes_to_the_engines_the_selector_matches(setup: Setup) -> None:
    result = setup.plane.fanout("flush_cache", {}, selector=f"{LIVE},pool in (rollout)")
    assert result["total"] == result["succeeded"] == 2
    assert sorted(r["url"] for r in result["results"].values()) == sorted(
        e.url for e in setup.engines
    )


def test_broken_selectors_are_400(setup: Setup) -> None:
    for selector, code in (
        ("", "selector_required"),
        ("pool in (rollout", "invalid_selector"),
        ("pool=nothing", "no_workers_match"),
    ):
        with pytest.raises(PlaneError) as refused:
            setup.plane.fanout("flush_cache", {}, selector=selector)
        assert (refused.value.status, refused.value.code) == (400, code), selector
    with pytest.raises(PlaneError) as offset:
        setup.plane.fanout("flush_cache", {}, selector="pool in (rollout")
    assert offset.value.payload["offset"] == 16


def test_a_dead_engine_makes_the_fanout_a_207(setup: Setup) -> None:
    with pytest.raises(PartialFanout) as partial:
        setup.plane.fanout("flush_cache", {}, selector="pool=rollout")
    result = partial.value.payload
    assert partial.value.status == 207 and result["total"] == 3 and result["succeeded"] == 2
    (failure,) = result["failed"]
    assert failure["url"] == setup.dead and failure["error"] == "upstream_unreachable"


class Traffic:
    """Rollouts that keep arriving whatever the engines do: every `PACE_S` a new `/generate`
    call or a new session of `TURNS` turns starts in its own thread (a rollout worker does
    not wait for another's request before sending its own)."""

    PACE_S = 0.02
    TURNS = 3

    def __init__(self, base: str) -> None:
        self.base = base
        self.stop = threading.Event()
        self.started = 0
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.sessions: list[str] = []
        self.threads: list[threading.Thread] = []
        self._dispatcher = threading.Thread(target=self._dispatch, daemon=True)

    def __enter__(self) -> Traffic:
        self._dispatcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._dispatcher.join(timeout=10)
        for thread in self.threads:
            thread.join(timeout=60)

    def _dispatch(self) -> None:
        while not self.stop.wait(self.PACE_S):
            work = self._generate if self.started % 2 else self._session
            self.started += 1
            thread = threading.Thread(target=work, daemon=True)
            self.threads.append(thread)
            thread.start()

    def _generate(self) -> None:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16}}
        self._note(lambda: httpx.post(f"{self.base}/generate", json=body, timeout=60))

    def _session(self) -> None:
        created = self._note(lambda: httpx.post(f"{self.base}/sessions", timeout=60))
        if created is None or created.status_code != 200:
            return
        session_id = created.json()["session_id"]
        self.sessions.append(session_id)
        messages = [{"role": "user", "content": "count to ten"}]
        for turn in range(self.TURNS):
            body = {"model": "m", "messages": messages, "max_tokens": 16}
            url = f"{self.base}/sessions/{session_id}/v1/chat/completions"
            reply = self._note(functools.partial(httpx.post, url, json=body, timeout=60))
            if reply is None or reply.status_code != 200:
                return
            messages = [
                *messages,
                reply.json()["choices"][0]["message"],
                {"role": "user", "content": f"and again ({turn})"},
            ]
            time.sleep(self.PACE_S * 5)  # the agent thinks: its next turn may meet a pause

    def _note(self, send: Callable[[], httpx.Response]) -> httpx.Response | None:
        try:
            reply = send()
        except httpx.HTTPError as exc:
            self.errors.append(repr(exc))
            return None
        self.statuses.append(reply.status_code)
        if reply.status_code != 200:
            self.errors.append(f"{reply.status_code}: {reply.text[:300]}")
        return reply


def test_pause_update_continue_with_rollouts_running(setup: Setup) -> None:
    plane = setup.plane
    with Traffic(setup.gateway.url) as traffic:
        time.sleep(0.5)
        with paused(plane, LIVE, mode="retract") as pause:
            assert pause["succeeded"] == 2
            for engine in setup.engines:
                assert httpx.get(f"{engine.url}/mock/stats").json()["paused"] is True
            rows = {w["url"]: w for w in plane.workers()}
            assert all(rows[e.url]["paused"] for e in setup.engines)
            asked_before = traffic.started
            # Rollouts keep asking (the gateway holds them): ten new requests at least.
            wait_until(lambda: traffic.started - asked_before >= 10)
            asked = traffic.started - asked_before
            update = plane.fanout(
                "update_weight_version",
                {"new_version": "step-1", "abort_all_requests": False},
                selector=LIVE,
            )
            assert update["succeeded"] == 2
        finished_at_continue = len(traffic.statuses)
        time.sleep(0.6)
    assert not traffic.errors, traffic.errors[:5]
    assert len(traffic.statuses) > finished_at_continue + asked  # the held ones flowed after
    for engine in setup.engines:
        stats = httpx.get(f"{engine.url}/mock/stats").json()
        assert stats["arrived_while_paused"] == 0, stats
        assert stats["paused"] is False
    rows = {w["url"]: w for w in plane.workers()}
    for engine in setup.engines:
        assert rows[engine.url]["weight_version"] == "step-1"
        assert rows[engine.url]["paused"] is False
    admin = {"authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(f"{setup.gateway.url}/workers", headers=admin).json()["workers"]
    assert {w["url"]: w["weight_version"] for w in listed if w["in_rotation"]} == {
        e.url: "step-1" for e in setup.engines
    }
    metrics = httpx.get(f"{setup.gateway.url}/metrics").text
    for engine in setup.engines:
        assert f'{{engine="{engine.url}",weight_version="step-1"}} 1' in metrics
    spans = [
        httpx.get(f"{setup.gateway.url}/sessions/{s}").json()["metadata"]["weight_versions"]
        for s in traffic.sessions
    ]
    assert ["default", "step-1"] in spans, spans
    # The trajectory export says so too (its header's metadata).
    spanning = traffic.sessions[spans.index(["default", "step-1"])]
    raw = httpx.get(f"{setup.gateway.url}/sessions/{spanning}/trajectory").content
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert json.loads(header["__metadata__"]["weight_versions"]) == ["default", "step-1"]


def test_families_stay_pinned_across_the_pause(setup: Setup) -> None:
    metrics = httpx.get(f"{setup.gateway.url}/metrics").text
    repins = [
        line for line in metrics.splitlines() if line.startswith("sessiongate_upstream_repins")
    ]
    assert repins and all(line.endswith(" 0") for line in repins), repins


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_pause_behind_the_routers_back_is_observed(setup: Setup) -> None:
    """A trainer that pauses an engine directly: the registry's probe reads its `/ready`
    (503 while paused) and holds it; requests go to the other engine meanwhile; the weight
    version it set directly is learned when the pause ends."""
    first, second = setup.engines
    json_body = {"json": {"mode": "retract"}, "timeout": 10}
    assert httpx.post(f"{first.url}/pause_generation", **json_body).status_code == 200

    def row() -> dict[str, object]:
        return {w["url"]: w for w in setup.plane.workers()}[first.url]

    try:
        wait_until(lambda: row()["pause_mode"] == "observed")
        before = httpx.get(f"{first.url}/mock/stats").json()["arrived_while_paused"]
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        for _ in range(8):
            reply = httpx.post(f"{setup.gateway.url}/generate", json=body, timeout=30)
            assert reply.status_code == 200
        after = httpx.get(f"{first.url}/mock/stats").json()["arrived_while_paused"]
        assert after == before
        update = {"new_version": "direct-1", "abort_all_requests": False}
        httpx.post(f"{first.url}/update_weight_version", json=update, timeout=10)
    finally:
        httpx.post(f"{first.url}/continue_generation", json={}, timeout=10)
    wait_until(lambda: row()["paused"] is False)
    # The version changed while it was paused is read when the pause is seen to end.
    assert row()["weight_version"] == "direct-1"
    assert httpx.get(f"{second.url}/mock/stats").json()["paused"] is False
