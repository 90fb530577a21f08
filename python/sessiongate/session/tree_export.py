"""What a tree session hands the trainer: one sample (and one trajectory) per leaf.

A consistent snapshot of the tree is taken under the session's lock (`TreeSnapshot`); the
rest is pure work run off the event loop: per leaf, its root-to-leaf records and checkpoint
are assembled exactly as a linear session's (`samples.assemble_samples`), tagged with the
leaf's descriptor, then the pick hook selects and orders them and the post-process hook
finalises them (the rollout framework's v2 samples op, miles/rollout/session/v2/utils.py
`build_leaf_material` and core.py `collect_samples`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sessiongate.errors import GatewayError, SamplesError
from sessiongate.session.messages import Message
from sessiongate.session.samples import (
    Sample,
    assemble_samples,
    encode_samples,
    wire_session_metadata,
)
from sessiongate.session.state import Session, TurnRecord
from sessiongate.session.store.spilled import pin_files
from sessiongate.session.tito import TitoEngine
from sessiongate.session.trajectory import LeafPath, build_tree_trajectory
from sessiongate.session.tree import (
    TreeNode,
    checkpoint_of,
    describe_tree,
    leaf_descriptor,
    path_messages,
)
from sessiongate.session.tree_hooks import TreeHook, TreeHookError, run_pick, run_postprocess

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeSnapshot:
    """The tree as it was at one instant: nodes are immutable but for their children, so
    the leaves and the table are taken with the nodes."""

    nodes: list[TreeNode]
    leaves: list[TreeNode]
    records: list[TurnRecord]  # by node id, spilled ones pinned to their file
    table: dict[str, Any]  # describe_tree: `metadata.tree`

    @classmethod
    def take(cls, session: Session) -> TreeSnapshot:
        """Call under the session's lock."""
        tree = session.tree
        if tree is None:
            raise ValueError(f"session {session.session_id} is not a tree session")
        nodes = list(tree.nodes)
        return cls(
            nodes=nodes,
            leaves=[node for node in nodes if not node.children],
            records=pin_files(session.records),
            table=describe_tree(nodes),
        )

    def path_records(self, node: TreeNode) -> list[TurnRecord]:
        return [self.records[n.id] for n in node.path()]

    def active_view(
        self,
    ) -> tuple[list[TurnRecord], list[Message], list[int], Any, dict[str, Any]]:
        """The single-chain view (GET): records, messages, ids, tools and template
        variables of the path ending at the most recently committed node."""
        if not self.nodes:
            return [], [], [], None, {}
        active = self.nodes[-1]
        return (
            self.path_records(active),
            path_messages(active),
            list(checkpoint_of(active)),
            active.tools,
            active.template_kwargs,
        )


@dataclass(frozen=True)
class LeafMaterial:
    leaf: TreeNode
    sample: Sample


def leaf_samples(
    snapshot: TreeSnapshot,
    tito: TitoEngine,
    *,
    max_seq_len: int | None,
    r3_topk: int,
    indexer_topk: int,
    replay: bool = True,
) -> list[LeafMaterial]:
    """One raw sample per leaf, in commit order; leaves cut away whole by `max_seq_len`
    give none. SamplesError (422) when a path cannot be assembled."""
    material: list[LeafMaterial] = []
    for leaf in snapshot.leaves:
        accumulated = checkpoint_of(leaf)
        try:
            samples, _ = assemble_samples(
                snapshot.path_records(leaf),
                accumulated,
                tokenizer=tito.tokenizer,
                max_trim_tokens=tito.max_trim_tokens,
                max_seq_len=max_seq_len,
                r3_topk=r3_topk,
                indexer_topk=indexer_topk,
                replay=replay,
            )
        except SamplesError as exc:  # say which path: records are numbered along it
            path = [node.id for node in leaf.path()]
            raise SamplesError(f"tree leaf {leaf.id} (path {path}): {exc.message}") from exc
        if not samples:
            continue
        sample = samples[0]
        flat: dict[str, Any] = {
            "accumulated_token_ids": list(accumulated),
            "leaf": leaf_descriptor(leaf),
        }
        mismatch = _mismatch(tito, leaf, accumulated)
        if mismatch is not None:
            flat["tito_session_mismatch"] = mismatch
        sample.metadata = {**sample.metadata, **flat}
        material.append(LeafMaterial(leaf, sample))
    return material


def _mismatch(tito: TitoEngine, leaf: TreeNode, accumulated: Sequence[int]) -> Any:
    try:
        return tito.mismatches(
            path_messages(leaf), leaf.tools, accumulated, template_kwargs=leaf.template_kwargs
        )
    except (GatewayError, ValueError):
        logger.exception("tito_session_mismatch of tree leaf %d could not be computed", leaf.id)
        return None


def tree_samples_payload(
    snapshot: TreeSnapshot,
    session_metadata: dict[str, Any],
    tito: TitoEngine,
    *,
    pick: TreeHook,
    postprocess: TreeHook,
    max_seq_len: int | None,
    r3_topk: int,
    indexer_topk: int,
) -> bytes:
    """The `/samples` payload of a tree session: the framework's v2 wire (its `reward`
    after each sample's metadata), samples in the pick hook's order."""
    meta = wire_session_metadata(
        session_metadata,
        session_metadata.get("accumulated_token_ids", []),
        tito.max_trim_tokens,
    )
    if not snapshot.nodes:
        return _encode([], meta, "no_records", postprocess)
    material = leaf_samples(
        snapshot, tito, max_seq_len=max_seq_len, r3_topk=r3_topk, indexer_topk=indexer_topk
    )
    if not material:
        return _encode([], meta, "all_truncated", postprocess)
    picked = run_pick(pick, [m.sample for m in material], meta)
    samples = run_postprocess(postprocess, picked, meta)
    return _encode(samples, meta, None if samples else "all_truncated", postprocess)


def _encode(
    samples: list[Sample], meta: dict[str, Any], empty_reason: str | None, last_hook: TreeHook
) -> bytes:
    try:
        return b"".join(encode_samples(samples, meta, empty_reason, with_reward=True))
    except (TypeError, ValueError) as exc:  # e.g. metadata a hook filled with non-JSON
        raise TreeHookError(
            f"the samples after {last_hook.label} cannot be encoded: {type(exc).__name__}: {exc}"
        ) from exc


def tree_trajectory_parts(
    session_id: str,
    snapshot: TreeSnapshot,
    session_metadata: dict[str, Any],
    tito: TitoEngine,
    *,
    pick: TreeHook,
    r3_topk: int,
) -> list[bytes | memoryview]:
    """The trajectory file of a tree session: the leaves the pick hook keeps, in its order.
    The hook sees the `/samples` leaf samples without replay rows (the file has its own)."""
    material = leaf_samples(
        snapshot, tito, max_seq_len=None, r3_topk=0, indexer_topk=0, replay=False
    )
    by_sample = {id(m.sample): m.leaf for m in material}
    picked = run_pick(pick, [m.sample for m in material], session_metadata) if material else []
    leaves = [by_sample[id(sample)] for sample in picked]
    paths = [
        LeafPath(leaf_descriptor(leaf), snapshot.path_records(leaf), checkpoint_of(leaf))
        for leaf in leaves
    ]
    return build_tree_trajectory(session_id, paths, session_metadata, r3_topk=r3_topk)


__all__ = [
    "LeafMaterial",
    "TreeHookError",
    "TreeSnapshot",
    "leaf_samples",
    "tree_samples_payload",
    "tree_trajectory_parts",
]
