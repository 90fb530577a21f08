"""The argv `serve` starts a worker with, parsed by the worker's own options, gives the core
config serve validated: every forwarded option round-trips, each set to a non-default value
(so a forgotten forward would show as the worker's default)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from sessiongate.cli import build_parser
from sessiongate.server.serve import serve_core_config, worker_arguments
from sessiongate.session.core_config import STANDALONE, CoreConfig, core_config, supervised
from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR

WORKERS = 3
INDEX = 1
# Not session options: how the supervisor reaches the worker, and serve's own shard count.
NOT_FORWARDED = {"fd", "index", "generation", "records_shards", "run", "command", "version"}


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
        "qwen3",
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
        "--session-ttl",
        "90",
        "--records-dir",
        str(tmp_path / "records"),
        "--records-durability",
        "fsync",
        "--records-memory",
        "64M",
    ]


def defaults(command: str, *required: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *required])


def forwarded(tmp_path: Path) -> tuple[argparse.Namespace, CoreConfig, list[str]]:
    args = build_parser().parse_args(serve_argv(tmp_path))
    config = serve_core_config(args)
    return args, config, worker_arguments(args, config.backends)


def without_role(config: CoreConfig) -> CoreConfig:
    """The config less what only the role decides (label, records shard and directory)."""
    assert config.store is not None
    return dataclasses.replace(
        config,
        settings=dataclasses.replace(config.settings, label=""),
        store=dataclasses.replace(config.store, directory=Path(), shard=None),
    )


def test_every_forwarded_option_is_set_to_a_non_default_value(tmp_path: Path) -> None:
    _, _, argv = forwarded(tmp_path)
    worker = build_parser().parse_args(["_worker", "--fd", "0", "--index", "1", *argv])
    baseline = defaults("_worker", "--fd", "0", "--index", "1", "--backend", "http://x")
    for name, value in vars(worker).items():
        if name not in NOT_FORWARDED:
            assert value != getattr(baseline, name), name


def test_a_local_worker_gets_serves_config(tmp_path: Path) -> None:
    args, config, argv = forwarded(tmp_path)
    worker = build_parser().parse_args(["_worker", "--fd", "0", "--index", str(INDEX), *argv])
    got = core_config(worker, supervised(INDEX), program="sessiongate serve")
    assert without_role(got) == without_role(config)
    assert got.settings.label == f"worker {INDEX}"
    assert got.store is not None and config.store is not None
    assert got.store.directory == config.store.directory.parent / f"worker-{INDEX}"
    assert got.store.shard == f"{INDEX}/{WORKERS}"
    assert worker.log_level == args.log_level == "info"


def test_a_ray_worker_gets_serves_config(tmp_path: Path) -> None:
    """Ray actors run `sessiongate worker` with the same argv (and their own address)."""
    args, config, _ = forwarded(tmp_path)
    args.ray = True
    argv = worker_arguments(args, config.backends)
    worker = build_parser().parse_args(
        ["worker", "--listen", "127.0.0.1:0", "--secret-env", "S", *argv]
    )
    got = core_config(worker, STANDALONE, program="sessiongate worker")
    assert without_role(got) == without_role(config)
    assert got.settings.label == "this worker"
    assert got.store is not None and got.store.shard is None  # it owns the directory


def test_serve_validates_before_forwarding(tmp_path: Path) -> None:
    argv = serve_argv(tmp_path)
    argv[argv.index("--max-trim-tokens") + 1] = "-1"
    with pytest.raises(SystemExit, match="--max-trim-tokens must be >= 0"):
        serve_core_config(build_parser().parse_args(argv))


def test_the_routers_front_gets_serves_reliability_options(tmp_path: Path) -> None:
    """The compiled front in the router retries and breaks circuits as serve was told."""
    from sessiongate.engines.routing_options import engine_routing_argv, reliability_settings
    from sessiongate.front.compiled import front_options

    args, _, _ = forwarded(tmp_path)
    plumbing = ["--port", "1", "--worker-fds", "3", "--control-fd", "4", "--max-body-bytes", "1"]
    router = build_parser().parse_args(
        ["_router", *plumbing, "--backend", "http://127.0.0.1:9", *engine_routing_argv(args)]
    )
    want = reliability_settings(args)
    assert want.disable_retries and want.retry_max_retries == 7
    options = front_options(router, ["http://127.0.0.1:9"], [1.0])
    assert options is not None
    assert options.reliability == want and options.health_path == "/ready"
