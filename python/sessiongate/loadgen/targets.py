"""Where a bench run sends its sessions.

`SessiongateTarget` speaks the session API (docs/api.md): create (children with
`parent_session_id`), chat turns with the full history, records GET at the end (timed,
bytes counted), DELETE. `OpenAITarget` sends plain `/v1/chat/completions` with the full
history to any OpenAI-compatible endpoint and stamps session identity client-side with a
routing mode and a `SessionFamilyRegistry` (the same plugin layer the gateway uses), so
`is_final_turn`, `is_parent_final` and `is_family_final` are what the gateway would compute.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote

from sessiongate.http.client import HttpClient
from sessiongate.loadgen.http import Exchange, exchange
from sessiongate.session_routing import SessionFamilyRegistry, SessionRoutingMode

RecordsHook = Callable[["SessionHandle", bytes], None]


@dataclass(frozen=True, slots=True)
class SessionHandle:
    session_id: str
    parent_id: str | None
    root_id: str


def encode_body(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class Target(ABC):
    name: ClassVar[str]

    def __init__(
        self,
        client: HttpClient,
        base_url: str,
        *,
        timeout: float | None,
        stream: bool = False,
        headers: dict[str, str] | None = None,
        auth_headers: dict[str, str] | None = None,
    ) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.stream = stream
        self.headers = dict(headers or {})  # recorded in raw records
        self.auth_headers = dict(auth_headers or {})  # sent, never recorded

    async def _send(
        self, kind: str, method: str, path: str, *, body: bytes | None = None, **kwargs: Any
    ) -> Exchange:
        extra: dict[str, str] = kwargs.pop("headers", {})
        ex = await exchange(
            self.client,
            kind,
            method,
            self.base_url + path,
            body=body,
            headers={**self.auth_headers, **self.headers, **extra},
            timeout=self.timeout,
            **kwargs,
        )
        ex.headers = {**self.headers, **extra}
        return ex

    @abstractmethod
    async def open(
        self, parent: SessionHandle | None
    ) -> tuple[SessionHandle | None, Exchange | None]:
        """Start a session; (None, failed exchange) when the target refused."""

    @abstractmethod
    async def turn(
        self, handle: SessionHandle, body: dict[str, Any], *, final: bool, spawns: int
    ) -> Exchange:
        """One chat turn; `spawns` children will be started after this turn's reply."""

    @abstractmethod
    async def close(self, handle: SessionHandle) -> list[Exchange]:
        """End a session whose turns (and children) are over."""

    def abandon(self, handle: SessionHandle) -> None:  # noqa: B027 - optional hook
        """The run was interrupted while `handle` was open; `cleanup` finishes the job."""

    async def cleanup(self, timeout: float) -> None:  # noqa: B027 - optional hook
        """Best effort: release what abandoned sessions hold on the server."""


