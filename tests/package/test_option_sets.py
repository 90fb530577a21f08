"""The option sets of `serve` and `worker`: every flag, its default and whether it is
required, as they were before the options got one typed configuration (plus `--config` and
`--print-config`, which it brought). Moving where an option is declared must not add, drop
or change one of them. The internal `_worker` and `_router` take no flags: serve hands them
the resolved configuration whole (tests/dataplane/test_worker_launch.py)."""

from __future__ import annotations

import argparse

import pytest

from sessiongate.cli import build_parser

# Flag -> (default, required). The session options every process that runs a core accepts.
SESSION_CORE_OPTIONS: dict[str, tuple[object, bool]] = {
    "--health-interval": (5.0, False),
    "--tokenizer": (None, False),
    "--timeout": (600.0, False),
    "--allowed-append-roles": (None, False),
    "--max-trim-tokens": (None, False),
    "--max-rollback-steps": (64, False),
    "--reclaimed-ids": (4096, False),
    "--reclaimed-ttl": (3600.0, False),
    "--header-session-ttl": (3600.0, False),
    "--session-routing": (None, False),
    "--session-routing-opt": ([], False),
    "--log-level": ("warning", False),
    "--r3": (False, False),
    "--r3-topk": (0, False),
    "--r3-addition": (False, False),
    "--r3-missing": ("error", False),
    "--indexer-replay": (False, False),
    "--indexer-topk": (0, False),
    "--lora-path": (None, False),
    "--message-matcher": ("strict", False),
    "--chat-template-kwargs": (None, False),
    "--chat-template-path": (None, False),
    "--sglang-version": ("auto", False),
    "--tito-model": (None, False),
    "--stream-upstream": ("buffered", False),
    "--no-smg-routing-key": (True, False),
    "--session-mode": ("linear", False),
    "--tree-pick-hook": ("drop_retries", False),
    "--tree-postprocess-hook": ("default_postprocess", False),
    "--max-sessions": (10000, False),
    "--max-records-bytes": ("auto", False),
    "--warm-records-bytes": ("1G", False),
    "--session-ttl": (0.0, False),
    "--records-dir": (None, False),
    "--records-durability": (None, False),
    "--records-memory": (None, False),
    "--records-shards": (0, False),
}
# Engine routing (--policy and the SGLang Model Gateway's tunables), added after the session
# options got one home: every process that runs a core (its stateless proxy path) takes them.
ENGINE_ROUTING_OPTIONS: dict[str, tuple[object, bool]] = {
    "--policy": ("cache_aware", False),
    "--cache-threshold/--cache-match-threshold": (0.3, False),
    "--balance-abs-threshold/--spill-abs-threshold": (64, False),
    "--balance-rel-threshold/--spill-rel-threshold": (1.5, False),
    "--eviction-interval-secs/--eviction-interval": (60, False),
    "--max-tree-size": (67108864, False),
    "--assignment-mode": ("random", False),
    "--max-idle-secs/--sticky-key-idle-secs": (14400, False),
    "--tie-break": ("index", False),
    "--policy-seed": (None, False),
    # smg 1.13's load-aware policies (least_load, power_of_two's expected wait, prefix_hash).
    "--least-load-kv-pressure-weight": (0.15, False),
    "--least-load-default-throughput": (2000.0, False),
    "--least-load-mean-prefill-tokens": (1024, False),
    "--least-load-max-waiting-requests": (0, False),
    "--power-of-two-load-metric": ("expected_wait", False),
    "--load-monitor-interval": (10, False),
    "--prefix-token-count": (256, False),
    "--prefix-hash-load-factor": (1.25, False),
    "--prefix-hash-balance-abs-threshold": (10, False),
    # smg 1.13's sticky keys and overload protection (every policy's).
    "--sticky-sessions/--routing-key-override": (False, False),
    "--routing-key-headers": (["x-smg-routing-key"], False),
    "--worker-overload-protection": (False, False),
    "--disable-worker-overload-protection": ("==SUPPRESS==", False),
    "--worker-overload-waiting-requests": (8, False),
    "--worker-overload-token-usage": (0.8, False),
    # Siblings of one prompt on one engine wait for one warm-up (every policy's).
    "--hold-siblings": (True, False),
    "--no-hold-siblings": ("==SUPPRESS==", False),
}
# Engine reliability (health thresholds, retries, circuit breaker), with the SGLang Model
# Gateway's names and defaults: declared with engine routing, so the same processes take them.
RELIABILITY_OPTIONS: dict[str, tuple[object, bool]] = {
    "--health-failure-threshold": (3, False),
    "--health-success-threshold": (2, False),
    "--health-check-timeout-secs": (5.0, False),
    "--health-check-endpoint": ("/health", False),
    "--retry-max-retries": (5, False),
    "--retry-initial-backoff-ms": (50, False),
    "--retry-max-backoff-ms": (30000, False),
    "--retry-backoff-multiplier": (1.5, False),
    "--retry-jitter-factor": (0.2, False),
    "--disable-retries": (False, False),
    "--cb-failure-threshold": (10, False),
    "--cb-success-threshold": (3, False),
    "--cb-timeout-duration-secs": (60.0, False),
    "--cb-window-duration-secs": (120.0, False),
    "--disable-circuit-breaker": (False, False),
}
SESSION_CORE_OPTIONS.update(ENGINE_ROUTING_OPTIONS)
SESSION_CORE_OPTIONS.update(RELIABILITY_OPTIONS)

