"""Type stub for ``sessiongate._core``, the compiled Rust core.

Hand-kept and complete: ``tests/package/test_core_stub.py`` checks that every public name of the
compiled module is declared here and vice versa, with matching parameter names. Use the
module through :mod:`sessiongate.primitives`, which also provides the pure-Python twins.
"""

from collections.abc import Iterable, Sequence
from typing import Any, final

from typing_extensions import Buffer

__version__: str

def build_info() -> dict[str, str]:
    """This build of the core: ``version``, ``target`` (the Rust target triple), ``profile``
    (``release`` or ``debug``) and ``rustc`` (the compiler's version line)."""

# Shard key and ids (rust/shard.rs)

MAX_SESSION_ID_LEN: int
"""Longest accepted session id, in characters (256)."""

def shard_index(key: str | bytes, n: int) -> int:
    """``int.from_bytes(blake2b(key, digest_size=8).digest(), "big") % n`` (str as UTF-8)."""

def shard_indices(keys: Iterable[str | bytes], n: int) -> list[int]:
    """``[shard_index(k, n) for k in keys]``, hashed with the GIL released."""

def shard_key(session_id: str) -> str:
    """The text before the first '.', or the whole id."""

def validate_session_id(session_id: str) -> str:
    """``session_id`` unchanged if it is 1-256 visible ASCII characters, else ValueError."""

def new_session_id(parent: str | None = None) -> str:
    """A root id (uuid4 hex) or, with ``parent``, ``<root of parent>.<uuid4 hex>``."""

# IPC frames and envelopes (rust/frame.rs)

FRAME_REQUEST: int
FRAME_REPLY: int
FRAME_ERROR: int
FRAME_HEADER_SIZE: int
"""17: u64 length + u64 request id + u8 type."""
DEFAULT_MAX_FRAME: int
"""64 GiB: the default cap on a frame's length field."""

def encode_frame(
    frame_type: int, request_id: int, payload: Buffer, *, max_frame: int | None = ...
) -> bytes:
    """One whole frame; FrameTooLarge when 9 + len(payload) > max_frame."""

def encode_frame_header(
    frame_type: int, request_id: int, payload_len: int, *, max_frame: int | None = ...
) -> bytes:
    """The 17 header bytes of a frame whose payload is written separately."""

def encode_envelope(meta: dict[str, Any], body: Buffer | None = ...) -> bytes:
    """``u64 BE meta_len | compact JSON meta | body``."""

def decode_envelope(payload: Buffer) -> tuple[dict[str, Any], memoryview]:
    """The meta dict and a zero-copy memoryview of the body; FrameError if malformed."""

@final
class FrameDecoder:
    """Incremental decoder; closed (every feed raises FrameError) after a decode error."""

    def __init__(self, max_frame: int | None = ...) -> None: ...
    @property
    def max_frame(self) -> int:
        """The largest accepted length field (9 + payload length)."""
    @property
    def buffered(self) -> int:
        """Bytes of the incomplete frame held by the decoder."""
    @property
    def pending_frame_size(self) -> int | None:
        """Wire size (8 + length) of the incomplete frame once its length is known."""
    @property
    def closed(self) -> bool:
        """True after a decode error."""
    def feed(self, data: Buffer) -> list[tuple[int, int, bytes]]:
        """Consume ``data``; return ``(type, request_id, payload)`` per completed frame."""

# JSON relay (rust/relay.rs, rust/r3.rs; docs/relay.md)

