"""The router: the sessions are in workers. Finds each request's worker by
`shard(shard_key(id), N)`, relays the reply bytes verbatim, never parses a body (the tiny
`POST /sessions` body aside, to place a child on its root's worker), and answers `/health`
itself from the channels' state, never behind session work.

It is the sharded layout's `SessionBackend` (gateway/shell.py): the gateway shell in front
of it answers `/metrics` (from `gauges`) and the engine routes, and hands it each change of
the engine set (`use_engines`), which it sends to every worker.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sessiongate.dataplane.router.worker_channel import WorkerChannel, WorkerFailed, WorkerLost
from sessiongate.dataplane.transport.connection import FrameConnection
from sessiongate.dataplane.transport.frames import HEARTBEAT_INTERVAL, STALL_AFTER
from sessiongate.engines.policy.base import RoutingRequest
from sessiongate.engines.policy.sticky import sticky_key
from sessiongate.errors import (
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    Unavailable,
    UpstreamError,
)
from sessiongate.gateway.metrics import WorkerGauge, reliability_gauges
from sessiongate.primitives import (
    FrameTooLarge,
    new_session_id,
    shard_index,
    shard_key,
    validate_session_id,
)
from sessiongate.protocol import (
    INSTANCE_ENV,
    INSTANCE_HEADER,
    CoreReply,
    CoreRequest,
    Op,
    error_reply,
    json_reply,
    parse_json_object,
    upstream_required,
)

if TYPE_CHECKING:
    from sessiongate.dataplane.transport.tcp import Endpoint

logger = logging.getLogger(__name__)

# Heartbeat members of a worker's limits and their usage, shown per worker in /health.
LIMIT_FIELDS = (
    "max_sessions",
    "records_bytes",
    "max_records_bytes",
    "session_ttl",
    "sessions_expired",
    "records_resident_bytes",
    "records_memory",
    "records_spilled",
    "records_write_errors",
)
# `POST /sessions` bodies are `{"parent_session_id": ...}`: anything larger is not one.
MAX_CREATE_BODY = 64 * 1024
# Root ids minted before giving up on finding a live worker: with one of two workers out,
# 32 draws all land on it with probability 2**-32.
MINT_ATTEMPTS = 32
# Heartbeat silence after which new sessions are minted onto other workers (10 beats).
AVOID_FOR_NEW_SESSIONS_AFTER = 10 * HEARTBEAT_INTERVAL


class RemoteSlot(Protocol):
    """What the router uses of the connector of a remote (TCP) worker's slot. The connector
    (`placement/remote.py`) depends on the router, never the other way round."""

    @property
    def endpoint(self) -> Endpoint: ...
    @property
    def transport(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def reconnects(self) -> int: ...
    @property
    def connect_failures(self) -> int: ...
    @property
    def restarts(self) -> int: ...
    def status(self) -> dict[str, Any]: ...
    def reason(self) -> str: ...
    def set_endpoint(self, endpoint: Endpoint) -> None: ...
    def start(self) -> None: ...
    async def aclose(self) -> None: ...


# Builds the connector of remote (TCP) worker slot `index` of a router.
RemoteConnector = Callable[["ShardRouter", int], RemoteSlot]


class ShardRouter:
    """The sessions are in workers: a `SessionBackend` (gateway/shell.py) over one channel
    per worker slot."""

    def __init__(
        self,
        worker_count: int,
        *,
        remotes: RemoteConnector | None = None,
        sticky_headers: Sequence[str] | None = None,
    ) -> None:
        """`remotes`: the workers are remote (TCP), each slot kept connected by the
        connector it builds; None: local workers, whose channels the supervisor hands over.
        `sticky_headers`: with --sticky-sessions, the routing-key headers; a stateless call
        then goes to the worker its sticky key (engines/policy/sticky.py) hashes to."""
        if worker_count < 1:
            raise ValueError("the router needs at least one worker")
        self.channels: list[WorkerChannel | None] = [None] * worker_count
        # Connectors of remote (TCP) workers, one per slot; None for local workers.
        self.remotes: Sequence[RemoteSlot] | None = (
            [remotes(self, index) for index in range(worker_count)] if remotes else None
        )
        self.worker_restarts = 0
        self._round_robin = itertools.count()
        self.sticky_headers = None if sticky_headers is None else list(sticky_headers)
        # The supervisor's per-run token, echoed on /health so its readiness check knows the
        # answer came from this router and not from another process on the port.
        self.instance = os.environ.get(INSTANCE_ENV) or None
        # The engine set as last changed at run time (None: still the workers' --backend).
        # The registry lives in this process, not in the workers: registrations survive a
        # worker's restart, and every worker's pool gets the same set.
        self._engine_set: list[str] | None = None
        self._held: list[str] = []
        self._engine_pushes: set[asyncio.Task[None]] = set()
        # Per worker slot, the engine set being sent to a (re)attached worker: its requests
        # wait for it, so none reaches the worker before the live set does.
        self._engine_sync: dict[int, asyncio.Task[None]] = {}

    def start(self) -> None:
        """Start keeping the remote workers' slots connected (local ones need nothing)."""
        for remote in self.remotes or []:
            remote.start()

    async def use_engines(self, urls: list[str], held: list[str]) -> None:
        """The engine set (and its held engines) changed: send it to every live worker now,
        and to every worker that (re)connects from now on."""
        self._engine_set = list(urls)
        self._held = list(held)
        channels = [c for c in self.channels if c is not None and c.up]
        await asyncio.gather(*(self._send_engines(c, urls, held) for c in channels))

    async def _send_engines(self, channel: WorkerChannel, urls: list[str], held: list[str]) -> None:
        request = CoreRequest(Op.SET_ENGINES, method="POST")
        body = json.dumps({"urls": urls, "held": held}).encode()
        try:
            reply = await channel.request(request.to_meta(), body)
        except (WorkerLost, WorkerFailed) as exc:
            # It gets the set again when it is back (attach).
            logger.warning("could not send the engine set to worker %d: %s", channel.index, exc)
            return
        if reply.status != 200:
            logger.warning(
                "worker %d refused the engine set (%d): %r", channel.index, reply.status, reply.body
            )

    @property
    def worker_count(self) -> int:
        return len(self.channels)

    def attach(self, channel: WorkerChannel, *, restarted: bool | None = None) -> None:
        """Install (or replace) the channel of worker `channel.index`. `restarted` says
        whether a new worker process is behind it (default: whenever one is replaced; a
        remote worker's reconnect is not a restart)."""
        old = self.channels[channel.index]
        if restarted if restarted is not None else old is not None:
            self.worker_restarts += 1
        if old is not None:
            asyncio.get_running_loop().create_task(old.aclose())
        self.channels[channel.index] = channel
        channel.start()
        if self._engine_set is not None:
            # A restarted (or reconnected) worker starts from its --backend argv: give it the
            # live set before anything else (`_handle` waits for this task).
            task = asyncio.get_running_loop().create_task(
                self._send_engines(channel, self._engine_set, self._held)
            )
            self._engine_pushes.add(task)
            task.add_done_callback(self._engine_pushes.discard)
            self._engine_sync[channel.index] = task

    # -- handle -----------------------------------------------------------------------

    async def handle(self, request: CoreRequest) -> CoreReply:
        """`/health` from the channels' state; any other request relayed to its worker."""
        try:
            return await self._handle(request)
        except GatewayError as error:
            return error_reply(error)

    async def _handle(self, request: CoreRequest) -> CoreReply:
        if request.op is Op.HEALTH:
            return self.health(request.query)
        if request.op is Op.CREATE:
            request.session_id = self._mint_session_id(request.body)
        index = self._owner(request.session_id, request.headers, request.body)
        channel = self.channels[index]
        if channel is None or not channel.up:
            raise Unavailable(
                f"{self.describe(index)} is down ({self.down_reason(index)}); its sessions are "
                "unavailable until it is back"
            )
        sync = self._engine_sync.get(index)
        if sync is not None:
            if not sync.done():
                # Shielded: a client giving up must not cancel the worker's engine set.
                await asyncio.shield(sync)
            if self._engine_sync.get(index) is sync:
                del self._engine_sync[index]
        try:
            return await channel.request(request.to_meta(), request.body)
        except WorkerLost as exc:
            lost = ""
            if request.session_id and request.op is not Op.CREATE:
                lost = (
                    f"; session {request.session_id} was lost with its worker"
                    if self.remotes is None
                    # Only the connection is known to be gone: the worker may be alive.
                    else f"; session {request.session_id} survives if only the connection "
                    "broke, and was lost if the worker exited"
                )
            raise Unavailable(f"{exc}{lost}") from exc
        except WorkerFailed as exc:
            raise UpstreamError(str(exc)) from exc
        except FrameTooLarge as exc:
            raise PayloadTooLarge(f"request too large for the worker channel: {exc}") from exc

    def _owner(
        self, session_id: str | None, headers: Sequence[tuple[str, str]] = (), body: bytes = b""
    ) -> int:
        if session_id is None:
            if self.sticky_headers is None:
                key = _routing_key(headers)
            else:
                # A sticky key's pin and its requests in flight are a worker's pool's: every
                # request of the key must reach the same worker (the body is read for its rid).
                key = sticky_key(RoutingRequest(headers, body), self.sticky_headers)
            if key is not None:
                # One routing key, one worker: a policy's memory of a key (manual's engine,
                # cache_aware's prompts) is per worker process (docs/routing.md, "Routing keys").
                index = shard_index(key, self.worker_count)
                if self._placeable(index):
                    return index
            # Stateless proxy: any live worker will do.
            live = [c.index for c in self.channels if c is not None and c.up]
            if not live:
                return next(self._round_robin) % self.worker_count
            return live[next(self._round_robin) % len(live)]
        return shard_index(shard_key(session_id), self.worker_count)

    def _mint_session_id(self, body: bytes) -> str:
        """Root ids are minted here; a child's id embeds its root so it lands on the root's
        worker. The worker still checks that the parent exists."""
        if not body.strip():
            return self._new_root_id()
        if len(body) > MAX_CREATE_BODY:
            raise PayloadTooLarge(
                f"POST /sessions body is {len(body)} bytes, over the limit of {MAX_CREATE_BODY}"
            )
        document = parse_json_object(body, "request body")
        parent = document.get("parent_session_id")
        if parent is None:
            return self._new_root_id()
        if not isinstance(parent, str):
            raise BadRequest("field 'parent_session_id' must be a string")
        try:
            validate_session_id(parent)
        except ValueError as exc:
            raise BadRequest(f"invalid parent_session_id: {exc}") from exc
        return new_session_id(parent)

    def _new_root_id(self) -> str:
        """A fresh root id whose worker can serve it now. A root id is random, so while a
        worker is down (restarting after a crash) or stalled, minting again places the new
        session on a live worker instead of failing it with a 503 or parking it behind a
        stopped process. With every worker out, the last id stands and fails as before."""
        session_id = new_session_id()
        for _ in range(MINT_ATTEMPTS):
            if self._placeable(self._owner(session_id)):
                break
            session_id = new_session_id()
        return session_id

    def _placeable(self, index: int) -> bool:
        channel = self.channels[index]
        if channel is None or not channel.up:
            return False
        if channel.last_heartbeat is None:
            return True  # up and not yet beating: just started
        # A heartbeat a little late is a busy machine, not a stopped worker: only a long
        # silence moves new sessions elsewhere (else load would skew placement to one worker).
        return time.monotonic() - channel.last_heartbeat <= AVOID_FOR_NEW_SESSIONS_AFTER

    # -- remote workers -----------------------------------------------------------------

    def remote(self, index: int) -> RemoteSlot | None:
        return self.remotes[index] if self.remotes is not None else None

    def describe(self, index: int) -> str:
        """`worker 1`, or `worker 1 (HOST:PORT)` for a remote worker."""
        remote = self.remote(index)
        return f"worker {index}" + (f" ({remote.endpoint})" if remote is not None else "")

    def _name(self, index: int) -> str:
        """`worker 1 (pid 123)`: the pid lets an operator find the stuck process."""
        channel = self.channels[index]
        return channel.name if channel is not None else self.describe(index)

    def down_reason(self, index: int) -> str:
        remote = self.remote(index)
        if remote is not None:
            return remote.reason()
        channel = self.channels[index]
        return (channel.down_reason if channel is not None else None) or "starting"

    def set_endpoint(self, index: int, endpoint: str) -> None:
        """A remote worker's new address (from the supervisor); ValueError when invalid."""
        from sessiongate.dataplane.transport.tcp import parse_endpoint

        remote = self.remote(index) if 0 <= index < self.worker_count else None
        if remote is None:
            raise ValueError(f"worker {index} is not a remote worker")
        remote.set_endpoint(parse_endpoint(endpoint))

    # -- health and metrics -------------------------------------------------------------

    def worker_states(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        states = []
        for index, channel in enumerate(self.channels):
            remote = self.remote(index)
            extra = remote.status() if remote is not None else {}
            if remote is not None and (channel is None or not channel.up):
                states.append(
                    {
                        "index": index,
                        "state": remote.state,
                        "reason": remote.reason(),
                        "generation": remote.restarts,
                        **extra,
                    }
                )
                continue
            if channel is None:
                states.append({"index": index, "state": "starting"})
                continue
            beat = channel.heartbeat
            age = _heartbeat_age(channel, now)
            state = "up" if channel.up else ("down" if channel.down_reason else "starting")
            reason = channel.down_reason
            if _stalled(channel, age):
                state = "stalled"
                reason = (
                    f"no heartbeat for {age:.1f} s: the process is stopped or its event loop "
                    "is blocked; its requests wait"
                )
            states.append(
                {
                    "index": index,
                    "state": state,
                    "reason": reason,
                    "pid": beat.get("pid"),
                    "generation": channel.generation,
                    "sessions": beat.get("sessions", 0),
                    "inflight": beat.get("inflight", 0),
                    # Turns a trainer should know about: engine aborts, R3 recorded missing,
                    # streamed turns served buffered under relay.
                    "turns_aborted": beat.get("turns_aborted", 0),
                    # Line turns that rolled back, and the assistant steps they replaced.
                    "rollbacks": beat.get("rollbacks", 0),
                    "rollback_steps": beat.get("rollback_steps", 0),
                    "r3_missing_turns": beat.get("r3_missing_turns", 0),
                    "relay_buffered_turns": beat.get("relay_buffered_turns", 0),
                    # Bulk replies the worker wrote on a lent client connection.
                    "replies_lent": beat.get("replies_lent", 0),
                    # Abuse limits (0 = off) and their usage (docs/reliability.md, "Limits").
                    **{key: beat.get(key, 0) for key in LIMIT_FIELDS},
                    "rejected": beat.get("rejected", {}),
                    # "ok" / "down" (every upstream of the worker down); None before the
                    # first heartbeat or from a worker too old to say.
                    "upstream": beat.get("upstream"),
                    "upstreams": beat.get("upstreams", []),
                    "heartbeat_age_s": round(age, 3) if age is not None else None,
                    **extra,
                }
            )
        return states

    def health(self, query: str = "") -> CoreReply:
        states = self.worker_states()
        headers = [(INSTANCE_HEADER, self.instance)] if self.instance else []
        # Workers that cannot reach any upstream: every turn they own fails with a 502.
        cut_off = [s for s in states if s.get("upstream") == "down"]
        upstream = "down" if cut_off else "ok"
        # A stalled worker is not down: it holds its sessions and may resume (a long blocking
        # step, SIGSTOP); a liveness 503 would restart the gateway and drop every session.
        stalled = [s for s in states if s["state"] == "stalled"]
        down = [s for s in states if s["state"] not in ("up", "stalled")]
        if down:
            first = down[0]
            reason = first.get("reason") or first["state"]
            return json_reply(
                503,
                {
                    "error": f"{self.describe(first['index'])} is down ({reason})",
                    "status": "degraded",
                    "upstream": upstream,
                    "workers": states,
                },
                headers,
            )
        document: dict[str, Any] = {
            "status": "ok",
            "upstream": upstream,
            "workers": states,
            "sessions": sum(s.get("sessions", 0) for s in states),
        }
        status = 200
        if cut_off:
            # 200 by default: restarting the gateway cannot fix the engine and would drop
            # every session's records (docs/reliability.md, "Upstream outages").
            document["status"] = "degraded"
            document["reason"] = "; ".join(
                f"{self.describe(s['index'])}: {_upstream_reason(s)}" for s in cut_off
            )
            status = 503 if upstream_required(query) else 200
        if stalled:
            document["status"] = "degraded"
            reasons = [document["reason"]] if "reason" in document else []
            reasons += [f"{self._name(s['index'])} is stalled ({s['reason']})" for s in stalled]
            document["reason"] = "; ".join(reasons)
        return json_reply(status, document, headers)

    def gauges(self) -> list[WorkerGauge]:
        gauges = []
        now = time.monotonic()
        for index, channel in enumerate(self.channels):
            gauge = WorkerGauge(
                index=index,
                up=channel is not None and channel.up,
                sessions=channel.heartbeat.get("sessions", 0) if channel else 0,
                inflight=channel.heartbeat.get("inflight", 0) if channel else 0,
                bytes_relayed=channel.bytes_relayed if channel else 0,
                affinity_hits=channel.heartbeat.get("affinity_hits", 0) if channel else 0,
                repins=channel.heartbeat.get("repins", 0) if channel else 0,
                **_limit_gauges(channel.heartbeat if channel else {}),
                upstreams=_upstream_gauges(channel.heartbeat) if channel else [],
                upstream_reliability=(
                    reliability_gauges(channel.heartbeat.get("upstreams", [])) if channel else []
                ),
            )
            if channel is not None:
                gauge.heartbeat_age_s = _heartbeat_age(channel, now)
                gauge.stalled = _stalled(channel, gauge.heartbeat_age_s)
            remote = self.remote(index)
            if remote is not None:
                gauge.address = str(remote.endpoint)
                gauge.transport = remote.transport
                gauge.state = remote.state
                gauge.reconnects = remote.reconnects
                gauge.connect_failures = remote.connect_failures
            gauges.append(gauge)
        return gauges

    def engine_counts(self) -> list[list[dict[str, Any]]]:
        """Per live worker, its pool's per-engine counts (its last heartbeat)."""
        # A worker that is down has no request in flight any more; its sent count comes back
        # from zero with its replacement (a counter reset, as Prometheus reads one).
        return [
            [e for e in channel.heartbeat.get("engines", []) if isinstance(e, dict)]
            for channel in self.channels
            if channel is not None and channel.up
        ]

    async def aclose(self) -> None:
        for remote in self.remotes or []:
            await remote.aclose()
        for channel in self.channels:
            if channel is not None:
                await channel.aclose()


def _heartbeat_age(channel: WorkerChannel, now: float) -> float | None:
    return now - channel.last_heartbeat if channel.last_heartbeat is not None else None


def _stalled(channel: WorkerChannel, age: float | None) -> bool:
    """Connected but silent for two beats: stopped (SIGSTOP) or its event loop is blocked.
    Its requests wait; /health and /metrics say so at once instead of "up" until a timeout."""
    return channel.up and age is not None and age > STALL_AFTER


def _upstream_reason(state: dict[str, Any]) -> str:
    errors = [
        str(u.get("last_error") or f"{u.get('url')} is down") for u in state.get("upstreams", [])
    ]
    return "every upstream is down: " + "; ".join(errors)


def _upstream_gauges(heartbeat: dict[str, Any]) -> list[tuple[str, bool]]:
    """(url, healthy) of each upstream of a worker, from its last heartbeat."""
    return [
        (str(u.get("url")), bool(u.get("healthy")))
        for u in heartbeat.get("upstreams", [])
        if isinstance(u, dict)
    ]


def _limit_gauges(heartbeat: dict[str, Any]) -> dict[str, Any]:
    """The WorkerGauge fields of a worker's limits, from its last heartbeat."""
    rejected = heartbeat.get("rejected")
    return {
        "records_bytes": int(heartbeat.get("records_bytes", 0)),
        "max_records_bytes": int(heartbeat.get("max_records_bytes", 0)),
        "max_sessions": int(heartbeat.get("max_sessions", 0)),
        "sessions_expired": int(heartbeat.get("sessions_expired", 0)),
        "records_resident_bytes": int(heartbeat.get("records_resident_bytes", 0)),
        "records_spilled": int(heartbeat.get("records_spilled", 0)),
        "records_write_errors": int(heartbeat.get("records_write_errors", 0)),
        "rejected": dict(rejected) if isinstance(rejected, dict) else {},
    }


def _state(channel: WorkerChannel) -> str:
    if channel.up:
        return "up"
    return "down" if channel.down_reason else "starting"


async def open_channel(
    index: int, sock: socket.socket, generation: int = 0, reply_dir: str | None = None
) -> WorkerChannel:
    """The channel to a worker this router's supervisor started (which may answer bulk
    replies with files in `reply_dir`)."""
    conn = await FrameConnection(sock).open()
    return WorkerChannel(index, conn, generation=generation, reply_dir=reply_dir)


def watch_control_socket(
    control: socket.socket,
    router: ShardRouter,
    on_supervisor_gone: Callable[[], None],
    reply_dir: str | None = None,
) -> None:
    """Receive notices from the supervisor, one JSON object per line: a replacement worker
    channel (`{"worker", "generation"}` with its socket passed along, SCM_RIGHTS) or a
    remote worker's new address (`{"worker", "endpoint"}`)."""
    loop = asyncio.get_running_loop()
    control.setblocking(False)
    buffer = bytearray()
    received_fds: list[int] = []
    pending_attaches: set[asyncio.Task[None]] = set()

    def handle(line: bytes) -> None:
        try:
            notice = json.loads(line)
            if "endpoint" in notice:
                router.set_endpoint(int(notice["worker"]), str(notice["endpoint"]))
                return
            index, generation = int(notice["worker"]), int(notice["generation"])
            if not received_fds or not 0 <= index < router.worker_count:
                raise ValueError(f"bad worker notice {notice!r} with {len(received_fds)} fds")
        except (ValueError, KeyError, TypeError) as exc:
            logger.error("ignoring control message: %s", exc)
            return
        sock = socket.socket(fileno=received_fds.pop(0))

        async def attach() -> None:
            router.attach(await open_channel(index, sock, generation, reply_dir))

        task = loop.create_task(attach())
        pending_attaches.add(task)
        task.add_done_callback(pending_attaches.discard)

    def on_readable() -> None:
        try:
            message, fds, _flags, _addr = socket.recv_fds(control, 4096, 4)
        except BlockingIOError:
            return
        except OSError:
            message, fds = b"", []
        if not message:
            loop.remove_reader(control.fileno())
            for fd in received_fds:
                os.close(fd)
            on_supervisor_gone()
            return
        received_fds.extend(fds)
        # A stream socket may merge or split notices: only whole lines are handled.
        buffer.extend(message)
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if line.strip():
                handle(line)

    loop.add_reader(control.fileno(), on_readable)


def _routing_key(headers: Sequence[tuple[str, str]]) -> str | None:
    """The request's X-SMG-Routing-Key (the first, when not empty), as the policies read it."""
    for name, value in headers:
        if name.lower() == "x-smg-routing-key":
            return value or None
    return None
