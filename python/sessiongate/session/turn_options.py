"""What a session turn's engine contract is made of, from the sessions options: the R3
top-k learned from the checkpoint, the --tito-model family's defaults, the template
variables, each checked once at start (SystemExit naming the flag). The options themselves
are declared in config/sessions.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from sessiongate.config.sessions import SessionsConfig
from sessiongate.session.settings import DEFAULT_APPEND_ROLES
from sessiongate.session.tito_families import TemplateRow, TitoFamily, resolve_tito_family


def resolve_r3_topk(sessions: SessionsConfig) -> int:
    """`args.r3_topk`, learned from the model when --r3 is on and it was not given.

    The trainer needs routed experts as [tokens, layers, topk]; a flat row it cannot use, and
    finding that out at `POST /sessions/{id}/samples` (422), after a whole rollout was
    recorded, is too late. So the top-k comes from --r3-topk, else from the checkpoint's
    config.json next to the tokenizer (`num_experts_per_tok`, read as SGLang sizes
    routed_experts: session/r3_shape.py), else --r3 refuses to start. SGLang's model info
    (`/model_info`, `/server_info`) does not carry it, so the engine cannot be asked.
    """
    if sessions.r3_topk < 0:
        raise SystemExit("--r3-topk must be >= 0")
    if not sessions.r3 or sessions.r3_topk > 0:
        return int(sessions.r3_topk)
    from sessiongate.session.r3_shape import read_moe_shape

    try:
        shape = read_moe_shape(sessions.tokenizer)
    except ValueError as exc:
        raise SystemExit(f"--r3: {exc}") from None
    if shape is None:
        where = (
            f"--tokenizer {sessions.tokenizer} has no config.json naming num_experts_per_tok"
            if sessions.tokenizer
            else "the built-in tokenizer is no model checkpoint"
        )
        raise SystemExit(
            f"--r3 needs the model's MoE top-k (experts per token) to shape routed experts "
            f"for the trainer, and {where}: give --r3-topk K, or --tokenizer the checkpoint "
            "directory whose config.json has it"
        )
    return shape.topk


def tito_family(sessions: SessionsConfig) -> TitoFamily | None:
    """The `--tito-model` family, or None without one (SystemExit on an unknown name)."""
    if sessions.tito_model is None:
        return None
    try:
        return resolve_tito_family(sessions.tito_model)
    except ValueError as exc:
        raise SystemExit(f"--tito-model: {exc}") from None


def _roles(text: str) -> frozenset[str]:
    return frozenset(r.strip() for r in text.split(",") if r.strip())


def template_row(sessions: SessionsConfig) -> TemplateRow | None:
    """The --tito-model family's row for the appended roles (resolved options), or None
    without a family or rows; SystemExit when the family has no row for those roles."""
    family = tito_family(sessions)
    if family is None or sessions.allowed_append_roles is None:
        return None
    try:
        return family.row_for(_roles(sessions.allowed_append_roles))
    except ValueError as exc:
        raise SystemExit(f"--allowed-append-roles: {exc}") from None


def prompt_encoder(sessions: SessionsConfig) -> str | None:
    """The prompt encoder the family renders with, unless a template file was given."""
    family = tito_family(sessions)
    if family is None or sessions.chat_template_path is not None:
        return None
    return family.prompt_encoder


def _family_template(sessions: SessionsConfig, family: TitoFamily | None) -> str | None:
    # The row's fixed template, read from the framework's package, when none was given.
    if sessions.chat_template_path is not None or family is None:
        return sessions.chat_template_path
    row = template_row(sessions)
    if row is None or row.template is None:
        return None
    from sessiongate.tokenizer import TokenizerError
    from sessiongate.tokenizer.framework_tito import template_file

    try:
        return template_file(row.template, family.name)
    except TokenizerError as exc:
        raise SystemExit(
            f"--tito-model {family.name}: {exc} (or give the template with --chat-template-path)"
        ) from None


def resolve_sessions(sessions: SessionsConfig) -> SessionsConfig:
    """The sessions options with what was left to be learned filled in: appended roles and
    max trim tokens from the --tito-model family (else tool,user and 0), the family's fixed
    template for those roles (the rollout framework's), the R3 top-k from the checkpoint, the
    chat template file's absolute path. A value given is kept. `serve` hands its workers the
    resolved options, so each worker needs neither the checkpoint nor the parent's working
    directory."""
    family = tito_family(sessions)
    roles = sessions.allowed_append_roles
    if roles is None:
        roles = ",".join(
            sorted(family.default_roles if family is not None else DEFAULT_APPEND_ROLES)
        )
    trim = sessions.max_trim_tokens
    if trim is None:
        trim = family.max_trim_tokens if family is not None else 0
    template = _family_template(dataclasses.replace(sessions, allowed_append_roles=roles), family)
    return dataclasses.replace(
        sessions,
        allowed_append_roles=roles,
        max_trim_tokens=trim,
        r3_topk=resolve_r3_topk(sessions),
        chat_template_path=os.path.abspath(template) if template is not None else None,
    )


def turn_settings(sessions: SessionsConfig) -> dict[str, Any]:
    """The SessionSettings fields of these options (resolved: resolve_sessions), validated
    (SystemExit on bad values)."""
    if sessions.r3_addition and not sessions.r3:
        raise SystemExit("--r3-addition needs --r3")
    r3_topk = resolve_r3_topk(sessions)
    if sessions.indexer_topk < 0:
        raise SystemExit("--indexer-topk must be >= 0")
    kwargs: dict[str, Any] = {}
    if sessions.chat_template_kwargs:
        try:
            kwargs = json.loads(sessions.chat_template_kwargs)
        except ValueError as exc:
            raise SystemExit(f"--chat-template-kwargs is not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise SystemExit("--chat-template-kwargs must be a JSON object")
    if sessions.chat_template_path is not None:
        from sessiongate.tokenizer import TokenizerError, read_chat_template_file

        try:
            read_chat_template_file(sessions.chat_template_path)
        except TokenizerError as exc:
            raise SystemExit(f"--chat-template-path: {exc}") from None
    row = template_row(sessions)
    if row is not None:
        # The row's variables are defaults: keys given with --chat-template-kwargs win.
        kwargs = {**row.kwargs, **kwargs}
    family = tito_family(sessions)
    from sessiongate.sglang_rules import parse_version

    if sessions.sglang_version != "auto" and parse_version(sessions.sglang_version) is None:
        raise SystemExit(
            f"--sglang-version {sessions.sglang_version!r} is neither 'auto' nor a version "
            "like 0.5.16"
        )
    from sessiongate.session.messages import resolve_matcher

    try:
        resolve_matcher(sessions.message_matcher)
    except ValueError as exc:
        raise SystemExit(f"--message-matcher: {exc}") from None
    return {
        "r3": sessions.r3,
        "r3_topk": r3_topk,
        "r3_addition": sessions.r3_addition,
        "r3_missing": sessions.r3_missing,
        "indexer_replay": sessions.indexer_replay,
        "indexer_topk": sessions.indexer_topk,
        "lora_path": sessions.lora_path,
        "message_matcher": sessions.message_matcher,
        "chat_template_kwargs": kwargs,
        "boundary_stop_tokens": family.boundary_stop_tokens if family is not None else (),
        "end_of_turn_token": family.end_of_turn_token if family is not None else None,
        "tito_comparator": family.comparator if family is not None else None,
        "stream_upstream": sessions.stream_upstream,
        "smg_routing_key": sessions.smg_routing_key,
    }
