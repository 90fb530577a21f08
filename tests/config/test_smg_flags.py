"""smg's flags on `serve`'s command line (config/smg_flags.py, docs/smg-flags.md): the ones
serve takes parse, the renamed and the not-served ones exit 2 at parsing with one line naming
them, and a flag smg never had keeps argparse's own error. No process starts: these parse."""

from __future__ import annotations

import argparse

import pytest

from sessiongate.cli import build_parser
from sessiongate.config.cli import config_from_args
from sessiongate.config.smg_flags import (
    SMG_NOT_SERVED,
    SMG_RENAMED,
    SMG_SERVED,
    SMG_VALUES,
    refusal,
)


def serve_flags() -> set[str]:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(commands.choices["serve"]._option_string_actions)


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """serve's one-line error for `argv` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("sessiongate serve: error: ")
    return err.strip()


def test_the_table_agrees_with_serves_parser() -> None:
    declared = serve_flags()
    assert set(SMG_SERVED) <= declared
    # A row for a flag serve now takes is stale: serving it is deleting its row.
    assert not (set(SMG_RENAMED) | set(SMG_NOT_SERVED)) & declared
    assert not set(SMG_RENAMED) & set(SMG_NOT_SERVED)
    assert not set(SMG_SERVED) & (set(SMG_RENAMED) | set(SMG_NOT_SERVED))
    assert {flag for flag, _ in SMG_VALUES} <= set(SMG_SERVED)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--worker-urls", "http://a:1", "http://b:1"], "--worker-urls is smg's; sessiongate's "
         "equivalent is --backend URL, once per engine"),
        (["--worker-urls=http://a:1"], "--worker-urls is smg's; sessiongate's equivalent is "
         "--backend URL"),
        (["--request-timeout-secs", "30"], "equivalent is --timeout SECONDS"),
        (["--health-check-interval-secs=10"], "equivalent is --health-interval SECONDS"),
        (["--max-payload-size", "1024"], "equivalent is --max-body-bytes BYTES"),
        # Was an ambiguous prefix of --chat-template-kwargs and --chat-template-path.
        (["--chat-template", "t.jinja"], "equivalent is --chat-template-path FILE"),
        # smg serve's --router- spellings.
        (["--router-policy", "round_robin"], "--router-policy is smg serve's; sessiongate's "
         "equivalent is --policy"),
        (["--router-request-timeout-secs=5"], "equivalent is --timeout SECONDS"),
    ],
)  # fmt: skip
def test_renamed_flags_name_sessiongates_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert expected in refused(capsys, "--port", "9000", *argv)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--pd-disaggregation"], "--pd-disaggregation is smg's and not served by sessiongate: "
         "prefill-decode disaggregation"),
        (["--prefill", "http://p:1", "9000"], "prefill-decode disaggregation"),
        (["--disable-load-monitoring"], "not served by sessiongate: smg's load monitor"),
        (["--worker-overload-shed"], "shedding when every engine is overloaded"),
        (["--redis-url", "redis://r:6379"], "(Redis)"),
        (["--enable-mesh"], "the HA mesh"),
        (["--router-enable-trace"], "--router-enable-trace is smg serve's and not served by "
         "sessiongate: tracing"),
        (["--no-worker-auto-recovery"], "service discovery"),
        (["--policy", "passthrough"], "--policy passthrough is smg's and not served by "
         "sessiongate: give one --backend URL"),
        (["--backend", "sglang"], "sessiongate's --backend is an engine URL"),
        (["--assignment-mode", "delegate"], "--assignment-mode delegate is smg's"),
    ],
)  # fmt: skip
def test_not_served_flags_and_values_say_so(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert expected in refused(capsys, *argv)


def test_served_smg_flags_still_parse() -> None:
    args = build_parser().parse_args(
        [
            "serve", "--host", "0.0.0.0", "--port", "30000", "--backend", "http://e:1",
            "--policy", "cache_aware", "--cache-match-threshold", "0.5",
            "--spill-abs-threshold", "8", "--spill-rel-threshold=2.0",
            "--eviction-interval", "30", "--max-tree-size", "1000",
            "--retry-max-retries", "3", "--cb-failure-threshold", "4",
            "--health-check-timeout-secs", "2", "--enable-rl", "--rl-fanout-concurrency", "8",
            "--log-level", "info", "--api-key", "k", "--sticky-sessions",
            "--routing-key-headers", "X-Session", "x-b", "--routing-key-headers", "x-c",
            "--sticky-key-idle-secs", "600",
        ]
    )  # fmt: skip
    config = config_from_args(args, "serve")
    routing = config.engines.routing
    assert (routing.cache_threshold, routing.balance_abs_threshold) == (0.5, 8)
    assert (routing.balance_rel_threshold, routing.eviction_interval_secs) == (2.0, 30)
    assert config.engines.reliability.retry_max_retries == 3
    assert config.engines.urls == ("http://e:1",)
    assert config.rl.enable_rl and config.rl.fanout_concurrency == 8
    # smg's sticky sessions: the first use of the list replaces the default, later ones add.
    assert routing.sticky_sessions and routing.max_idle_secs == 600
    assert routing.routing_key_headers == ("X-Session", "x-b", "x-c")


def test_smgs_overload_flags_and_the_disable_spelling() -> None:
    on = "--worker-overload-protection", "--worker-overload-waiting-requests", "4"
    args = build_parser().parse_args(["serve", *on, "--worker-overload-token-usage", "0.9"])
    routing = config_from_args(args, "serve").engines.routing
    assert routing.worker_overload_protection and routing.reads_loads
    assert (routing.worker_overload_waiting_requests, routing.worker_overload_token_usage) == (
        4,
        0.9,
    )
    off = build_parser().parse_args(["serve", *on, "--disable-worker-overload-protection"])
    assert not config_from_args(off, "serve").engines.routing.worker_overload_protection


def test_a_flag_smg_never_had_keeps_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--polcy", "manual"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --polcy manual" in capsys.readouterr().err


def test_refusal_reads_only_flags_before_the_double_dash_and_spares_declared_ones() -> None:
    assert refusal(["--", "--worker-urls"], set()) is None
    assert refusal(["--sticky-sessions"], {"--sticky-sessions"}) is None
    assert refusal(["--router-polcy"], set()) is None
    assert refusal(["--api-key", "sglang"], {"--api-key"}) is None
    assert refusal(["--backend"], {"--backend"}) is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--routing-key-headers", "x session"], '"x session" is not an HTTP header name'),
        (["--routing-key-headers", "x-a", "x:b"], '"x:b" is not an HTTP header name'),
        (["--worker-overload-waiting-requests", "0"], "must be >= 1, got 0"),
        (["--worker-overload-token-usage", "1.5"], "must be in (0, 1], got 1.5"),
        (["--worker-overload-token-usage", "0"], "must be in (0, 1], got 0.0"),
    ],
)  # fmt: skip
def test_bad_sticky_and_overload_values_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        config_from_args(build_parser().parse_args(["serve", *argv]), "serve")
    assert expected in str(exit_.value)