@final
class ExtractedReply:
    """What ``extract_reply`` returns (read-only attributes)."""

    @property
    def completion_ids(self) -> list[int]:
        """``choices[0].meta_info.output_token_logprobs[i][1]``."""
    @property
    def logprobs(self) -> list[float]:
        """``float(output_token_logprobs[i][0])``."""
    @property
    def completion_tokens(self) -> int:
        """``choices[0].meta_info.completion_tokens``."""
    @property
    def finish_reason(self) -> object:
        """``meta_info.finish_reason`` if present, else ``choices[0].finish_reason`` (or None)."""
    @property
    def message(self) -> dict[str, Any]:
        """``{"role": "assistant", "content": ..., "reasoning_content"?: ..., "tool_calls"?: ...}``
        (reasoning_content if a string, tool_calls if truthy)."""
    @property
    def client_body(self) -> bytes:
        """The reply without ``routed_experts`` / ``indexer_topk`` in any choice's meta_info."""
    @property
    def routed_experts(self) -> bytes | None:
        """The base64 text of ``choices[0].meta_info.routed_experts``; None if absent or null.

        Copied from the reply on first access (use ``routed_experts_view`` to avoid it)."""
    @property
    def routed_experts_view(self) -> memoryview | None:
        """The same text as a read-only memoryview: a zero-copy slice of a ``bytes`` reply."""
    @property
    def indexer_topk(self) -> bytes | None:
        """The base64 text of ``choices[0].meta_info.indexer_topk``; None if absent or null.

        Copied from the reply on first access (use ``indexer_topk_view`` to avoid it)."""
    @property
    def indexer_topk_view(self) -> memoryview | None:
        """The same text as a read-only memoryview: a zero-copy slice of a ``bytes`` reply."""
    @property
    def prompt_tokens(self) -> int | None:
        """``choices[0].meta_info.prompt_tokens`` when it is an int."""
    @property
    def cached_tokens(self) -> int | None:
        """``choices[0].meta_info.cached_tokens`` when it is an int (not a bool)."""
    @property
    def weight_version(self) -> str | None:
        """``choices[0].meta_info.weight_version`` if a string, else the top-level
        ``metadata.weight_version`` if a string, else None."""
    @property
    def e2e_latency(self) -> float | None:
        """``choices[0].meta_info.e2e_latency`` as a float when it is a number (not a bool)."""

def extract_reply(body: Buffer) -> ExtractedReply:
    """Validate an upstream reply (ReplyContractError with the 502 message) and extract it."""

def rewrite_request(body: Buffer, fields: dict[str, Any]) -> bytes:
    """The request JSON with the top-level members in ``fields`` set (RequestRewriteError)."""

@final
class CachedTokensWatch:
    """The same watch fed piece by piece: ``finish()`` once the reply has ended."""

    def __init__(self) -> None: ...
    def feed(self, piece: Buffer) -> None: ...
    @property
    def done(self) -> bool:
        """Whether the value is known (or known to be absent): later pieces are not read."""
    def finish(self) -> int | None: ...

def decode_r3(data: str | Buffer, *, layers: int, topk: int) -> memoryview:
    """Base64 little-endian int32 R3 as a memoryview ``'i'`` of shape (n_tokens, layers, topk)."""

# Session routing stamping (rust/stamp.rs; docs/routing.md)

@final
class HeaderStamper:
    """Header names per tier (list or tuple of str), validated once: RFC 9110 tokens, not
    owned by the gateway, unique case-insensitively (ValueError / TypeError otherwise)."""

    def __init__(
        self, session: Sequence[str], parent: Sequence[str], root: Sequence[str]
    ) -> None: ...
    @property
    def session(self) -> tuple[str, ...]:
        """Names that carry the session id."""
    @property
    def parent(self) -> tuple[str, ...]:
        """Names that carry the parent id (child sessions only)."""
    @property
    def root(self) -> tuple[str, ...]:
        """Names that carry the root id."""
    def stamp(self, session_id: str, parent_id: str | None, root_id: str) -> dict[str, str]:
        """A new dict: the session id under every session name, the parent id under every
        parent name unless it is None, the root id under every root name."""

def nvext_session_control(body: Buffer, session_id: str, action: str, timeout: int | None) -> bytes:
    """The request JSON with ``nvext.session_control`` set to ``{"session_id", "action"[,
    "timeout"]}`` by splicing (RequestRewriteError for invalid JSON / a non-object body)."""

# In-place bytes (rust/bytes_sink.rs)

