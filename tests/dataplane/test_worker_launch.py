"""The configuration `serve` hands a worker (the launch document in its environment) gives
the core config serve validated: every option a core reads round-trips, each set to a
non-default value (so a forgotten one would show as the worker's default)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sessiongate.cli import build_parser
from sessiongate.config.gateway import SCHEMA_LEAVES, GatewayConfig, value_at
from sessiongate.config.launch import RouterLaunch, WorkerLaunch, launch_env, read_launch
from sessiongate.server.serve import serve_config, serve_core_config
from sessiongate.session.core_config import (
    STANDALONE,
    CoreConfig,
    core_config,
    supervised,
    worker_config,
)
from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR

WORKERS = 3
INDEX = 1
# Sections a session core reads; the others are serve's own (listen, front, workers).
CORE_SECTIONS = ("engines", "sessions", "session_routing", "limits", "records", "log_level", "rl")
# serve's own engine options, and serve's records shard count (set for the workers).
NOT_FORWARDED = {"engines.admin_key", "engines.mock_args", "records.shards"}


def serve_argv(tmp_path: Path) -> list[str]:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    return [
        "serve",
        "--workers",
        str(WORKERS),
        "--backend",
        "http://127.0.0.1:9",
        "--backend",
        "http://127.0.0.1:10",
        "--health-interval",
        "2.5",
        "--timeout",
        "30",
        "--tokenizer",
        str(BUILTIN_TOKENIZER_DIR),
        "--allowed-append-roles",
        "system,tool,user",
        "--max-trim-tokens",
        "3",
        "--max-rollback-steps",
        "5",
        "--reclaimed-ids",
        "7",
        "--reclaimed-ttl",
        "60",
        "--header-session-ttl",
        "60",
        "--session-routing",
        "dynamo_nvext",
        "--session-routing-opt",
        "timeout_seconds=60",
        "--log-level",
        "info",
        "--r3",
        "--r3-topk",
        "4",
        "--r3-addition",
        "--r3-missing",
        "warn",
        "--indexer-replay",
        "--indexer-topk",
        "8",
        "--lora-path",
        "adapter-7",
        "--message-matcher",
        "canonical",
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
        "--chat-template-path",
        str(template),
        "--tito-model",
        "nemotron3",
        "--sglang-version",
        "0.5.16",
        "--stream-upstream",
        "relay",
        "--no-smg-routing-key",
        "--session-mode",
        "tree",
        "--tree-pick-hook",
        "keep_all",
        "--tree-postprocess-hook",
        "none",
        # Engine routing: a worker's stateless proxy path picks engines with the same policy.
        "--policy",
        "cache_aware_gateway",
        "--cache-threshold",
        "0.5",
        "--balance-abs-threshold",
        "32",
        "--balance-rel-threshold",
        "2.0",
        "--eviction-interval-secs",
        "30",
        "--max-tree-size",
        "1000",
        "--assignment-mode",
        "min_load",
        "--max-idle-secs",
        "600",
        "--tie-break",
        "round_robin",
        "--policy-seed",
        "11",
        # smg 1.13's load-aware policies' tunables and the load poll.
        "--least-load-kv-pressure-weight",
        "0.3",
        "--least-load-default-throughput",
        "1000",
        "--least-load-mean-prefill-tokens",
        "512",
        "--least-load-max-waiting-requests",
        "9",
        "--power-of-two-load-metric",
        "requests",
        "--load-monitor-interval",
        "3",
        "--prefix-token-count",
        "128",
        "--prefix-hash-load-factor",
        "1.5",
        "--prefix-hash-balance-abs-threshold",
        "4",
        # smg 1.13's sticky keys and overload protection.
        "--sticky-sessions",
        "--routing-key-headers",
        "x-session",
        "--worker-overload-protection",
        "--worker-overload-waiting-requests",
        "5",
        "--worker-overload-token-usage",
        "0.9",
        "--no-hold-siblings",
        # The RL section: the pause limits are every pool's, the plane's flags the router's.
        "--enable-rl",
        "--rl-control-timeout-secs",
        "30",
        "--rl-fanout-concurrency",
        "4",
        "--engine-label",
        "pool=rollout",
        "--pause-queue-size",
        "16",
        "--pause-wait-secs",
        "12",
        "--newest-weights-only",
        # Engine reliability: workers retry and break circuits as the front does.
        "--health-failure-threshold",
        "4",
        "--health-success-threshold",
        "5",
        "--health-check-timeout-secs",
        "1.5",
        "--health-check-endpoint",
        "/ready",
        "--retry-max-retries",
        "7",
        "--retry-initial-backoff-ms",
        "20",
        "--retry-max-backoff-ms",
        "900",
        "--retry-backoff-multiplier",
        "2.5",
        "--retry-jitter-factor",
        "0.1",
        "--disable-retries",
        "--cb-failure-threshold",
        "6",
        "--cb-success-threshold",
        "4",
        "--cb-timeout-duration-secs",
        "9.5",
        "--cb-window-duration-secs",
        "30",
        "--disable-circuit-breaker",
        "--max-sessions",
        "7",
        "--max-records-bytes",
        "1G",
        "--warm-records-bytes",
        "256M",
        "--session-ttl",
        "90",
        "--records-dir",
        str(tmp_path / "records"),
        "--records-durability",
        "fsync",
        "--records-memory",
        "64M",
    ]


def forwarded(tmp_path: Path) -> tuple[GatewayConfig, CoreConfig, GatewayConfig]:
    config = serve_config(build_parser().parse_args(serve_argv(tmp_path)))
    core = serve_core_config(config)
    return config, core, worker_config(config, core.engine_urls, local_workers=WORKERS)


def launched(
    launch: WorkerLaunch | RouterLaunch, monkeypatch: pytest.MonkeyPatch
) -> WorkerLaunch | RouterLaunch:
    """What the child reads back from its environment."""
    for name, value in launch_env(launch).items():
        monkeypatch.setenv(name, value)
    found: WorkerLaunch | RouterLaunch = read_launch(type(launch))
    return found


def without_role(config: CoreConfig) -> CoreConfig:
    """The config less what only the role decides (label, records shard and directory)."""
    assert config.store is not None
    return dataclasses.replace(
        config,
        settings=dataclasses.replace(config.settings, label=""),
        store=dataclasses.replace(config.store, directory=Path(), shard=None),
    )


def test_every_forwarded_option_is_set_to_a_non_default_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, for_workers = forwarded(tmp_path)
    launch = launched(WorkerLaunch(for_workers, fd=0, index=INDEX), monkeypatch)
    baseline = GatewayConfig()
    for leaf in SCHEMA_LEAVES:
        if leaf.path[0] in CORE_SECTIONS and leaf.key not in NOT_FORWARDED:
            assert value_at(launch.config, leaf) != value_at(baseline, leaf), leaf.key


def test_a_local_worker_gets_serves_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, core, for_workers = forwarded(tmp_path)
    launch = launched(WorkerLaunch(for_workers, fd=0, index=INDEX), monkeypatch)
    got = core_config(launch.config, supervised(INDEX), program="sessiongate serve")
    assert without_role(got) == without_role(core)
    assert got.settings.label == f"worker {INDEX}"
    assert got.store is not None and core.store is not None
    assert got.store.directory == core.store.directory.parent / f"worker-{INDEX}"
    assert got.store.shard == f"{INDEX}/{WORKERS}"
    assert launch.config.log_level == config.log_level == "info"


def test_a_ray_worker_gets_serves_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray actors run a TCP worker (no descriptor) with the same configuration."""
    config, core, _ = forwarded(tmp_path)
    for_ray = worker_config(config, core.engine_urls, local_workers=WORKERS, placed_elsewhere=True)
    launch = launched(WorkerLaunch(for_ray, fd=None, index=INDEX), monkeypatch)
    assert launch.fd is None
    got = core_config(launch.config, STANDALONE, program="sessiongate worker")
    assert without_role(got) == without_role(core)
    assert got.settings.label == "this worker"
    assert got.store is not None and got.store.shard is None  # it owns the directory


def test_serve_validates_before_forwarding(tmp_path: Path) -> None:
    argv = serve_argv(tmp_path)
    argv[argv.index("--max-trim-tokens") + 1] = "-1"
    with pytest.raises(SystemExit, match="--max-trim-tokens must be >= 0"):
        serve_core_config(serve_config(build_parser().parse_args(argv)))


def test_the_routers_front_gets_serves_reliability_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled front in the router retries and breaks circuits as serve was told."""
    from sessiongate.front.compiled import front_options

    config, _, _ = forwarded(tmp_path)
    launch = launched(RouterLaunch(config, port=1, control_fd=4, worker_fds=(3,)), monkeypatch)
    assert isinstance(launch, RouterLaunch) and launch.worker_fds == (3,)
    want = config.engines.reliability
    assert want.disable_retries and want.retry_max_retries == 7
    options = front_options(launch.config, ["http://127.0.0.1:9"], [1.0])
    assert options is not None
    assert options.reliability == want and options.health_path == "/ready"
    assert options.engine_routing == config.engines.routing