class SessiongateTarget(Target):
    name = "sessiongate"

    def __init__(
        self,
        client: HttpClient,
        base_url: str,
        *,
        records: bool = True,
        records_hook: RecordsHook | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, base_url, **kwargs)
        self.records = records
        self.records_hook = records_hook
        self._abandoned: list[str] = []

    async def open(
        self, parent: SessionHandle | None
    ) -> tuple[SessionHandle | None, Exchange | None]:
        body = b"" if parent is None else encode_body({"parent_session_id": parent.session_id})
        ex = await self._send("create", "POST", "/sessions", body=body or None)
        if ex.ok:
            sid = (ex.document or {}).get("session_id")
            if isinstance(sid, str) and sid:
                root = sid if parent is None else parent.root_id
                parent_id = None if parent is None else parent.session_id
                return SessionHandle(sid, parent_id, root), ex
            ex.error_key, ex.error = "invalid", "create reply has no session_id"
        return None, ex

    def _path(self, handle: SessionHandle) -> str:
        return "/sessions/" + quote(handle.session_id, safe="")

    async def turn(
        self, handle: SessionHandle, body: dict[str, Any], *, final: bool, spawns: int
    ) -> Exchange:
        return await self._send(
            "chat",
            "POST",
            self._path(handle) + "/v1/chat/completions",
            body=encode_body(body),
            stream=self.stream,
        )

    async def close(self, handle: SessionHandle) -> list[Exchange]:
        done: list[Exchange] = []
        if self.records:
            get, body = await self.get_records(handle, keep=self.records_hook is not None)
            if get.ok and self.records_hook is not None:
                self.records_hook(handle, body)
            done.append(get)
        done.append(await self.delete(handle))
        return done

    async def get_records(self, handle: SessionHandle, *, keep: bool) -> tuple[Exchange, bytes]:
        """`GET /sessions/{id}` (kind `records`); the body only when `keep`, else b"" (it
        is drained and counted: records can be GiB)."""
        parts: list[bytes] = []
        get = await self._send(
            "records",
            "GET",
            self._path(handle),
            body_hook=_counter(parts.append if keep else None),
        )
        return get, b"".join(parts)

    async def samples(self, handle: SessionHandle) -> tuple[Exchange, bytes]:
        """`POST /sessions/{id}/samples` (kind `samples`) with its safetensors body."""
        parts: list[bytes] = []
        ex = await self._send(
            "samples",
            "POST",
            self._path(handle) + "/samples",
            body=b"{}",
            body_hook=parts.append,
        )
        return ex, b"".join(parts)

    async def delete(self, handle: SessionHandle) -> Exchange:
        return await self._send("delete", "DELETE", self._path(handle))

    def abandon(self, handle: SessionHandle) -> None:
        self._abandoned.append(handle.session_id)

    async def cleanup(self, timeout: float) -> None:
        ids, self._abandoned = self._abandoned, []
        if not ids:
            return
        # Children first, so a parent is never deleted under a live child.
        ids.sort(key=lambda sid: -sid.count("."))
        deletes = [
            exchange(
                self.client,
                "delete",
                "DELETE",
                self.base_url + "/sessions/" + quote(sid, safe=""),
                headers=self.auth_headers,
                timeout=timeout,
            )
            for sid in ids
        ]
        await asyncio.gather(*deletes)


def _counter(keep: Callable[[bytes], None] | None) -> Callable[[bytes], None]:
    # The exchange counts bytes itself; without a records hook the body is just drained.
    return keep if keep is not None else (lambda _chunk: None)


class OpenAITarget(Target):
    name = "openai"

    def __init__(
        self,
        client: HttpClient,
        base_url: str,
        *,
        mode: SessionRoutingMode | None = None,
        chat_path: str = "/v1/chat/completions",
        **kwargs: Any,
    ) -> None:
        super().__init__(client, base_url, **kwargs)
        self.mode = mode
        self.chat_path = chat_path
        self.families = SessionFamilyRegistry()

    async def open(
        self, parent: SessionHandle | None
    ) -> tuple[SessionHandle | None, Exchange | None]:
        # Ids follow the gateway's shape (docs/architecture.md, "Wire contracts"): a child is
        # <root>.<hex>, so anything that shards on the text before the first '.' keeps families
        # together.
        if parent is None:
            sid = uuid.uuid4().hex
            handle = SessionHandle(sid, None, sid)
        else:
            sid = f"{parent.root_id}.{uuid.uuid4().hex}"
            handle = SessionHandle(sid, parent.session_id, parent.root_id)
        if self.mode is not None:
            self.families.register(sid, handle.parent_id, root_session_id=handle.root_id)
        return handle, None

    async def turn(
        self, handle: SessionHandle, body: dict[str, Any], *, final: bool, spawns: int
    ) -> Exchange:
        headers: dict[str, str] = {}
        stamp: dict[str, Any] | None = None
        mode = self.mode
        if mode is not None:
            if spawns:
                # Declared before the context is computed: a turn that spawns children is
                # never family-final (docs/routing.md, "Finality").
                self.families.declare_branch(handle.session_id, spawns)
            ctx = self.families.context_for(handle.session_id, final)
            headers = mode.headers(ctx)
            if mode.mutates_body:
                stamped = mode.transform_body(body, ctx)
                stamp = {k: v for k, v in stamped.items() if body.get(k) is not v}
                body = stamped
        ex = await self._send(
            "chat",
            "POST",
            self.chat_path,
            body=encode_body(body),
            headers=headers,
            stream=self.stream,
        )
        ex.body_stamp = stamp
        if mode is not None and self.families.finish_turn(handle.session_id, final and ex.ok):
            mode.on_session_end(handle.session_id)
        return ex

    def _end(self, handle: SessionHandle) -> None:
        if self.mode is not None and self.families.end_session(handle.session_id):
            self.mode.on_session_end(handle.session_id)

    async def close(self, handle: SessionHandle) -> list[Exchange]:
        self._end(handle)
        return []

    def abandon(self, handle: SessionHandle) -> None:
        self._end(handle)