@final
class BytesSink:
    """A ``bytes`` of ``size`` bytes, written in place through ``view()`` (e.g.
    ``socket.recv_into``) and handed out by ``finish(filled)`` without a copy. Its pages are
    faulted in at creation but not zeroed: ``finish`` zeroes what lies past the ``filled``
    bytes written. The object is private to the sink until then, so no Python code sees a
    ``bytes`` change."""

    def __init__(self, size: int) -> None: ...
    def view(self) -> memoryview:
        """A writable memoryview of the whole sink; release it before ``finish``."""
    def finish(self, filled: int) -> bytes:
        """The ``bytes``: its first ``filled`` bytes as written, the rest zero. ValueError for
        ``filled`` outside 0..size; BufferError while views are open, or when called twice."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

# Engine routing (rust/engine_policy/; twin: sessiongate.engines.policy.engine_policy)

@final
class EnginePolicy:
    """An engine routing policy (``round_robin``, ``random``, ``power_of_two``,
    ``least_in_flight``, ``cache_aware``, ``cache_aware_gateway``, ``manual``,
    ``consistent_hashing``) and the states of ``engines`` (their URLs) it decides on: the
    caller reports requests started and finished, health and reported load, and calls
    ``evict`` every ``eviction_interval_secs``. ``options``: the tunables of
    ``EngineRoutingConfig.options()`` (any subset); ValueError for an unknown name or option
    or a bad value."""

    def __init__(
        self, name: str, engines: list[str], options: dict[str, object] | None = None
    ) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def in_flight(self) -> list[int]:
        """Requests in flight per engine, as reported through ``started``/``finished``."""
    def pick(self, headers: list[tuple[str, str]], body: bytes) -> int:
        """The engine index for a request with these headers and body."""
    def record(self, index: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """A request went to engine ``index`` without a pick (a pinned session family's
        turn): learn it as a pick of ``index`` would (cache_aware's tree and work estimate;
        the other policies keep nothing of it). IndexError out of range."""
    def prefilled(self, index: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """Engine ``index`` answered this request with a 200: its prompt is in the engine's
        cache (cache_aware counts a sent prefix as held from then on; the other policies
        ignore it). IndexError out of range."""
    def held(self, index: int, headers: list[tuple[str, str]], body: bytes) -> int | None:
        """Units of this request's prompt engine ``index`` is believed to hold (asked at the
        pick), None unless cache_aware counts token ids. IndexError out of range."""
    def cached(
        self,
        index: int,
        headers: list[tuple[str, str]],
        body: bytes,
        held: int,
        cached_tokens: int,
    ) -> int:
        """Engine ``index`` answered with ``cached_tokens`` of the prompt from its cache,
        against ``held`` at the pick: the units learned lost (forgotten least recently used
        first), 0 when none. ValueError for a negative count."""
    def pick_keyed(self, headers: list[tuple[str, str]], body: bytes) -> tuple[int, str | None]:
        """The engine and the request's sticky key (None without sticky sessions or a key)."""
    def sticky_key(self, headers: list[tuple[str, str]], body: bytes) -> str | None: ...
    def started(self, index: int, key: str | None = None) -> None: ...
    def finished(
        self, index: int, cached_tokens: int | None = None, key: str | None = None
    ) -> None: ...
    def set_load(self, index: int, load: int | None) -> None:
        """The engine's reported load (``/get_load``), None when unknown."""
    def set_loads(self, index: int, report: tuple[int, int, int, float, float] | None) -> None:
        """What the engine's ``GET /v1/loads`` said, summed over its DP ranks (a
        ``LoadReport``: running requests, waiting requests, waiting uncached tokens, mean KV
        token usage, generation throughput), None when unknown or aged out; a report resets
        the tokens and requests counted as sent since the previous one."""
    def set_healthy(self, index: int, healthy: bool) -> None: ...
    def evict(self, now: float) -> None:
        """Trim the policy's state; ``now`` is seconds on a monotonic clock."""

# The compiled front door (rust/front/)

