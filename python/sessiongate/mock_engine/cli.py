"""`sessiongate mock-engine`: run the mock engine under uvicorn until signalled or orphaned."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from typing import Any

from sessiongate.front.http_server import QuietServer, serve_until_exit, uvicorn_config
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.process.children import die_with_parent

# The R3 shape of the mock `serve --r3` embeds when its --mock-args shape none.
EMBEDDED_R3 = ("--r3-layers", "4", "--r3-topk", "2")


def embedded_argv(
    port: int,
    tokenizer: str | None,
    r3: bool,
    extra: str,
    *,
    sglang_version: str | None = None,
) -> list[str]:
    """The command line of the mock engine `serve` embeds (`--backend mock`): on `port`,
    with `tokenizer`, R3 on when `r3` (EMBEDDED_R3 unless `extra` shapes it), standing in
    for `sglang_version` when serve was given one, then `extra` (serve's --mock-args)."""
    given = shlex.split(extra)
    argv = ["mock-engine", "--host", "127.0.0.1", "--port", str(port)]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if sglang_version is not None:
        argv += ["--sglang-version", sglang_version]
    return [*argv, *embedded_r3(r3, extra), *given]


def embedded_r3(r3: bool, extra: str) -> list[str]:
    """The R3 arguments serve adds to the embedded mock's command line."""
    return [] if not r3 or EMBEDDED_R3[0] in shlex.split(extra) else list(EMBEDDED_R3)


def embedded_r3_topk(r3: bool, extra: str) -> int | None:
    """The embedded mock's R3 top-k (None without R3 or when its arguments do not say)."""
    if not r3:
        return None
    argv = [*embedded_r3(r3, extra), *shlex.split(extra)]
    value = None
    flag = EMBEDDED_R3[2]
    # As argparse reads it: the last `--r3-topk V` or `--r3-topk=V`.
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return int(value) if value is not None and value.isdigit() else None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `mock-engine` subcommand on the top-level CLI."""
    d = MockEngineConfig()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "mock-engine",
        help="run a deterministic SGLang-style chat engine (no GPU) for tests and benchmarks",
        description="Deterministic HTTP engine speaking SGLang 0.5.23's OpenAI chat "
        "contract (input_ids, meta_info, sglext, routed_experts), its native /generate, and "
        "its control routes (/pause_generation, /continue_generation, /ready, "
        "/health_generate, /update_weights_from_disk, /update_weight_version, "
        "/abort_request). See docs/mock-engine.md.",
    )
    # One flat option list (no argparse groups): the helpers keep --help's order.
    _add_server_arguments(p, d)
    _add_completion_pacing_arguments(p, d)
    _add_fault_arguments(p, d)
    _add_reply_feature_arguments(p, d)
    _add_step_scheduler_arguments(p, d)
    _add_control_arguments(p, d)
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.set_defaults(run=run)
    return p


def _add_server_arguments(p: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """Address, seed, tokenizer and served model name."""
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--seed", type=int, default=d.seed, help="engine seed (default %(default)s)")
    p.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        metavar="PATH",
        help="HF tokenizer dir (default: built-in ChatML tokenizer)",
    )
    p.add_argument("--model-name", default=d.model_name)


def _add_completion_pacing_arguments(p: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """Completion lengths and the ttft + per-token delays of the sleep pacing."""
    p.add_argument(
        "--completion-tokens",
        type=int,
        default=d.completion_tokens,
        metavar="N",
        help="natural completion length incl. end token (default %(default)s)",
    )
    p.add_argument(
        "--completion-tokens-jitter",
        type=int,
        default=d.completion_tokens_jitter,
        metavar="J",
        help="lengths vary in [N-J, N+J] (default %(default)s)",
    )
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms, help="delay before first token")
    p.add_argument(
        "--token-delay-ms", type=float, default=d.token_delay_ms, help="delay per generated token"
    )


def _add_fault_arguments(p: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """Injected failures of chat requests."""
    p.add_argument(
        "--fail-rate",
        type=float,
        default=d.fail_rate,
        help="fraction of chat requests answered with --fail-status",
    )
    p.add_argument("--fail-status", type=int, default=d.fail_status)


def _add_reply_feature_arguments(p: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """The SGLang features a reply carries: routed experts, tool calls, stream steps, weight
    version, LoRA, parsers, indexer top-k and cached-token reports."""
    p.add_argument("--r3-layers", type=int, default=d.r3_layers, help="0 = no routed_experts")
    p.add_argument("--r3-topk", type=int, default=d.r3_topk)
    p.add_argument("--r3-experts", type=int, default=d.r3_experts)
    p.add_argument(
        "--tool-call-rate",
        type=float,
        default=d.tool_call_rate,
        help="probability of a tool call when the request has tools",
    )
    p.add_argument(
        "--stream-chunk-tokens",
        type=int,
        default=d.stream_chunk_tokens,
        help="tokens per engine step of a stream, SGLang's --stream-interval (default %(default)s)",
    )
    p.add_argument(
        "--weight-version",
        default=d.weight_version,
        help="initial weight version (SGLang's default is %(default)r)",
    )
    p.add_argument(
        "--sglang-version",
        default=d.sglang_version,
        metavar="VERSION",
        help="the SGLang release the mock stands in for: reported as `version` by "
        "/server_info and /v1/loads, and whose tool dump and message shaping render chat "
        "prompts (default %(default)s; docs/tokenizer.md, SGLang version rules)",
    )
    p.add_argument(
        "--lora-adapters",
        default="",
        metavar="NAME,...",
        help="loaded LoRA adapter names; without it LoRA is off and lora_path is rejected",
    )
    p.add_argument(
        "--reasoning-parser",
        default=d.reasoning_parser,
        metavar="NAME",
        help="open completions with a <think> block parsed into reasoning_content",
    )
    p.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        metavar="NAME",
        help="emulate an engine with a tool-call parser (stream steps keep their logprobs)",
    )
    p.add_argument(
        "--non-ascii",
        action="store_true",
        help="completions mix in non-ASCII words (characters split over tokens)",
    )
    p.add_argument("--indexer-layers", type=int, default=d.indexer_layers, help="0 = off")
    p.add_argument("--indexer-topk", type=int, default=d.indexer_topk)
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (as SGLang's flag)",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=d.prefix_cache_tokens,
        help="token budget of the prefix cache behind cached_tokens (0 = off)",
    )


def _add_step_scheduler_arguments(p: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """The step scheduler (prefill and decode steps) instead of per-request sleeps."""
    p.add_argument(
        "--step-scheduler",
        action="store_true",
        help="serve every request through one step scheduler (prefill and decode steps)",
    )
    p.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=d.prefill_us_per_token,
        help="step scheduler: prefill time per uncached prompt token (default %(default)s)",
    )
    p.add_argument(
        "--decode-step-ms",
        type=float,
        default=d.decode_step_ms,
        help="step scheduler: time of one decode step of the running batch (default %(default)s)",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=d.speed,
        help="step scheduler: speed factor, 0.5 = every step takes twice as long",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=d.max_running_requests,
        help="step scheduler: running batch size; more requests wait (default %(default)s)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d.max_prefill_tokens,
        help="step scheduler: uncached prompt tokens one prefill step admits, as SGLang's "
        "flag (the first request of a step always; default %(default)s)",
    )


def _add_control_arguments(p: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """The control routes: health probe timeout, weight updates that fail."""
    p.add_argument(
        "--health-check-timeout",
        type=float,
        default=d.health_check_timeout,
        metavar="SECONDS",
        help="how long GET /health_generate waits (e.g. on a paused engine) before its 503, "
        "SGLang's SGLANG_HEALTH_CHECK_TIMEOUT (default %(default)s)",
    )
    p.add_argument(
        "--reject-model-path",
        action="append",
        default=[],
        metavar="PATH",
        help="POST /update_weights_from_disk fails to load this model_path (repeatable)",
    )


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    return MockEngineConfig(
        host=args.host,
        port=args.port,
        seed=args.seed,
        tokenizer=args.tokenizer,
        model_name=args.model_name,
        completion_tokens=args.completion_tokens,
        completion_tokens_jitter=args.completion_tokens_jitter,
        ttft_ms=args.ttft_ms,
        token_delay_ms=args.token_delay_ms,
        fail_rate=args.fail_rate,
        fail_status=args.fail_status,
        r3_layers=args.r3_layers,
        r3_topk=args.r3_topk,
        r3_experts=args.r3_experts,
        tool_call_rate=args.tool_call_rate,
        stream_chunk_tokens=args.stream_chunk_tokens,
        log_level=args.log_level,
        weight_version=args.weight_version,
        sglang_version=args.sglang_version,
        lora_adapters=tuple(n.strip() for n in args.lora_adapters.split(",") if n.strip()),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        non_ascii=args.non_ascii,
        indexer_layers=args.indexer_layers,
        indexer_topk=args.indexer_topk,
        enable_cache_report=args.enable_cache_report,
        prefix_cache_tokens=args.prefix_cache_tokens,
        step_scheduler=args.step_scheduler,
        prefill_us_per_token=args.prefill_us_per_token,
        decode_step_ms=args.decode_step_ms,
        speed=args.speed,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        health_check_timeout=args.health_check_timeout,
        reject_model_paths=tuple(args.reject_model_path),
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"sessiongate mock-engine: {exc}", file=sys.stderr)
        return 2
    if not die_with_parent():
        return 0

    from sessiongate.mock_engine.app import create_app

    app = create_app(config)
    closing: asyncio.Event = app.state.engine.closing
    server = QuietServer(uvicorn_config(app, config.host, config.port, config.log_level))

    async def main() -> int:
        loop = asyncio.get_running_loop()
        # Cut pending delays short so a graceful shutdown does not wait for slow streams.
        server.on_exit = lambda: loop.call_soon_threadsafe(closing.set)
        return await serve_until_exit(
            server,
            default_port=config.port,
            on_started=lambda port: print(
                f"mock-engine listening on http://{config.host}:{port}", flush=True
            ),
        )

    return asyncio.run(main())
