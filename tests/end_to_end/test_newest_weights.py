"""`--newest-weights-only` through a rolling update, on a real gateway and two real mock
engines: once one engine is at the newest weight version (set through the RL control
plane), new requests go only to it; the other takes requests again once it is updated too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine
from support.rl_client import PlaneClient

pytestmark = pytest.mark.procs

BODY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}


@pytest.fixture(scope="module", params=["workers 0", "workers 2"])
def gateway(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, list[str]]]:
    with ExitStack() as stack:
        engines = [stack.enter_context(mock_engine()) for _ in range(2)]
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", request.param.split()[1]]
        argv += ["--enable-rl", "--newest-weights-only", "--policy", "round_robin"]
        for engine in engines:
            argv += ["--backend", engine.url]
        yield stack.enter_context(ServerProcess(argv, port, timeout=60)), [e.url for e in engines]


def served(url: str) -> int:
    return int(httpx.get(f"{url}/mock/stats").json()["requests"])


def test_a_rolling_update_routes_only_to_the_newest_weights(
    gateway: tuple[ServerProcess, list[str]],
) -> None:
    server, (first, second) = gateway
    plane = PlaneClient(server.url)
    ids = {w["url"]: w["id"] for w in plane.workers()}
    update = {"new_version": "v2", "abort_all_requests": False}
    assert plane.call(ids[first], "update_weight_version", update)["status"] == 200
    before = served(first), served(second)
    for _ in range(6):
        assert httpx.post(f"{server.url}/generate", json=BODY, timeout=30).status_code == 200
    assert (served(first) - before[0], served(second) - before[1]) == (6, 0)
    rows = {w["url"]: w for w in plane.workers()}
    assert rows[first]["weight_version"] == "v2" and rows[second]["weight_version"] == "default"
    # The second engine reaches the newest version: it takes its share again.
    assert plane.call(ids[second], "update_weight_version", update)["status"] == 200
    before = served(first), served(second)
    for _ in range(6):
        assert httpx.post(f"{server.url}/generate", json=BODY, timeout=30).status_code == 200
    assert served(second) - before[1] >= 2
