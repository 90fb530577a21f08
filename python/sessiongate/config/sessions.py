"""The sessions section: the tokenizer and its template, what a turn may append, the
turn's engine contract (R3, indexer, LoRA, streaming, routing key), the session mode (linear
or tree) and its sample hooks; and the session routing section (identity stamped for an
external router). Every process that runs a session core takes these."""

from __future__ import annotations

from dataclasses import dataclass

from sessiongate.config.fields import option, section

STREAM_UPSTREAM_CHOICES = ("buffered", "relay")
R3_MISSING_CHOICES = ("error", "warn")
SESSION_MODES = ("linear", "tree")
DEFAULT_PICK_HOOK = "drop_retries"
DEFAULT_POSTPROCESS_HOOK = "default_postprocess"


@section(title="sessions (tokenizer, turns, session mode; docs/tokenizer.md)", key="sessions")
@dataclass(frozen=True)
class SessionsConfig:
    tokenizer: str | None = option(
        "--tokenizer",
        help="local Hugging Face tokenizer directory (default: the built-in tokenizer)",
    )
    allowed_append_roles: str | None = option(
        "--allowed-append-roles",
        help="roles an agent may append after an assistant turn (comma list; default: the "
        "widest row of --tito-model's family, else tool,user; with a family, roles none of "
        "its rows covers are refused)",
    )
    max_trim_tokens: int | None = option(
        "--max-trim-tokens",
        parse=int,
        help="trailing checkpoint tokens allowed to differ in the next turn (default: "
        "--tito-model's, else 0)",
    )
    max_rollback_steps: int = option(
        "--max-rollback-steps",
        default=64,
        parse=int,
        help="assistant steps a linear session's turn may roll back, for agents that retry "
        "from an older checkpoint (64, as the rollout framework; 1: only the last step)",
    )
    reclaimed_ids: int = option(
        "--reclaimed-ids",
        default=4096,
        parse=int,
        help="deleted session ids remembered, so a late turn to one gets 410 Gone rather "
        "than 404 (4096, the oldest dropped first; 0 = none; kept across restarts with "
        "--records-dir)",
    )
    reclaimed_ttl: float = option(
        "--reclaimed-ttl",
        default=3600.0,
        parse=float,
        help="seconds a deleted session id answers 410 before it is forgotten (3600)",
    )
    header_session_ttl: float = option(
        "--header-session-ttl",
        default=3600.0,
        parse=float,
        help="close sessions created by a session header after this many idle seconds "
        "(3600; 0 = never)",
    )
    r3: bool = option(
        "--r3", default=False, kind="switch", help="ask the engine for routed experts"
    )
    r3_topk: int = option(
        "--r3-topk",
        default=0,
        parse=int,
        help="with --r3: experts per token per layer, which shapes routed experts as "
        "[tokens, layers, topk] in samples and trajectory files (default: learned from "
        "config.json in the --tokenizer checkpoint directory; without one --r3 refuses to "
        "start)",
    )
    r3_addition: bool = option(
        "--r3-addition",
        default=False,
        kind="switch",
        help="with --r3: ask only for the routed-experts rows a session does not hold yet "
        "(routed_experts_start_len, the rollout framework's addition R3); records keep the "
        "patches, trajectories and samples are the same as with full R3",
    )
    r3_missing: str = option(
        "--r3-missing",
        default="error",
        choices=R3_MISSING_CHOICES,
        help="with --r3, a reply without routed_experts is a 502 (error, the default) or is "
        "recorded and counted in /health (warn)",
    )
    indexer_replay: bool = option(
        "--indexer-replay",
        default=False,
        kind="switch",
        help="ask the engine for the sparse-attention indexer's top-k (return_indexer_topk)",
    )
    indexer_topk: int = option(
        "--indexer-topk",
        default=0,
        parse=int,
        help="indexer top-k per token per layer: shapes rollout_indexer_topk as "
        "[tokens, layers, topk] in samples (0: [tokens, layers*topk])",
    )
    lora_path: str | None = option(
        "--lora-path",
        metavar="ADAPTER",
        help="serve every session turn with this LoRA adapter (sets lora_path; default: "
        "the client's own lora_path, if any, passes through)",
    )
    message_matcher: str = option(
        "--message-matcher",
        default="strict",
        metavar="NAME",
        help="how a request's messages are matched against the stored history: strict "
        "(default), or the looser matchers listed in docs/tokenizer.md",
    )
    chat_template_kwargs: str | None = option(
        "--chat-template-kwargs",
        metavar="JSON",
        help="server-wide chat template variables, e.g. '{\"enable_thinking\": false}'; a "
        "request's own chat_template_kwargs win key by key",
    )
    chat_template_path: str | None = option(
        "--chat-template-path",
        metavar="FILE",
        help="Jinja chat template file used instead of the tokenizer's own (as the rollout "
        "framework's --chat-template-path; give the engine the same template)",
    )
    sglang_version: str = option(
        "--sglang-version",
        default="auto",
        metavar="VERSION",
        help="the SGLang version whose rendering rules (tool dump, message shaping) the "
        "prompts follow: auto (default) reads it from the engines' /server_info at start "
        "(engines of different versions: the start is refused; none answering: the newest "
        "rules), or a version such as 0.5.16 (docs/tokenizer.md, SGLang version rules)",
    )
    tito_model: str | None = option(
        "--tito-model",
        metavar="NAME",
        help="model family whose TITO defaults apply, named as the rollout framework's "
        "--tito-model (default, qwen3, qwen35, qwennext, nemotron3, kimi25, kimi26, "
        "minimax_m25, minimax_m27, glm47, deepseekv32, deepseekv4, inkling): the framework's "
        "row for the appended roles (its fixed chat template, from the families extra, and "
        "template variables), max trim tokens, stop-token rules, DeepSeek's prompt encoders; "
        "--chat-template-path, --chat-template-kwargs keys, --allowed-append-roles and "
        "--max-trim-tokens given explicitly win (docs/tokenizer.md, Model families)",
    )
    stream_upstream: str = option(
        "--stream-upstream",
        default="buffered",
        choices=STREAM_UPSTREAM_CHOICES,
        help="stream: true session turns: one non-stream engine call relayed as one SSE "
        "chunk (buffered, the default: the record has every field) or the engine's own "
        "token stream relayed as it arrives (relay: least time to first token; SGLang "
        "streams no weight_version)",
    )
    smg_routing_key: bool = option(
        "--no-smg-routing-key",
        default=True,
        kind="negated",
        help="do not send X-SMG-Routing-Key: <session id> on session turns (sent by default, "
        "as the rollout framework does; SGLang uses it as the request's routing key)",
    )
    session_mode: str = option(
        "--session-mode",
        default="linear",
        choices=SESSION_MODES,
        help="linear (default): a session is one line of turns with rollbacks up to "
        "--max-rollback-steps; "
        "tree: each turn attaches at the deepest earlier turn its messages extend, so a "
        "session branches at any depth (retries, forks, resumes) and /samples gives one "
        "sample per leaf (docs/trajectory-trees.md)",
    )
    tree_pick_hook: str = option(
        "--tree-pick-hook",
        default=DEFAULT_PICK_HOOK,
        metavar="HOOK",
        help="tree mode: which leaves become samples, in which order: drop_retries "
        "(default: drop leaves superseded by a later sibling), keep_all, an import path "
        "(package.module:function) or an entry point of group sessiongate.tree_hooks",
    )
    tree_postprocess_hook: str = option(
        "--tree-postprocess-hook",
        default=DEFAULT_POSTPROCESS_HOOK,
        metavar="HOOK",
        help="tree mode: finalises the picked samples: default_postprocess (a shared "
        "completion is trained in the earliest kept leaf only; the agent's reward), none, "
        "an import path or an entry point",
    )


@section(
    title="session routing (session identity stamped for an external router; docs/routing.md)",
    key="session_routing",
)
@dataclass(frozen=True)
class SessionRoutingConfig:
    mode: str | None = option(
        "--session-routing",
        metavar="MODE",
        help="stamp session identity onto engine requests for an external router "
        "(`sessiongate plugins` lists the modes)",
    )
    options: tuple[str, ...] = option(
        "--session-routing-opt",
        default=[],
        kind="append",
        metavar="KEY=VALUE",
        help="an option of the session routing mode (repeatable)",
    )
