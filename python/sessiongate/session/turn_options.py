"""Command-line options of a session turn's upstream contract (R3, indexer, LoRA, matcher,
template variables, streaming, routing key), shared by `serve`, the worker processes and
`sessiongate worker`: declared once, validated once, forwarded to workers as argv.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from sessiongate.session.settings import DEFAULT_APPEND_ROLES
from sessiongate.session.tito_families import TitoFamily, resolve_tito_family

STREAM_UPSTREAM_CHOICES = ("buffered", "relay")
R3_MISSING_CHOICES = ("error", "warn")


def add_turn_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("session turn contract")
    group.add_argument("--r3", action="store_true", help="ask the upstream for routed experts")
    group.add_argument(
        "--r3-topk",
        type=int,
        default=0,
        help="with --r3: experts per token per layer, which shapes routed experts as "
        "[tokens, layers, topk] in samples and trajectory files (default: learned from "
        "config.json in the --tokenizer checkpoint directory; without one --r3 refuses to "
        "start)",
    )
    group.add_argument(
        "--r3-addition",
        action="store_true",
        help="with --r3: ask only for the routed-experts rows a session does not hold yet "
        "(routed_experts_start_len, the rollout framework's addition R3); records keep the "
        "patches, trajectories and samples are the same as with full R3",
    )
    group.add_argument(
        "--r3-missing",
        choices=R3_MISSING_CHOICES,
        default="error",
        help="with --r3, a reply without routed_experts is a 502 (error, the default) or is "
        "recorded and counted in /health (warn)",
    )
    group.add_argument(
        "--indexer-replay",
        action="store_true",
        help="ask the upstream for the sparse-attention indexer's top-k (return_indexer_topk)",
    )
    group.add_argument(
        "--indexer-topk",
        type=int,
        default=0,
        help="indexer top-k per token per layer: shapes rollout_indexer_topk as "
        "[tokens, layers, topk] in samples (0: [tokens, layers*topk])",
    )
    group.add_argument(
        "--lora-path",
        default=None,
        metavar="ADAPTER",
        help="serve every session turn with this LoRA adapter (sets lora_path; default: "
        "the client's own lora_path, if any, passes through)",
    )
    group.add_argument(
        "--message-matcher",
        default="strict",
        metavar="NAME",
        help="how a request's messages are matched against the stored history: strict "
        "(default), or the looser matchers listed in docs/tokenizer.md",
    )
    group.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="server-wide chat template variables, e.g. '{\"enable_thinking\": false}'; a "
        "request's own chat_template_kwargs win key by key",
    )
    group.add_argument(
        "--chat-template-path",
        default=None,
        metavar="FILE",
        help="Jinja chat template file used instead of the tokenizer's own (as the rollout "
        "framework's --chat-template-path; give the engine the same template)",
    )
    group.add_argument(
        "--tito-model",
        default=None,
        metavar="NAME",
        help="model family whose TITO defaults apply, named as the rollout framework's "
        "--tito-model (qwen3, qwen35, qwennext, nemotron3, kimi25, kimi26, minimax_m25, "
        "minimax_m27, glm47, inkling, default): its chat template variables, appended roles, "
        "max trim tokens and stop-token rules; --chat-template-kwargs keys, "
        "--allowed-append-roles and --max-trim-tokens given explicitly win (docs/tokenizer.md, "
        "Model families)",
    )
    group.add_argument(
        "--stream-upstream",
        choices=STREAM_UPSTREAM_CHOICES,
        default="buffered",
        help="stream: true session turns: one non-stream upstream call relayed as one SSE "
        "chunk (buffered, the default: the record has every field) or the upstream's own "
        "token stream relayed as it arrives (relay: least time to first token; SGLang "
        "streams no weight_version)",
    )
    group.add_argument(
        "--no-smg-routing-key",
        dest="smg_routing_key",
        action="store_false",
        help="do not send X-SMG-Routing-Key: <session id> on session turns (sent by default, "
        "as the rollout framework does; SGLang uses it as the request's routing key)",
    )


def resolve_r3_topk(args: argparse.Namespace) -> int:
    """`args.r3_topk`, learned from the model when --r3 is on and it was not given.

    The trainer needs routed experts as [tokens, layers, topk]; a flat row it cannot use, and
    finding that out at `POST /sessions/{id}/samples` (422), after a whole rollout was
    recorded, is too late. So the top-k comes from --r3-topk, else from the checkpoint's
    config.json next to the tokenizer (`num_experts_per_tok`, read as SGLang sizes
    routed_experts: session/r3_shape.py), else --r3 refuses to start. SGLang's model info
    (`/model_info`, `/server_info`) does not carry it, so the engine cannot be asked.
    Sets `args.r3_topk` (forwarded to worker processes as given).
    """
    if args.r3_topk < 0:
        raise SystemExit("--r3-topk must be >= 0")
    if not args.r3 or args.r3_topk > 0:
        return int(args.r3_topk)
    from sessiongate.session.r3_shape import read_moe_shape

    try:
        shape = read_moe_shape(args.tokenizer)
    except ValueError as exc:
        raise SystemExit(f"--r3: {exc}") from None
    if shape is None:
        where = (
            f"--tokenizer {args.tokenizer} has no config.json naming num_experts_per_tok"
            if args.tokenizer
            else "the built-in tokenizer is no model checkpoint"
        )
        raise SystemExit(
            f"--r3 needs the model's MoE top-k (experts per token) to shape routed experts "
            f"for the trainer, and {where}: give --r3-topk K, or --tokenizer the checkpoint "
            "directory whose config.json has it"
        )
    args.r3_topk = shape.topk
    return shape.topk


def tito_family(args: argparse.Namespace) -> TitoFamily | None:
    """The `--tito-model` family, or None without one (SystemExit on an unknown name)."""
    if args.tito_model is None:
        return None
    try:
        return resolve_tito_family(args.tito_model)
    except ValueError as exc:
        raise SystemExit(f"--tito-model: {exc}") from None


def apply_tito_model(args: argparse.Namespace) -> None:
    """Fill `--allowed-append-roles` and `--max-trim-tokens` left unset (None) from the
    `--tito-model` family, else from the gateway's defaults (tool,user; 0).

    Sets them on `args`, as resolve_r3_topk does, so worker processes are started with the
    resolved values; a value given on the command line is kept.
    """
    family = tito_family(args)
    if args.allowed_append_roles is None:
        roles = family.allowed_append_roles if family is not None else DEFAULT_APPEND_ROLES
        args.allowed_append_roles = ",".join(sorted(roles))
    if args.max_trim_tokens is None:
        args.max_trim_tokens = family.max_trim_tokens if family is not None else 0


def turn_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SessionSettings fields of these options, validated (SystemExit on bad values)."""
    if args.r3_addition and not args.r3:
        raise SystemExit("--r3-addition needs --r3")
    r3_topk = resolve_r3_topk(args)
    if args.indexer_topk < 0:
        raise SystemExit("--indexer-topk must be >= 0")
    kwargs: dict[str, Any] = {}
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except ValueError as exc:
            raise SystemExit(f"--chat-template-kwargs is not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise SystemExit("--chat-template-kwargs must be a JSON object")
    if args.chat_template_path is not None:
        from sessiongate.tokenizer import TokenizerError, read_chat_template_file

        try:
            read_chat_template_file(args.chat_template_path)
        except TokenizerError as exc:
            raise SystemExit(f"--chat-template-path: {exc}") from None
    family = tito_family(args)
    if family is not None:
        # The family's variables are defaults: keys given with --chat-template-kwargs win.
        kwargs = {**family.template_kwargs, **kwargs}
    from sessiongate.session.messages import resolve_matcher

    try:
        resolve_matcher(args.message_matcher)
    except ValueError as exc:
        raise SystemExit(f"--message-matcher: {exc}") from None
    return {
        "r3": args.r3,
        "r3_topk": r3_topk,
        "r3_addition": args.r3_addition,
        "r3_missing": args.r3_missing,
        "indexer_replay": args.indexer_replay,
        "indexer_topk": args.indexer_topk,
        "lora_path": args.lora_path,
        "message_matcher": args.message_matcher,
        "chat_template_kwargs": kwargs,
        "boundary_stop_tokens": family.boundary_stop_tokens if family is not None else (),
        "end_of_turn_token": family.end_of_turn_token if family is not None else None,
        "stream_upstream": args.stream_upstream,
        "smg_routing_key": args.smg_routing_key,
    }


def turn_argv(args: argparse.Namespace) -> list[str]:
    """These options as the argv a worker process is started with."""
    argv = ["--r3-topk", str(args.r3_topk), "--r3-missing", args.r3_missing]
    argv += ["--indexer-topk", str(args.indexer_topk)]
    if args.r3:
        argv.append("--r3")
    argv += ["--message-matcher", args.message_matcher]
    argv += ["--stream-upstream", args.stream_upstream]
    if args.r3_addition:
        argv.append("--r3-addition")
    if args.indexer_replay:
        argv.append("--indexer-replay")
    if args.lora_path is not None:
        argv += ["--lora-path", args.lora_path]
    if args.chat_template_kwargs:
        argv += ["--chat-template-kwargs", args.chat_template_kwargs]
    if args.tito_model is not None:
        argv += ["--tito-model", args.tito_model]
    if args.chat_template_path is not None:
        # Absolute: a worker process need not share the parent's working directory.
        argv += ["--chat-template-path", os.path.abspath(args.chat_template_path)]
    if not args.smg_routing_key:
        argv.append("--no-smg-routing-key")
    return argv
