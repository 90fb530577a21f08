"""Settings of the session core (one set per worker)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sessiongate.session.tito_compare import ComparatorSpec

DEFAULT_APPEND_ROLES = frozenset({"tool", "user"})
# How a `stream: true` session turn reaches the upstream (docs/api.md, "Streamed turns").
StreamUpstream = Literal["buffered", "relay"]
# How a session's turns relate (docs/trajectory-trees.md): one line with rollbacks up to
# --max-rollback-steps (linear, the default), or a tree that branches at any depth (tree).
SessionMode = Literal["linear", "tree"]


@dataclass(frozen=True)
class SessionSettings:
    # Roles an agent may append after an assistant turn.
    allowed_append_roles: frozenset[str] = field(default=DEFAULT_APPEND_ROLES)
    # Trailing tokens of the previous checkpoint allowed to differ in the next one.
    max_trim_tokens: int = 0
    # Assistant steps a linear session's turn may roll back (--max-rollback-steps).
    max_rollback_steps: int = 64
    # Deleted session ids answered 410 (--reclaimed-ids, 0 = none) for --reclaimed-ttl s.
    reclaimed_ids: int = 4096
    reclaimed_ttl: float = 3600.0
    # Stop tokens that also open the next message, dropped where it joins (`--tito-model`'s
    # family, e.g. GLM 4.7; session/tito_families.py).
    boundary_stop_tokens: tuple[str, ...] = ()
    # The token that ends an assistant turn, when the family names it (Inkling); None: the
    # first special token the template renders after an assistant's content.
    end_of_turn_token: str | None = None
    # How `tito_session_mismatch` compares (`--tito-model`'s family; session/tito_compare.py);
    # None: derived from the chat template.
    tito_comparator: ComparatorSpec | None = None
    # Ask the upstream for routed experts (R3).
    r3: bool = False
    # Experts per token per layer, to shape R3 as [tokens, layers, topk] in trajectory files
    # (0: unknown, the shape is [tokens, layers * topk]).
    r3_topk: int = 0
    # Upstream path of the chat endpoint.
    chat_path: str = "/v1/chat/completions"
    # Header-identified sessions idle this long (seconds) are closed; 0 keeps them forever.
    header_session_ttl: float = 3600.0
    # Appended to "session not found" errors, e.g. when this worker replaced a lost one.
    not_found_note: str = ""
    # Addition R3: ask only for the rows a session does not hold yet
    # (`routed_experts_start_len` = checkpoint length - 1) and keep the patches.
    r3_addition: bool = False
    # Under `r3`, a reply without routed_experts is a 502 ("error") or recorded anyway and
    # counted ("warn").
    r3_missing: Literal["error", "warn"] = "error"
    # Ask for the indexer's top-k (`return_indexer_topk`); `indexer_topk` shapes it.
    indexer_replay: bool = False
    indexer_topk: int = 0
    # LoRA adapter every session turn is served with (`lora_path`), or the client's own.
    lora_path: str | None = None
    # How requested messages are matched against the stored history.
    message_matcher: str = "strict"
    # Server-wide chat template variables (e.g. enable_thinking); a request's own win.
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    stream_upstream: StreamUpstream = "buffered"
    # Send `X-SMG-Routing-Key: <session id>` on session turns, as the rollout framework does
    # (SGLang reads it as the request's routing key).
    smg_routing_key: bool = True
    # Abuse limits (docs/reliability.md, "Limits"); 0 turns each off.
    # Live sessions this core holds at most: one more is a 429.
    max_sessions: int = 10_000
    # Bytes of turn records (request + response bodies) this core holds before new turns are
    # refused with a 503. 0 here; the CLI's default ("auto") is sized from the machine's memory.
    max_records_bytes: int = 0
    # Bytes of freed records' memory kept mapped when the rest goes back to the OS (the
    # CLI's --warm-records-bytes, 1G; 0 here: an embedded core gives everything back).
    warm_records_bytes: int = 0
    # Sessions created by `POST /sessions` idle this long (seconds) are closed; 0 keeps them.
    session_ttl: float = 0.0
    # How limit errors name this core: "worker 3", or the in-process gateway.
    label: str = "the gateway"
    # Sessions created from now on are lines or trees (recovered ones keep their own mode).
    session_mode: SessionMode = "linear"
    # Tree mode's sample selection hooks (session/tree_hooks.py): a built-in name, an import
    # path ("module:function") or an entry point of group sessiongate.tree_hooks.
    tree_pick_hook: str = "drop_retries"
    tree_postprocess_hook: str = "default_postprocess"