@final
class CompiledFront:
    """An HTTP/1.1 server on tokio threads that owns the public listening socket: stateless
    proxy requests (``front_route(...) == "proxy"``) are relayed to the upstreams without
    Python; with ``dispatch``, requests Python answers (``"dispatch"``) reach it through
    ``take_requests`` while the front keeps their connection; any other connection is
    handed off, its fd plus the bytes already read from the current request on, through
    ``take_handoffs``. One byte is written to ``notify_fd`` per queued request, hand-off or
    writable id. Serves from construction until ``stop``."""

    def __init__(
        self,
        listen_fd: int,
        notify_fd: int,
        upstreams: list[str],
        *,
        max_body_bytes: int,
        api_key: str | None,
        session_headers: list[str],
        header_timeout: float,
        body_timeout: float,
        keepalive_timeout: float,
        upstream_timeout: float,
        connect_timeout: float,
        threads: int,
        latency_buckets: list[float],
        dispatch: bool = False,
        engine_policy: str = "round_robin",
        engine_policy_options: dict[str, object] | None = None,
        reliability: dict[str, object] | None = None,
    ) -> None:
        """``listen_fd`` (a bound, listening TCP socket) and ``notify_fd`` (the write end of a
        non-blocking pipe) are duplicated: the caller keeps and later closes its own. The
        listening socket is switched to non-blocking mode (a flag it shares with the
        duplicate). ``upstreams`` are distinct ``http://host:port[/prefix]`` base URLs
        (trailing "/" stripped; none: stateless requests go to Python until
        ``set_engines``); timeouts are positive seconds; ``latency_buckets`` strictly
        ascending. ValueError (OSError for the fds) otherwise. Without ``dispatch`` the
        requests Python answers are handed off with their connection. ``engine_policy`` and
        ``engine_policy_options`` choose the engine of each proxied request (as
        ``EnginePolicy``; the policy's trims run every ``eviction_interval_secs``);
        ``reliability`` is ``dataclasses.asdict`` of a ``ReliabilityConfig`` (retries, circuit
        breakers, health thresholds; None: the defaults). The front probes no engine itself:
        its process's prober passes each verdict to ``probed``."""
    def take_handoffs(self) -> list[tuple[int, bytes]]:
        """Drain the queued hand-offs: ``(fd now owned by the caller, bytes already read)``."""
    def take_requests(self) -> list[DispatchedRequest]:
        """Drain the dispatched requests, oldest first."""
    def take_writable(self) -> list[int]:
        """Drain the ids of dispatched requests that may ``send`` again after a 1 (full)."""
    def set_relay(self, relay: bool) -> None:
        """Relay stateless proxy requests to the front's engines (True, the default) or
        dispatch them to Python (False: no engine, or one the front cannot reach)."""
    def set_engines(self, urls: list[str]) -> None:
        """Relay stateless requests to ``urls`` from now on: a new pool, the engine policy
        afresh over them, engines in both sets keeping their connections and health;
        requests in flight finish on the pool they started on. ValueError for an empty list,
        a URL the front cannot relay to (not plain ``http://``) or a stopped front."""
    def probed(self, url: str, error: str | None = None) -> bool:
        """A health probe's verdict on the engine at ``url`` (as given, trailing "/"
        stripped; ``error`` None: it passed), which flips its health at the health
        thresholds of ``reliability``. False when the current set has no such engine."""
    def loads(self, url: str, report: tuple[int, int, int, float, float] | None = None) -> bool:
        """A ``GET /v1/loads`` poll's outcome for the engine at ``url`` (a ``LoadReport``;
        None: it gave none), for the front's policy (``EnginePolicy.set_loads``). False when
        the current set has no such engine; ValueError for a report out of range."""
    def stats(self) -> dict[str, object]:
        """``{"requests": {status: count}, "latency": {"buckets": [cumulative count per
        bound], "count": n, "sum": seconds}, "handoffs": n, "connections": open Rust-owned
        connections, "upstreams": [{"url", "healthy", "last_error"?, "in_flight", "sent"}]}``
        (``in_flight``: requests relayed to it now; ``sent``: relayed in all, retries
        included)."""
    def stop(self, grace: float) -> None:
        """Stop accepting (the caller's listening socket stays open), close idle
        connections, let in-flight requests finish for up to ``grace`` s, then shut the
        runtime down and close untaken hand-offs. Idempotent; releases the GIL."""

@final
class DispatchedRequest:
    """A request the front passes to Python, which answers it once: ``reply`` (whole), or
    ``start``, ``send``... and ``end`` (or ``abort``). Dropped without an answer, the front
    closes the connection."""

    @property
    def id(self) -> int: ...
    @property
    def method(self) -> str: ...
    @property
    def target(self) -> str:
        """The request target as sent: path and query, visible ASCII."""
    @property
    def headers(self) -> list[tuple[str, str]]:
        """Names lowercased, values decoded as latin-1, in order (as an ASGI scope has)."""
    @property
    def body(self) -> bytes: ...
    @property
    def connected(self) -> bool:
        """False once the front knows the client is gone."""
    def reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> bool:
        """The whole reply; the front adds ``content-length`` (and ``connection: close``
        when the request or the stop asked for it). False when the client is gone.
        ValueError for a status outside 100..999, a header name that is not a token, a
        value with CR, LF or NUL, text that is not latin-1, or a second reply."""
    def start(self, status: int, headers: list[tuple[str, str]]) -> bool:
        """The head of a streamed reply: chunked, unless ``headers`` declare a
        ``content-length`` (parts past it are dropped, an end short of it closes)."""
    def send(self, data: bytes) -> int:
        """Queue a part: 0 sent; 1 sent, but more than 1 MiB is queued (wait until
        ``take_writable`` returns this id); -1 the client is gone (nothing sent)."""
    def send_file(self, fd: int, length: int) -> int:
        """Queue the first ``length`` bytes of the open file ``fd`` as a part, sent by the
        kernel (``sendfile``) without being read here. The front owns ``fd`` from this call
        on, whatever it answers, and closes it: 0 queued, -1 the client is gone.
        ValueError for a negative ``fd`` or before ``start``."""
    def lend(self, path: str) -> bool:
        """Lend the connection to the worker listening on the UNIX socket at ``path``: once
        the parts before are out, the front passes it the client's socket (a chunked reply)
        or a refusal (any other framing). Send the next part only once the worker is done.
        False when the client is gone; ValueError before ``start``."""
    def end(self) -> bool:
        """The end of a streamed reply; False when the client is gone."""
    def abort(self) -> None:
        """Cut a started reply: the front closes the connection without ending it."""

