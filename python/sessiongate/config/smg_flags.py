"""smg's router flags on `sessiongate serve`'s command line: served, renamed or refused.

Made by hand from smg 1.13.0's `smg/router_args.py` (`RouterArgs.add_cli_args`, every
`add_argument` of it: 213 calls, 220 spellings with their second names, plus the `--no-`
forms of its one `BooleanOptionalAction`: 222 flags, 34 served, 12 renamed, 176 not
served). `smg launch` declares them unprefixed; `smg serve` (engines and router in one
command) declares every one but `--host`, `--port` and `--worker-urls` with a `--router-`
prefix too, plus `--router-disable-arg-fallback`, so a `--router-X` spelling is looked up as
`--X` (`refusal` below). smg is not a dependency: the table is data, checked against
sessiongate's own parser by tests/config/test_smg_flags.py.

- served: sessiongate has the flag under smg's name (SMG_SERVED); nothing to do.
- renamed: sessiongate has an equivalent under another name (SMG_RENAMED: what to write).
- not served: sessiongate has nothing like it (SMG_NOT_SERVED: why, in a few words).

A renamed or not-served flag makes `serve` exit with status 2 and one line naming it, at
argument parsing (config/cli.py), before anything starts. When sessiongate comes to serve
one of them under smg's name, deleting its row (and adding the flag to the schema) is the
whole change: a flag the parser declares is never refused. docs/smg-flags.md lists the table.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sessiongate.config.engines import EngineRoutingConfig, EnginesConfig
from sessiongate.config.fields import flag_of

# smg flags sessiongate's serve takes under the same name (a few with another meaning or
# fewer values: see SMG_VALUES and docs/smg-flags.md). Written without their dashes: serve
# declares each flag once, in its configuration section, and this is only smg's list.
SMG_SERVED: frozenset[str] = frozenset(
    "--" + name
    for name in (
        "host",
        "port",
        "policy",
        "cache-threshold",
        "cache-match-threshold",
        "balance-abs-threshold",
        "spill-abs-threshold",
        "balance-rel-threshold",
        "spill-rel-threshold",
        "eviction-interval-secs",
        "max-tree-size",
        "max-idle-secs",
        "sticky-key-idle-secs",
        "sticky-sessions",
        "routing-key-override",
        "routing-key-headers",
        "worker-overload-protection",
        "disable-worker-overload-protection",
        "worker-overload-waiting-requests",
        "worker-overload-token-usage",
        "assignment-mode",
        "enable-rl",
        "rl-control-timeout-secs",
        "rl-fanout-concurrency",
        "log-level",
        "retry-max-retries",
        "retry-initial-backoff-ms",
        "retry-max-backoff-ms",
        "retry-backoff-multiplier",
        "retry-jitter-factor",
        "disable-retries",
        "cb-failure-threshold",
        "cb-success-threshold",
        "cb-timeout-duration-secs",
        "cb-window-duration-secs",
        "disable-circuit-breaker",
        "health-failure-threshold",
        "health-success-threshold",
        "health-check-timeout-secs",
        "health-check-endpoint",
        "backend",
        "prefix-token-count",
        "prefix-hash-load-factor",
        "prefix-hash-balance-abs-threshold",
        "least-load-kv-pressure-weight",
        "least-load-default-throughput",
        "least-load-mean-prefill-tokens",
        "least-load-max-waiting-requests",
        "power-of-two-load-metric",
        "load-monitor-interval",
        "api-key",
    )
)

# smg flag -> the sessiongate option to write instead (and what differs, if anything).
SMG_RENAMED: dict[str, str] = {
    "--worker-urls": "--backend URL, once per engine (--backend U1 --backend U2)",
    "--health-check-interval-secs": "--health-interval SECONDS",
    "--request-timeout-secs": "--timeout SECONDS (the engine request timeout)",
    "--max-payload-size": "--max-body-bytes BYTES",
    "--header-read-timeout-secs": "--header-timeout SECONDS",
    "--stream-body-stall-timeout-secs": "--body-timeout SECONDS (silence between body chunks)",
    "--model-path": "--tokenizer DIR (a local Hugging Face tokenizer directory)",
    "--model": "--tokenizer DIR (a local Hugging Face tokenizer directory)",
    "--tokenizer-path": "--tokenizer DIR (a local Hugging Face tokenizer directory)",
    "--chat-template": "--chat-template-path FILE",
    "--control-plane-api-keys": "--admin-key KEY (one key for the management routes; key "
    "ids and roles are not served)",
}

_PD = "prefill-decode disaggregation"
_EPD = "encode-prefill-decode disaggregation"
_DISCOVERY = "service discovery (engines register with POST /workers)"
_SHED = "shedding when every engine is overloaded (the least queued one takes the request)"
_LIVENESS = "smg's liveness vetoes (engines are probed by health checks and circuit breakers)"
_KV_EVENTS = "event-driven cache-aware routing (KV events)"
_CACHE_AWARE = "a tunable of smg's cache_aware that sessiongate's cache_aware does not read"
_STARTUP = "smg's worker startup wait (engines are probed by health checks)"
_LOAD_MONITOR = "smg's load monitor switch (the poll runs whenever the policy reads loads)"
_ADMISSION = "admission control (concurrency limit, queue, rate limit)"
_MULTIMODAL = "router-side multimodal processing"
_TOKENIZER = "smg's tokenizer loading and caches"
_PARSERS = "reasoning and tool-call parsing (the engine's; --tito-model names a model family)"
_STORAGE = "Responses API storage, MCP and WASM hooks"
_TENANTS = "tenants"
_AUTH = "JWT/OIDC authentication"
_MESH = "the HA mesh"
_TRACING = "tracing (OpenTelemetry)"
_TLS = "TLS (terminate it in front of the gateway)"
_DP = "data-parallel-aware scheduling"

# smg flag -> why sessiongate does not serve it.
SMG_NOT_SERVED: dict[str, str] = {
    "--router-disable-arg-fallback": "smg serve's fallback to its engine's flags",
    "--upstream-http2": "HTTP/2 to engines",
    "--upstream-pool-idle-timeout-secs": "a tunable engine connection pool",
    "--health-check-port": "a separate probe port (/health is on --port)",
    "--encode-policy": _EPD,
    "--prefill-policy": _PD,
    "--decode-policy": _PD,
    "--balance-token-usage-threshold": _CACHE_AWARE,
    "--overload-token-usage-threshold": _CACHE_AWARE,
    "--worker-overload-shed": _SHED,
    "--kv-index": _KV_EVENTS,
    "--worker-stall-secs": _LIVENESS,
    "--worker-wedge-secs": _LIVENESS,
    "--worker-stale-secs": _LIVENESS,
    "--worker-warmup-secs": _CACHE_AWARE,
    "--worker-warmup-share": _CACHE_AWARE,
    "--worker-warmup-blocks": _CACHE_AWARE,
    "--worker-warmup-thin-ratio": _CACHE_AWARE,
    "--worker-warmup-divert-every": _CACHE_AWARE,
    "--selection-policy": _CACHE_AWARE,
    "--selection-accounting-ttl-ms": _CACHE_AWARE,
    "--overlap-decay": _CACHE_AWARE,
    "--selection-temperature": _CACHE_AWARE,
    "--bucket-adjust-interval-secs": _PD + " (the bucket policy)",
    "--block-size": _KV_EVENTS,
    "--cache-boundaries": _CACHE_AWARE,
    "--cache-index": _CACHE_AWARE,
    "--cache-ttl-secs": _CACHE_AWARE,
    "--max-buffered-request-bytes": "a separate bound on buffered requests (--max-body-bytes "
    "bounds every body)",
    "--pd-admission-wait-secs": _PD,
    "--sse-keepalive-secs": "SSE keep-alive frames",
    "--dp-aware": _DP,
    "--dp-minimum-tokens-scheduler": _DP,
    "--enable-igw": "multi-model (IGW) mode",
    "--pd-disaggregation": _PD,
    "--epd-disaggregation": _EPD,
    "--encode": _EPD,
    "--prefill": _PD,
    "--decode": _PD,
    "--prefill-max-inflight-requests-per-worker": _PD,
    "--prefill-queue-size": _PD,
    "--prefill-queue-timeout-secs": _PD,
    "--worker-startup-timeout-secs": _STARTUP,
    "--worker-startup-delay": _STARTUP,
    "--worker-startup-check-interval": _STARTUP,
    "--job-queue-capacity": "smg's control-plane job queue",
    "--job-queue-concurrency": "smg's control-plane job queue",
    "--disable-load-monitoring": _LOAD_MONITOR,
    "--multimodal-tensor-transport": _MULTIMODAL,
    "--multimodal-shm-min-bytes": _MULTIMODAL,
    "--multimodal-max-inflight-bytes": _MULTIMODAL,
    "--mm-per-request-image-limit": _MULTIMODAL,
    "--mm-processing": _MULTIMODAL,
    "--mm-pixel-cache-mb": _MULTIMODAL,
    "--mm-pixel-rdma": _MULTIMODAL,
    "--mm-allowed-media-domains": _MULTIMODAL,
    "--mm-allow-private-media-hosts": _MULTIMODAL,
    "--rdma-listen-ip": _MULTIMODAL,
    "--rdma-slot-ttl-s": _MULTIMODAL,
    "--log-mm-timing": _MULTIMODAL,
    "--log-dir": "log files (logs go to stderr)",
    "--log-json": "JSON logs",
    "--service-discovery": _DISCOVERY,
    "--discovery-provider": _DISCOVERY,
    "--discovery-file": _DISCOVERY,
    "--discovery-check-interval-secs": _DISCOVERY,
    "--selector": _DISCOVERY,
    "--service-discovery-port": _DISCOVERY,
    "--service-discovery-namespace": _DISCOVERY,
    "--kv-connector-annotation": _DISCOVERY,
    "--kv-engine-id-annotation": _DISCOVERY,
    "--encode-selector": _EPD,
    "--prefill-selector": _PD,
    "--decode-selector": _PD,
    "--router-selector": _MESH,
    "--model-id-from": _DISCOVERY,
    "--model-alias": "model aliases",
    "--prometheus-port": "a separate metrics port (GET /metrics is on --port)",
    "--prometheus-host": "a separate metrics port (GET /metrics is on --port)",
    "--prometheus-duration-buckets": "tunable metric buckets",
    "--jemalloc-prof-dir": "heap profiles",
    "--request-id-headers": "request-id headers",
    "--storage-context-headers": _STORAGE,
    "--shutdown-grace-period-secs": "a shutdown grace period",
    "--idle-connection-timeout-secs": "an idle keep-alive timeout",
    "--trust-tenant-header": _TENANTS,
    "--tenant-header-name": _TENANTS,
    "--cors-allowed-origins": "CORS",
    "--max-concurrent-requests": _ADMISSION,
    "--queue-size": _ADMISSION,
    "--queue-timeout-secs": _ADMISSION,
    "--rate-limit-tokens-per-second": _ADMISSION,
    "--max-background-responses": _STORAGE,
    "--priority-scheduler-enabled": "the priority scheduler",
    "--priority-scheduler-default-max-class": "the priority scheduler",
    "--priority-scheduler-config": "the priority scheduler",
    "--priority-scheduler-tenant-metric-top-n": "the priority scheduler",
    "--tenant-rate-limit-enabled": _TENANTS,
    "--tenant-rate-limit-config": _TENANTS,
    "--disable-health-check": "turning health checks off",
    "--remove-unhealthy-workers": _DISCOVERY,
    "--no-remove-unhealthy-workers": _DISCOVERY,
    "--worker-auto-recovery": _DISCOVERY,
    "--no-worker-auto-recovery": _DISCOVERY,
    "--disable-tokenizer-autoload": _TOKENIZER,
    "--parser": _PARSERS,
    "--tokenizer-cache-enable-l0": _TOKENIZER,
    "--tokenizer-cache-l0-max-entries": _TOKENIZER,
    "--tokenizer-cache-enable-l1": _TOKENIZER,
    "--tokenizer-cache-l0-max-memory": _TOKENIZER,
    "--tokenizer-cache-l1-max-memory": _TOKENIZER,
    "--reasoning-parser": _PARSERS,
    "--tool-call-parser": _PARSERS,
    "--mcp-config-path": _STORAGE,
    "--zmq-engine-count": "ZMQ and gRPC engines (sessiongate speaks HTTP)",
    "--enable-wasm": _STORAGE,
    "--storage-hook-wasm-path": _STORAGE,
    "--history-backend": _STORAGE,
    "--history-memory-max-responses": _STORAGE,
    "--history-memory-max-items": _STORAGE,
    "--history-memory-retention-secs": _STORAGE,
    "--oracle-wallet-path": _STORAGE + " (Oracle)",
    "--oracle-tns-alias": _STORAGE + " (Oracle)",
    "--oracle-connect-descriptor": _STORAGE + " (Oracle)",
    "--oracle-username": _STORAGE + " (Oracle)",
    "--oracle-password": _STORAGE + " (Oracle)",
    "--oracle-external-auth": _STORAGE + " (Oracle)",
    "--oracle-pool-min": _STORAGE + " (Oracle)",
    "--oracle-pool-max": _STORAGE + " (Oracle)",
    "--oracle-pool-timeout-secs": _STORAGE + " (Oracle)",
    "--postgres-db-url": _STORAGE + " (PostgreSQL)",
    "--postgres-pool-max": _STORAGE + " (PostgreSQL)",
    "--postgres-op-timeout-secs": _STORAGE + " (PostgreSQL)",
    "--redis-url": _STORAGE + " (Redis)",
    "--redis-pool-max": _STORAGE + " (Redis)",
    "--redis-retention-days": _STORAGE + " (Redis)",
    "--redis-op-timeout-secs": _STORAGE + " (Redis)",
    "--schema-config": _STORAGE,
    "--client-cert-path": "mTLS to engines",
    "--client-key-path": "mTLS to engines",
    "--ca-cert-paths": "custom CAs for engines",
    "--tls-cert-path": _TLS,
    "--tls-key-path": _TLS,
    "--enable-trace": _TRACING,
    "--otlp-traces-endpoint": _TRACING,
    "--tenant-api-key": _TENANTS,
    "--control-plane-audit-enabled": "control-plane audit logs",
    "--jwt-issuer": _AUTH,
    "--jwt-audience": _AUTH,
    "--jwt-jwks-uri": _AUTH,
    "--jwt-role-mapping": _AUTH,
    "--enable-mesh": _MESH,
    "--mesh-server-name": _MESH,
    "--mesh-host": _MESH,
    "--mesh-advertise-host": _MESH,
    "--mesh-port": _MESH,
    "--mesh-peer-urls": _MESH,
    "--mesh-tls-ca-cert": _MESH,
    "--mesh-tls-cert": _MESH,
    "--mesh-tls-key": _MESH,
}

# Values of served flags that sessiongate does not serve: (flag, value) -> why, and what to
# write. Deleting a row serves the value (once the flag's choices take it).
_RUNTIME = (
    "smg's --backend names the engine runtime; sessiongate's --backend is an engine URL "
    "(smg's --worker-urls)"
)
_POLICY = flag_of(EngineRoutingConfig, "policy")
_ASSIGNMENT = flag_of(EngineRoutingConfig, "assignment_mode")
_BACKEND = flag_of(EnginesConfig, "urls")
SMG_VALUES: dict[tuple[str, str], str] = {
    (_POLICY, "passthrough"): "give one --backend URL",
    (_ASSIGNMENT, "delegate"): "use random, min_load or min_group (--sticky-sessions always "
    "places a new key where the policy picks, as delegate does)",
    **{(_BACKEND, runtime): _RUNTIME for runtime in ("sglang", "vllm", "openai", "anthropic")},
    (_BACKEND, "tokenspeed"): _RUNTIME,
}

# smg serve spells every flag but these with a --router- prefix as well.
_UNPREFIXED = frozenset(
    {"--" + name for name in ("host", "port", "worker-urls", "router-disable-arg-fallback")}
)
_ROUTER = "--router-"


def refusal(argv: Sequence[str], declared: Collection[str]) -> str | None:
    """The message for the first smg flag (or smg value) in `argv` that sessiongate does not
    serve, or None. `declared`: the option strings the parser takes, never refused. Stops at
    `--`, reads `--flag=value` and `--flag value` alike."""
    for index, arg in enumerate(argv):
        if arg == "--":
            return None
        if not arg.startswith("--"):
            continue
        flag, eq, inline = arg.partition("=")
        if flag in declared:
            value = inline if eq else (argv[index + 1] if index + 1 < len(argv) else None)
            why = SMG_VALUES.get((flag, value)) if value is not None else None
            if why is not None:
                return f"{flag} {value} is smg's and not served by sessiongate: {why}"
            continue
        message = _flag_refusal(flag, declared)
        if message is not None:
            return message
    return None


def _flag_refusal(flag: str, declared: Collection[str]) -> str | None:
    if flag in SMG_RENAMED:
        return f"{flag} is smg's; sessiongate's equivalent is {SMG_RENAMED[flag]}"
    if flag in SMG_NOT_SERVED:
        return f"{flag} is smg's and not served by sessiongate: {SMG_NOT_SERVED[flag]}"
    # smg serve's --router-X (and --no-router-X) spell smg launch's --X (--no-X).
    for prefix, plain in ((_ROUTER, "--"), ("--no-router-", "--no-")):
        if not flag.startswith(prefix):
            continue
        base = plain + flag[len(prefix) :]
        if base in _UNPREFIXED or not _is_smg(base):
            return None
        if base in declared:
            return f"{flag} is smg serve's; sessiongate's equivalent is {base}"
        if base in SMG_RENAMED:
            return f"{flag} is smg serve's; sessiongate's equivalent is {SMG_RENAMED[base]}"
        return f"{flag} is smg serve's and not served by sessiongate: {SMG_NOT_SERVED[base]}"
    return None


def _is_smg(flag: str) -> bool:
    return flag in SMG_SERVED or flag in SMG_RENAMED or flag in SMG_NOT_SERVED
