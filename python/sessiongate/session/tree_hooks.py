"""Sample selection hooks of tree sessions (docs/trajectory-trees.md, "Hooks").

Both hooks are `fn(leaf_samples, session_metadata) -> list[Sample]`, as the rollout
framework has them (radixark/miles, miles/rollout/session/v2/picker_hub and
postprocessor_hub): the pick hook selects and orders the per-leaf samples (a subset of its
input, no duplicates, nothing rewritten); the post-process hook finalises the survivors.
A hook is named by a built-in name, an import path (`module:function` or `module.function`)
or an entry point of the group `sessiongate.tree_hooks`. Loading problems are startup
errors (ValueError); a hook that raises or returns something invalid while serving is a 422
naming the hook, never a 500.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Literal

from sessiongate.config.fields import flag_of
from sessiongate.config.sessions import SessionsConfig
from sessiongate.errors import SamplesError
from sessiongate.session.samples import ABORTED, COMPLETED, PENDING, TRUNCATED, Sample

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sessiongate.tree_hooks"
HookKind = Literal["pick", "postprocess"]
HookFunction = Callable[[list[Sample], dict[str, Any]], Any]
_STATUSES = frozenset({COMPLETED, TRUNCATED, ABORTED, PENDING})
# Sample metadata the server owns: agent metadata never replaces it (the framework's
# default_postprocess.py, _SERVER_OWNED_METADATA_KEYS).
SERVER_OWNED_METADATA = ("accumulated_token_ids", "tito_session_mismatch", "leaf")


class TreeHookError(SamplesError):
    """A hook raised or returned something invalid: 422 naming the hook."""


# -- built-in hooks ----------------------------------------------------------------------


def drop_retries(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    """The default pick hook: a leaf with a later sibling off the same parent is an
    abandoned retry and is dropped; survivors are ordered by checkpoint count (nodes on the
    path), then commit order, both descending (the framework's picker_hub/drop_retries.py)."""
    children: dict[int, list[int]] = {}
    for node in session_metadata["tree"]["nodes"]:
        if node["parent"] is not None:
            children.setdefault(node["parent"], []).append(node["id"])
    kept = []
    for sample in leaf_samples:
        leaf = sample.metadata["leaf"]
        parent = leaf["parent"]
        superseded = parent is not None and any(
            sibling > leaf["node_id"] for sibling in children[parent]
        )
        if superseded:
            logger.debug("drop_retries: leaf %d is an abandoned retry", leaf["node_id"])
        else:
            kept.append(sample)
    return sorted(
        kept,
        key=lambda s: (len(s.metadata["leaf"]["path_node_ids"]), s.metadata["leaf"]["node_id"]),
        reverse=True,
    )


def keep_all(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    """Every leaf, in commit order."""
    return list(leaf_samples)


def default_postprocess(
    leaf_samples: list[Sample], session_metadata: dict[str, Any]
) -> list[Sample]:
    """The framework's default post-process (postprocessor_hub/default_postprocess.py): a
    completion shared by several kept leaves is trained only in the earliest committed one
    (the others get loss mask 0 over it); the agent's `/samples` metadata joins each
    sample's metadata without replacing server-owned keys; its `reward`, when given, is
    every sample's reward. Mutates the samples in place, keeps the picker's order."""
    spans = {node["id"]: node["completion_span"] for node in session_metadata["tree"]["nodes"]}
    agent = session_metadata.get("agent") or {}
    reward = agent.get("reward")
    agent_fields = {k: v for k, v in agent.items() if k not in SERVER_OWNED_METADATA}
    owner: dict[int, int] = {}
    for sample in leaf_samples:
        leaf = sample.metadata["leaf"]
        for node_id in leaf["path_node_ids"]:
            owner[node_id] = min(leaf["node_id"], owner.get(node_id, leaf["node_id"]))
    for sample in leaf_samples:
        leaf = sample.metadata["leaf"]
        response_start = len(sample.tokens) - sample.response_length
        for node_id in leaf["path_node_ids"]:
            if owner[node_id] == leaf["node_id"]:
                continue
            start, end = spans[node_id]
            # Spans index all tokens, the mask only the response; a truncated sample ends
            # early.
            lo = max(start - response_start, 0)
            hi = min(end - response_start, sample.response_length)
            if hi > lo:
                sample.loss_mask[lo:hi] = bytes(hi - lo)
        server = {k: sample.metadata[k] for k in SERVER_OWNED_METADATA if k in sample.metadata}
        sample.metadata = {**sample.metadata, **agent_fields, **server}
        if reward is not None:
            sample.reward = reward
    return leaf_samples


def no_postprocess(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    """The picked samples as they are (every leaf trains its whole path)."""
    return leaf_samples


BUILTIN_HOOKS: dict[HookKind, dict[str, HookFunction]] = {
    "pick": {"drop_retries": drop_retries, "keep_all": keep_all},
    "postprocess": {"default_postprocess": default_postprocess, "none": no_postprocess},
}
_FLAG = {
    "pick": flag_of(SessionsConfig, "tree_pick_hook"),
    "postprocess": flag_of(SessionsConfig, "tree_postprocess_hook"),
}


# -- loading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeHook:
    kind: HookKind
    name: str  # as configured: how errors name it
    function: HookFunction

    @property
    def label(self) -> str:
        return f"tree {self.kind} hook {self.name!r}"


def load_hook(kind: HookKind, name: str) -> TreeHook:
    """The hook `name` of `kind`; ValueError (what to do next) when it cannot be used."""
    builtins = BUILTIN_HOOKS[kind]
    hint = (
        f"{_FLAG[kind]} takes one of {', '.join(builtins)}, an import path "
        f"(package.module:function) or an entry point of group {ENTRY_POINT_GROUP!r}"
    )
    spec = name.strip() if isinstance(name, str) else ""
    if not spec:
        raise ValueError(f"empty {kind} hook name; {hint}")
    if spec in builtins:
        return TreeHook(kind, spec, builtins[spec])
    target = _from_entry_point(spec) if _is_plain_name(spec) else _from_import_path(spec)
    if target is None:
        raise ValueError(f"unknown tree {kind} hook {spec!r}; {hint}")
    if not callable(target) or _is_async(target):
        raise ValueError(f"tree {kind} hook {spec!r} must be a synchronous callable; {hint}")
    return TreeHook(kind, spec, target)


def _is_plain_name(spec: str) -> bool:
    return ":" not in spec and "." not in spec


def _from_import_path(spec: str) -> object:
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"tree hook {spec!r} is not an import path (package.module:function)")
    try:
        target: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except Exception as exc:  # third-party import-time code may raise anything
        raise ValueError(
            f"tree hook {spec!r} could not be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    return target


def _from_entry_point(spec: str) -> object:
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
    if not found:
        return None
    if len({ep.value for ep in found}) > 1:
        raise ValueError(
            f"tree hook entry point {spec!r} is provided more than once "
            f"({', '.join(ep.value for ep in found)}); uninstall one"
        )
    try:
        return found[0].load()
    except Exception as exc:
        raise ValueError(
            f"tree hook entry point {spec!r} ({found[0].value}) failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _is_async(target: object) -> bool:
    # Hooks run synchronously off the event loop: a coroutine would be an invalid result.
    call = type(target).__dict__.get("__call__")
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)


# -- running -------------------------------------------------------------------------------


def _call(hook: TreeHook, samples: list[Sample], metadata: dict[str, Any]) -> Any:
    try:
        return hook.function(samples, metadata)
    except Exception as exc:
        raise TreeHookError(f"{hook.label} failed: {type(exc).__name__}: {exc}") from exc


def run_pick(hook: TreeHook, samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    """The hook's selection, checked to be a subset of `samples` without duplicates."""
    picked = _call(hook, list(samples), metadata)
    if not isinstance(picked, list | tuple):
        raise TreeHookError(
            f"{hook.label} must return a list of its input samples, got {type(picked).__name__}"
        )
    allowed = {id(sample) for sample in samples}
    seen: set[int] = set()
    for index, sample in enumerate(picked):
        if id(sample) not in allowed or id(sample) in seen:
            what = "a duplicate" if id(sample) in seen else "not one of its input samples"
            raise TreeHookError(
                f"{hook.label} must return a subset of its input samples without duplicates "
                f"(a pure selection); item {index} is {what}"
            )
        seen.add(id(sample))
    return list(picked)


def run_postprocess(
    hook: TreeHook, samples: list[Sample], metadata: dict[str, Any]
) -> list[Sample]:
    """The hook's samples, checked to be well-formed samples (normalised to wire types)."""
    result = _call(hook, samples, metadata)
    if not isinstance(result, list | tuple):
        raise TreeHookError(
            f"{hook.label} must return a list of samples, got {type(result).__name__}"
        )
    return [_checked_sample(hook, index, sample) for index, sample in enumerate(result)]


def _checked_sample(hook: TreeHook, index: int, sample: object) -> Sample:
    def bad(why: str) -> TreeHookError:
        return TreeHookError(f"{hook.label} returned an invalid sample {index}: {why}")

    if not isinstance(sample, Sample):
        raise bad(f"{type(sample).__name__} is not a Sample")
    length = sample.response_length
    if type(length) is not int or not 0 <= length <= len(sample.tokens):
        raise bad(f"response_length {length!r} is not in [0, {len(sample.tokens)}]")
    try:
        mask = bytearray(sample.loss_mask)
        logprobs = array("d", sample.rollout_log_probs)
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad(f"loss_mask or rollout_log_probs is not numeric ({exc})") from None
    if len(mask) != length or len(logprobs) != length:
        raise bad(
            f"loss_mask has {len(mask)} and rollout_log_probs {len(logprobs)} entries for "
            f"response_length {length}"
        )
    if sample.status not in _STATUSES:
        raise bad(f"status {sample.status!r} is not one of {sorted(_STATUSES)}")
    if not isinstance(sample.metadata, dict):
        raise bad(f"metadata is a {type(sample.metadata).__name__}, not an object")
    reward = sample.reward
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
    ):
        raise bad(f"reward {reward!r} is not a finite number or null")
    sample.loss_mask = mask
    sample.rollout_log_probs = logprobs
    return sample


def hook_names(kind: HookKind) -> Sequence[str]:
    return tuple(BUILTIN_HOOKS[kind])