# Test hooks (rust/testing.rs): internals exported only so that the tests can reach them,
# the Rust halves of twin tests and the JSON scanner's verdict. The gateway never calls them.

def json_reject(body: Buffer) -> str | None:
    """None when the relay's JSON scanner (rust/json_scan.rs) takes ``body`` on its fast
    path, else why it does not and where (``"<reason> at byte <offset>"``)."""

def reserved_header_names() -> tuple[str, ...]:
    """The reserved header names as compiled into rust/stamp.rs
    (``primitives/header_names.py`` is the twin)."""

def front_backoff_ms(
    attempt: int, initial_ms: int, max_ms: int, multiplier: float, jitter: float, sample: float
) -> int:
    """The relay's retry backoff (``engines.reliability.backoff_ms``'s twin)."""

def front_transport_error_text(method: str, url: str, path: str, kind: str, detail: str) -> str:
    """The relay's 502 text (``engines.client.transport_error_text``'s twin)."""

def front_connect_failed_text(host: str, port: int, why: str) -> str:
    """``http.client.connect_failed_text``'s twin."""

def front_connect_timed_out(seconds: float) -> str:
    """``http.client.connect_timed_out``'s twin (Python's ``str(float)``)."""

def front_url_hostname(host: str) -> str:
    """The host of an authority as ``urlsplit(url).hostname`` gives it."""

def front_retry_target(order: list[int], failed: int, available: list[bool]) -> int | None:
    """Where the relay retries after a connect failure (``engines.pool.retry_target``'s
    twin)."""

def front_bulk_pauses(before: str, after: str, elapsed_us: int) -> bool:
    """Whether the front's bulk thread pauses, given two readings of /proc/pressure/cpu
    ``elapsed_us`` apart (``front.cpu_pressure.pauses`` over ``psi_some_total``'s twin)."""

def front_sibling_warmup(method: str, path: str, body: bytes) -> bytes | None:
    """The warm-up the compiled front sends for the request's prompt, None when it has none
    that counts (``engines.siblings.warmup_body`` over ``prompt_key``)."""

def front_siblings_roles(
    ops: list[tuple[str, int, list[int], bool]],
) -> tuple[list[str], float, tuple[int, int, int, int, int]]:
    """``ops`` (``(op, engine, prompt ids, took)``, op one of ``"enter"``, ``"resume"``,
    ``"warmed"`` (with ``took``), ``"leave"``) run on a fresh siblings table of the compiled
    front: each op's role (``"go"``, ``"warm_up"``, ``"wait"``, ``"follow"``; ``""`` for
    warmed and leave), the ``grouped`` estimate and the counters (siblings held, leads held,
    leads followed, warm-ups, failed) (``engines.siblings.Siblings.admit`` / ``resume`` /
    ``warmed`` / ``leave``'s twin)."""

class FrontCircuitBreaker:
    """The relay's circuit breaker (``engines.reliability.CircuitBreaker``'s twin)."""

    def __init__(
        self,
        failure_threshold: int,
        success_threshold: int,
        timeout_secs: float,
        window_secs: float,
        disabled: bool = False,
    ) -> None: ...
    def state(self, now: float) -> int: ...
    def allows(self, now: float) -> bool: ...
    def record(self, success: bool, now: float) -> int: ...
    @property
    def opened(self) -> int: ...

class FrontHealthCounter:
    """The relay's probe thresholds (``engines.reliability.HealthCounter``'s twin)."""

    def __init__(self, failures: int = 3, successes: int = 2) -> None: ...
    def probe(self, passed: bool, healthy: bool) -> bool: ...
    def reset(self) -> None: ...

def front_route(
    method: str, target: str, headers: list[tuple[str, str]], session_headers: list[str]
) -> str:
    """For a plain origin-form target (RFC 3986 characters only; any other is
    ``"handoff"``): ``"proxy"`` when the front serves the request itself (GET/POST under
    ``/v1/``, except a chat POST with a non-empty session header), ``"dispatch"`` for the
    other GET, POST and DELETE requests (except the documentation pages), else ``"handoff"``
    (``front/routes.py::front_decision``)."""

def front_forwarded_headers(
    headers: list[tuple[str, bytes]], reply: bool = False
) -> list[tuple[str, bytes]]:
    """The headers the compiled front passes on, in order: a request's (``reply=False``) or an
    upstream reply's, less the hop-by-hop ones and those their ``Connection`` names
    (``http/forwarding.py`` is the twin)."""
