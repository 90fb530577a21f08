"""A client of the RL control plane written from smg 1.13's documented behaviour (its `/v1/rl`
routes, reply shapes and 207 rule), standard library only as smg's own `smg.rl` client is:
what a trainer's script does, so the tests drive sessiongate the way such a script would."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class PlaneError(Exception):
    def __init__(self, status: int, payload: Any) -> None:
        self.status = status
        self.payload = payload if isinstance(payload, dict) else {"message": payload}
        self.code = self.payload.get("error")
        super().__init__(f"{self.code} (HTTP {status}): {self.payload.get('message', '')}")


class PartialFanout(PlaneError):
    """A 207: some engine failed (the payload is the whole fan-out result)."""


class PlaneClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def request(
        self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        url = self.base_url + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        headers = {"accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as reply:
                return reply.status, _decode(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, _decode(error.read())

    def workers(self) -> list[dict[str, Any]]:
        status, payload = self.request("GET", "/v1/rl/workers")
        if status != 200:
            raise PlaneError(status, payload)
        assert payload["protocol_version"] == 1 and payload["total"] == len(payload["workers"])
        return list(payload["workers"])

    def worker(self, worker_id: str) -> dict[str, Any]:
        status, payload = self.request("GET", f"/v1/rl/workers/{worker_id}")
        if status != 200:
            raise PlaneError(status, payload)
        return dict(payload)

    def call(
        self, worker_id: str, path: str, body: Any = None, method: str = "POST"
    ) -> dict[str, Any]:
        status, payload = self.request(method, f"/v1/rl/workers/{worker_id}/engine/{path}", body)
        if isinstance(payload, dict) and "latency_ms" in payload and "error" not in payload:
            assert payload["status"] == status  # the engine's status, mirrored
            return payload
        raise PlaneError(status, payload)

    def fanout(
        self, path: str, body: Any = None, *, selector: str, method: str = "POST"
    ) -> dict[str, Any]:
        status, payload = self.request(
            method, f"/v1/rl/engine/{path}", body, {"selector": selector}
        )
        if status in (200, 207) and isinstance(payload, dict) and "results" in payload:
            assert payload["succeeded"] == payload["total"] - len(payload["failed"])
            if payload["failed"]:
                assert status == 207
                raise PartialFanout(status, payload)
            return payload
        raise PlaneError(status, payload)


@contextmanager
def paused(client: PlaneClient, selector: str, mode: str) -> Iterator[dict[str, Any]]:
    """Pause the engines `selector` matches, run the body, always continue them."""
    try:
        yield client.fanout("pause_generation", {"mode": mode}, selector=selector)
    finally:
        client.fanout("continue_generation", {}, selector=selector)


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")