# The configuration file and the effective configuration (config/cli.py).
CONFIG_FILE_OPTIONS: dict[str, tuple[object, bool]] = {
    "--config": (None, False),
    "--print-config": (False, False),
}
SESSION_CORE_OPTIONS.update(CONFIG_FILE_OPTIONS)

# Requests held while their engines are paused (engines/hold.py): every process with a pool.
PAUSE_OPTIONS: dict[str, tuple[object, bool]] = {
    "--pause-queue-size": (4096, False),
    "--pause-wait-secs": (600.0, False),
    "--newest-weights-only": (False, False),
}
SESSION_CORE_OPTIONS.update(PAUSE_OPTIONS)

EXPECTED: dict[str, dict[str, tuple[object, bool]]] = {
    "serve": {
        **SESSION_CORE_OPTIONS,
        # serve's --backend defaults to the embedded mock engine (None = "mock").
        "--backend": (None, False),
        "--host": ("127.0.0.1", False),
        "--port": (8000, False),
        "--max-body-bytes": (268435456, False),
        "--header-timeout": (10.0, False),
        "--body-timeout": (30.0, False),
        "--api-key": (None, False),
        # The engine management routes' key (engines/options.py).
        "--admin-key": (None, False),
        "--session-header": (None, False),
        "--mock-args": ("", False),
        "--workers": (None, False),
        "--on-worker-exit": ("restart", False),
        "--worker-endpoints": (None, False),
        "--secret-file": (None, False),
        "--tls-ca": (None, False),
        "--tls-insecure": (False, False),
        "--tls-server-name": (None, False),
        "--worker-heartbeat-timeout": (10.0, False),
        "--no-shared-memory-replies": (True, False),
        # Added with the lent replies (docs/ipc.md, "Lent connections").
        "--no-lent-replies": (True, False),
        "--ray": (False, False),
        "--ray-address": (None, False),
        "--worker-num-cpus": (1.0, False),
        "--front": ("auto", False),
        "--front-threads": (None, False),
        # smg's RL control plane (config/rl.py): where the engine registry is.
        "--enable-rl": (False, False),
        "--rl-control-timeout-secs": (600, False),
        "--rl-fanout-concurrency": (32, False),
        "--engine-label": ([], False),
    },
    "worker": {
        **SESSION_CORE_OPTIONS,
        "--backend": (None, True),
        "--listen": (None, True),
        "--secret-file": (None, False),
        "--secret-env": (None, False),
        "--tls-cert": (None, False),
        "--tls-key": (None, False),
        "--handshake-timeout": (10.0, False),
    },
    "_worker": {},
    "_router": {},
}


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = commands.choices[name]
    return found


def option_set(parser: argparse.ArgumentParser) -> dict[str, tuple[object, bool]]:
    return {
        "/".join(action.option_strings): (action.default, action.required)
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
    }


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_option_set_is_unchanged(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SESSIONGATE_API_KEY", raising=False)  # serve's --api-key default
    monkeypatch.delenv("SESSIONGATE_ADMIN_KEY", raising=False)  # and --admin-key's
    parser = subcommand(name)
    assert option_set(parser) == EXPECTED[name]
    shown = parser.format_help()
    for flags in EXPECTED[name]:
        if flags != "--records-shards":  # internal: serve -> its workers, not in --help
            for flag in flags.split("/"):
                assert flag in shown, flag
