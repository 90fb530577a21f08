"""Trajectory trees (`session_mode = "tree"`, docs/trajectory-trees.md): a session
branches at any depth and hands the trainer one sample per leaf.

A `SessionCore` runs in-process on its own event loop (settings chosen per test) against a
real mock engine on loopback, so every turn is real HTTP, real tokenization and a real
SGLang-style reply. Facts taken from the rollout framework's source are named with their file
(radixark/miles, miles/rollout/session/v2/...).
"""

from __future__ import annotations

import asyncio
import json
from array import array
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sessiongate.config.sessions import SessionsConfig
from sessiongate.engines.pool import EnginePool
from sessiongate.formats.safetensors import decode as read_safetensors_file
from sessiongate.protocol import CoreReply, CoreRequest
from sessiongate.session import tree as tree_module
from sessiongate.session.core import SessionCore
from sessiongate.session.samples import Sample
from sessiongate.session.settings import SessionSettings
from sessiongate.session.store.records_store import RecordsStore, StoreSettings
from sessiongate.session.store.spilled import SpilledRecord
from sessiongate.session.tree import MAX_NODES
from sessiongate.session.tree_hooks import drop_retries, load_hook
from sessiongate.session.tree_options import session_mode_settings
from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, mock_engine
from support.samples import check_with_safetensors, decode_samples_payload

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

TOKENIZER = load_tokenizer(None)
EOT = TOKENIZER.end_of_turn_token_id
LAYERS, TOPK = 3, 2
TREE = SessionSettings(session_mode="tree", r3=True, r3_topk=TOPK)
KEEP_ALL = replace(TREE, tree_pick_hook="keep_all", tree_postprocess_hook="none")
Messages = list[dict[str, Any]]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    # Completions of 4-8 tokens end naturally ("stop") under the default max_tokens.
    args = ["--completion-tokens", "6", "--completion-tokens-jitter", "2"]
    with mock_engine(*args, "--r3-layers", str(LAYERS), "--r3-topk", str(TOPK)) as proc:
        yield proc


class Core:
    """A SessionCore on its own event loop, driven synchronously."""

    def __init__(
        self, url: str, settings: SessionSettings, store: RecordsStore | None = None
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.core = SessionCore(
            load_tokenizer(None), EnginePool([url], timeout=30), settings, None, store
        )
        self.core.recover()

    def call(self, op: str, session_id: str | None = None, body: Any = None) -> CoreReply:
        return self.loop.run_until_complete(self.acall(op, session_id, body))

    async def acall(self, op: str, session_id: str | None = None, body: Any = None) -> CoreReply:
        raw = b"" if body is None else json.dumps(body).encode()
        request = CoreRequest(
            op=op,
            session_id=session_id,
            path="/v1/chat/completions" if op == "chat" else "",
            method="POST",
            headers=[("content-type", "application/json")],
            body=raw,
        )
        reply = await asyncio.wait_for(self.core.handle(request), 60)
        if reply.stream is not None:
            reply = CoreReply(
                reply.status, reply.headers, b"".join([p async for p in reply.stream])
            )
        return reply

    def concurrently(self, session_id: str, bodies: list[dict[str, Any]]) -> list[CoreReply]:
        """Chat turns started together (each passes phase 1 before any is answered)."""

        async def run() -> list[CoreReply]:
            return list(await asyncio.gather(*(self.acall("chat", session_id, b) for b in bodies)))

        return self.loop.run_until_complete(run())

    def new_session(self) -> str:
        reply = self.call("create")
        assert reply.status == 200, reply.body
        session_id: str = json.loads(reply.body)["session_id"]
        return session_id

    def chat(self, session_id: str, messages: Messages, **extra: Any) -> CoreReply:
        body = {"model": "m", "messages": messages, "max_tokens": 16, **extra}
        return self.call("chat", session_id, body)

    def turn(self, session_id: str, messages: Messages, **extra: Any) -> Messages:
        """One turn; returns `messages` with the assistant's reply appended."""
        reply = self.chat(session_id, messages, **extra)
        assert reply.status == 200, reply.body
        return [*messages, assistant_of(reply)]

    def get(self, session_id: str) -> dict[str, Any]:
        reply = self.call("get", session_id)
        assert reply.status == 200, reply.body
        document: dict[str, Any] = json.loads(reply.body)
        return document

    def samples(self, session_id: str, body: Any = None) -> dict[str, Any]:
        reply = self.call("samples", session_id, body)
        assert reply.status == 200, reply.body
        return decode_samples_payload(reply.body)

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.run_until_complete(self.core.aclose())
            # Memory trims the core started in the background end before their loop does.
            pending = asyncio.all_tasks(self.loop)
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=5))
            self.loop.close()


@pytest.fixture()
def make_core(engine: ServerProcess) -> Iterator[Any]:
    cores: list[Core] = []

    def make(settings: SessionSettings = TREE, store: RecordsStore | None = None) -> Core:
        core = Core(engine.url, settings, store)
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.close()


def assistant_of(reply: CoreReply) -> dict[str, Any]:
    message = json.loads(reply.body)["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


def start() -> Messages:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Begin the task."},
    ]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def tool(text: str) -> dict[str, str]:
    return {"role": "tool", "content": text}


def error_of(reply: CoreReply) -> str:
    message: str = json.loads(reply.body)["error"]
    return message


def canonical_ids(messages: Messages) -> list[int]:
    """What the chat template renders for a finished conversation, up to where sampling
    stopped (the newline the template puts after the last `<|im_end|>` was never sampled)."""
    ids = TOKENIZER.apply_chat_template(messages, add_generation_prompt=False)
    last = len(ids) - 1 - ids[::-1].index(EOT)
    return ids[: last + 1]


def leaf_ids(document: dict[str, Any]) -> list[int]:
    return [s["metadata"]["leaf"]["node_id"] for s in document["samples"]]


def nodes_of(session: dict[str, Any]) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = session["metadata"]["tree"]["nodes"]
    return nodes


# -- the framework's facts -------------------------------------------------------------------


def test_framework_constants_and_default_picker_rule() -> None:
    # miles/rollout/session/v2/tree_trajectory.py: MAX_NODES = 1024 per session.
    assert MAX_NODES == 1024
    # miles/rollout/session/v2/picker_hub/drop_retries.py: its docstring's example, turn 2
    # cut off and re-sent: seq 1 (a leaf with the later sibling seq 2) is trimmed; survivors
    # by checkpoint count, then seq, both descending.
    nodes = [
        {"id": 0, "parent": None},
        {"id": 1, "parent": 0},
        {"id": 2, "parent": 0},
        {"id": 3, "parent": 2},
        {"id": 4, "parent": None},  # a root leaf with no later sibling: kept
    ]
    paths = {1: [0, 1], 3: [0, 2, 3], 4: [4]}
    samples = [
        Sample(
            tokens=[],
            response="",
            response_length=0,
            loss_mask=bytearray(),
            rollout_log_probs=array("d"),
            status="completed",
            metadata={"leaf": {"node_id": leaf, "parent": nodes[leaf]["parent"],
                               "path_node_ids": path}},
        )
        for leaf, path in paths.items()
    ]  # fmt: skip
    kept = drop_retries(samples, {"tree": {"nodes": nodes}})
    assert [s.metadata["leaf"]["node_id"] for s in kept] == [3, 4]


# -- the must-haves of the issue ---------------------------------------------------------------


def test_retry_then_continue_drops_the_abandoned_attempt(make_core: Any) -> None:
    core = make_core()
    sid = core.new_session()
    first = core.turn(sid, start())
    asked = [*first, tool("result one")]
    # The attempt is cut off at the length cap; the agent re-sends the same messages.
    attempt = core.chat(sid, asked, max_tokens=2)
    assert attempt.status == 200 and json.loads(attempt.body)["choices"][0]["finish_reason"] == (
        "length"
    )
    retried = core.turn(sid, asked, seed=7)
    final = core.turn(sid, [*retried, tool("result two")])

    session = core.get(sid)
    assert [(n["id"], n["parent"]) for n in nodes_of(session)] == [
        (0, None),
        (1, 0),
        (2, 0),
        (3, 2),
    ]
    assert [n["finish_reason"] for n in nodes_of(session)][:2] == ["stop", "length"]
    # GET is the active path: the latest node's (0 -> 2 -> 3), token-exact.
    assert session["metadata"]["num_turns"] == 3
    assert session["metadata"]["tree"]["active"] == 3
    assert session["metadata"]["accumulated_token_ids"] == canonical_ids(final)
    assert session["metadata"]["tito_session_mismatch"] == []
    attempt_prompt = core.get(sid)["records"][1]["request"]["input_ids"]
    assert (
        attempt_prompt[: nodes_of(session)[0]["checkpoint_len"]]
        == (session["metadata"]["accumulated_token_ids"][: nodes_of(session)[0]["checkpoint_len"]])
    )

    picked = core.samples(sid)
    assert leaf_ids(picked) == [3]  # the cut-off attempt (node 1) is an abandoned retry
    assert picked["samples"][0]["tokens"] == canonical_ids(final)
    assert picked["samples"][0]["status"] == "completed"
    assert session["metadata"]["tree"]["leaves"] == [
        {"node_id": 1, "path_node_ids": [0, 1]},
        {"node_id": 3, "path_node_ids": [0, 2, 3]},
    ]


def test_fork_into_two_live_branches_gives_two_samples(make_core: Any) -> None:
    core = make_core()
    sid = core.new_session()
    root = core.turn(sid, start())
    branch_a = core.turn(sid, [*root, user("Plan A.")])
    branch_b = core.turn(sid, [*root, user("Plan B.")])
    # Both branches go on: neither is an abandoned retry.
    branch_a = core.turn(sid, [*branch_a, tool("A went fine")])
    branch_b = core.turn(sid, [*branch_b, tool("B went fine")])
    session = core.get(sid)
    assert [(n["id"], n["parent"]) for n in nodes_of(session)] == [
        (0, None),
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 2),
    ]
    assert session["metadata"]["tree"]["leaves"] == [
        {"node_id": 3, "path_node_ids": [0, 1, 3]},
        {"node_id": 4, "path_node_ids": [0, 2, 4]},
    ]
    payload = core.call("samples", sid).body
    document = decode_samples_payload(payload)
    check_with_safetensors(payload, document)  # the reference writer gives the same bytes
    # miles/rollout/session/samples/codec.py: the v2 wire's JSON fields, `reward` last.
    wire = json.loads(bytes(read_safetensors_file(payload)[0]["_samples_meta"].data))
    assert list(wire["samples"][0]) == [
        "response",
        "response_length",
        "status",
        "weight_versions",
        "prefix_cache_info",
        "metadata",
        "reward",
        "nulls",
    ]
    # Same depth: the later commit first (the framework's drop_retries order).
    assert leaf_ids(document) == [4, 3]
    by_leaf = {s["metadata"]["leaf"]["node_id"]: s for s in document["samples"]}
    assert by_leaf[3]["tokens"] == canonical_ids(branch_a)
    assert by_leaf[4]["tokens"] == canonical_ids(branch_b)
    # default_postprocess: the shared root completion is trained only in the earliest
    # committed kept leaf (3); leaf 4 keeps it with loss mask 0.
    start_, end = nodes_of(session)[0]["completion_span"]
    for leaf, owned in ((3, 1), (4, 0)):
        sample = by_leaf[leaf]
        response_start = len(sample["tokens"]) - sample["response_length"]
        assert start_ == response_start  # the root's completion opens the response
        assert set(sample["loss_mask"][: end - start_]) == {owned}
        assert sum(sample["loss_mask"]) > 0


def test_resume_from_turn_one_of_a_five_turn_path(make_core: Any) -> None:
    core = make_core()
    sid = core.new_session()
    messages = start()
    history: list[Messages] = []
    for turn in range(5):
        messages = core.turn(sid, messages)
        history.append(messages)
        messages = [*messages, tool(f"result {turn}")]
    resumed = core.turn(sid, [*history[0], user("Start over from here.")])
    session = core.get(sid)
    assert nodes_of(session)[-1] == {
        **nodes_of(session)[-1],
        "id": 5,
        "parent": 0,
        "seq": 5,
    }
    assert session["metadata"]["num_turns"] == 2  # the active path is 0 -> 5
    assert session["metadata"]["accumulated_token_ids"] == canonical_ids(resumed)
    document = core.samples(sid)
    assert leaf_ids(document) == [4, 5]  # longer path first
    assert document["samples"][0]["tokens"] == canonical_ids(history[4])
    assert document["samples"][1]["tokens"] == canonical_ids(resumed)

    # The same request on a linear session is a deep rollback: a 400 that changes nothing.
    linear = make_core(SessionSettings(max_rollback_steps=1))
    lid = linear.new_session()
    messages = start()
    first: Messages = []
    for turn in range(5):
        messages = linear.turn(lid, messages)
        first = first or messages
        messages = [*messages, tool(f"result {turn}")]
    refused = linear.chat(lid, [*first, user("Start over from here.")])
    assert refused.status == 400 and "only 1 is allowed" in error_of(refused)
    assert "tree" not in linear.get(lid)["metadata"]


def test_every_leaf_is_token_exact_against_a_canonical_render(make_core: Any) -> None:
    """Retries, forks, a resume and a new root in one session; every leaf's sample is the
    chat template's render of its path, and the loss mask covers exactly what was sampled."""
    core = make_core(KEEP_ALL)
    sid = core.new_session()
    ends: dict[int, Messages] = {}

    def go(messages: Messages, **extra: Any) -> Messages:
        done = core.turn(sid, messages, **extra)
        ends[len(ends)] = done
        return done

    root = go(start())
    a = go([*root, tool("a")])
    go([*root, tool("a")], seed=3)  # a retry of the same step
    a2 = go([*a, user("deeper")])
    go([*a2, tool("deepest")])
    go([*root, user("another idea")])
    go([*a, user("a sibling of a2")])
    go([{"role": "user", "content": "A different task entirely."}])  # a new root
    session = core.get(sid)
    table = nodes_of(session)
    leaves = {
        leaf["node_id"]: leaf["path_node_ids"] for leaf in session["metadata"]["tree"]["leaves"]
    }
    assert sorted(leaves) == [2, 4, 5, 6, 7]
    assert table[7]["parent"] is None
    document = core.samples(sid)
    assert sorted(leaf_ids(document)) == sorted(leaves)
    for sample in document["samples"]:
        leaf = sample["metadata"]["leaf"]["node_id"]
        tokens = sample["tokens"]
        assert tokens == canonical_ids(ends[leaf]), leaf
        assert sample["metadata"]["accumulated_token_ids"] == tokens
        assert sample["metadata"]["tito_session_mismatch"] == []
        assert sample["metadata"]["leaf"]["path_node_ids"] == leaves[leaf]
        # Loss mask 1 exactly on every path node's completion, 0 between them.
        response_start = len(tokens) - sample["response_length"]
        expected = [0] * sample["response_length"]
        for node_id in leaves[leaf]:
            lo, hi = table[node_id]["completion_span"]
            expected[lo - response_start : hi - response_start] = [1] * (hi - lo)
        assert sample["loss_mask"] == expected, leaf
        # R3: one row per token but the last.
        shape, _ = sample["rollout_routed_experts"]
        assert shape == (len(tokens) - 1, LAYERS, TOPK)
    # Each node's prompt extends its parent's checkpoint (checked on the active path).
    previous: list[int] = []
    for record in core.get(sid)["records"]:
        assert record["request"]["input_ids"][: len(previous)] == previous


def test_hooks_that_fail_are_a_422_naming_the_hook(make_core: Any) -> None:
    base = TREE
    cases = {
        "pick": (f"{__name__}:raising_hook", "tree pick hook", "RuntimeError: policy bug"),
        "pick-not-subset": (f"{__name__}:foreign_sample_pick", "tree pick hook", "subset"),
        "pick-duplicates": (f"{__name__}:duplicating_pick", "tree pick hook", "duplicate"),
        "pick-not-list": (f"{__name__}:none_hook", "tree pick hook", "got NoneType"),
        "post": (f"{__name__}:raising_hook", "tree postprocess hook", "policy bug"),
        "post-bad-mask": (f"{__name__}:short_mask_post", "tree postprocess hook", "loss_mask"),
        "post-not-sample": (f"{__name__}:dict_post", "tree postprocess hook", "not a Sample"),
        "post-bad-json": (f"{__name__}:unencodable_post", "tree postprocess hook", "encoded"),
    }
    for case, (hook, label, why) in cases.items():
        if case.startswith("pick"):
            settings = replace(base, tree_pick_hook=hook)
        else:
            settings = replace(base, tree_postprocess_hook=hook)
        core = make_core(settings)
        sid = core.new_session()
        first = core.turn(sid, start())
        reply = core.call("samples", sid)
        assert reply.status == 422, (case, reply.status, reply.body)
        message = error_of(reply)
        assert f"{label} {hook!r}" in message and why in message, (case, message)
        if case.startswith("pick"):  # the trajectory export runs the pick hook too
            trajectory = core.call("trajectory", sid)
            assert trajectory.status == 422 and label in error_of(trajectory), case
        # The session is untouched and keeps serving.
        core.turn(sid, [*first, user("more")])


def raising_hook(samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    raise RuntimeError("policy bug")


def foreign_sample_pick(samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    return [replace(samples[0])]


def duplicating_pick(samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    return [samples[0], samples[0]]


def none_hook(samples: list[Sample], metadata: dict[str, Any]) -> None:
    return None


def short_mask_post(samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    samples[0].loss_mask = bytearray(1)
    return samples


def dict_post(samples: list[Sample], metadata: dict[str, Any]) -> list[Any]:
    return [{"tokens": []}]


def unencodable_post(samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    samples[0].metadata["oops"] = object()
    return samples


def reward_pick(samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    """A custom picker in the framework's shape: keep only the leaves the agent rewarded."""
    wanted = set(metadata["agent"]["leaves"])
    return [s for s in samples if s.metadata["leaf"]["node_id"] in wanted]


async def async_hook(samples: list[Sample], metadata: dict[str, Any]) -> list[Sample]:
    return samples


def test_a_path_that_cannot_be_assembled_is_a_422_naming_the_leaf(make_core: Any) -> None:
    core = make_core(replace(TREE, r3_topk=0))  # R3 recorded, but its top-k unknown
    sid = core.new_session()
    root = core.turn(sid, start())
    core.turn(sid, [*root, user("x")])
    reply = core.call("samples", sid)
    assert reply.status == 422
    message = error_of(reply)
    assert message.startswith("tree leaf 1 (path [0, 1]): ") and "--r3-topk" in message
    # The trajectory carries R3 flat then ([T-1, L*K]), as a linear session's does.
    assert core.call("trajectory", sid).status == 200


def test_hooks_are_checked_when_loaded(tmp_path: Path) -> None:
    assert load_hook("pick", "drop_retries").function is drop_retries
    assert load_hook("pick", f"{__name__}:reward_pick").function is reward_pick
    assert load_hook("pick", f"{__name__}.reward_pick").function is reward_pick
    for name, why in (
        ("nope", "unknown tree pick hook 'nope'"),
        ("no_such_module_xyz:f", "could not be loaded"),
        (f"{__name__}:missing", "could not be loaded"),
        (f"{__name__}:async_hook", "synchronous callable"),
        (f"{__name__}:TREE", "synchronous callable"),
    ):
        with pytest.raises(ValueError, match=why):
            load_hook("pick", name)
    with pytest.raises(ValueError, match="drop_retries, keep_all"):
        load_hook("pick", "")
    # A core refuses to start with a bad hook (before serving anything).
    with pytest.raises(ValueError, match="tree postprocess hook"):
        SessionCore(
            TOKENIZER,
            EnginePool(["http://127.0.0.1:9"], timeout=1),
            replace(TREE, tree_postprocess_hook="nope"),
        )


def test_custom_picker_and_agent_metadata_reward(make_core: Any) -> None:
    core = make_core(replace(TREE, tree_pick_hook=f"{__name__}:reward_pick"))
    sid = core.new_session()
    root = core.turn(sid, start())
    core.turn(sid, [*root, user("one")])
    core.turn(sid, [*root, user("two")])
    document = core.samples(sid, {"metadata": {"leaves": [1], "reward": 0.5, "note": "n"}})
    assert leaf_ids(document) == [1]
    sample = document["samples"][0]
    assert sample["reward"] == 0.5 and sample["metadata"]["note"] == "n"
    assert document["session_metadata"]["agent"]["reward"] == 0.5
    assert list(document["session_metadata"])[:4] == [
        "tito_session_mismatch",
        "accumulated_token_ids",
        "max_trim_tokens",
        "tree",
    ]
    bad = core.call("samples", sid, {"metadata": [1]})
    assert bad.status == 400 and "'metadata'" in error_of(bad)
    # Without the agent's reward the wire still carries the field (null keeps the trainer's).
    plain = core.samples(sid, {"metadata": {"leaves": [1, 2]}})
    assert [s["reward"] for s in plain["samples"]] == [None, None]


def test_extending_a_length_cut_path_is_a_409(make_core: Any) -> None:
    core = make_core()
    sid = core.new_session()
    cut = core.turn(sid, start(), max_tokens=2)
    before = core.get(sid)
    assert nodes_of(before)[0]["finish_reason"] == "length"
    reply = core.chat(sid, [*cut, user("go on")])
    assert reply.status == 409
    message = error_of(reply)
    assert "node 0" in message and "length" in message and "cannot be extended" in message
    assert core.get(sid) == before  # nothing changed
    # Retrying from before the cut is fine: a sibling of the cut node.
    core.turn(sid, start(), seed=5)
    assert [(n["id"], n["parent"]) for n in nodes_of(core.get(sid))] == [(0, None), (1, None)]


def test_node_cap_is_a_409_naming_the_limit(
    make_core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real cap of 1024 would take 1024 upstream turns; the rule is the same at 3.
    monkeypatch.setattr(tree_module, "MAX_NODES", 3)
    core = make_core()
    sid = core.new_session()
    root = core.turn(sid, start())
    core.turn(sid, [*root, user("b1")])
    # Two concurrent turns for the last place: the first one in flight holds it.
    both = core.concurrently(sid, [{"messages": [*root, user(f"b{i}")]} for i in (2, 3)])
    assert [r.status for r in both] == [200, 409]
    assert "1 turns in flight" in error_of(both[1])
    assert len(nodes_of(core.get(sid))) == 3
    refused = core.chat(sid, [*root, user("b4")])
    assert refused.status == 409
    message = error_of(refused)
    assert "holds 3 tree nodes" in message and "3 per session (MAX_NODES)" in message
    assert len(nodes_of(core.get(sid))) == 3


def test_twins_tie_on_depth_and_the_latest_commit_wins(make_core: Any) -> None:
    # miles/rollout/session/v2/tree_trajectory.py, find_attach_point: ties on depth (twins
    # whose deltas both match) go to the latest seq. The mock engine is deterministic, so a
    # plain re-send produces a twin with the very same reply.
    core = make_core()
    sid = core.new_session()
    root = core.turn(sid, start())
    asked = [*root, tool("r")]
    first = core.turn(sid, asked)
    twin = core.turn(sid, asked)
    assert first == twin
    core.turn(sid, [*twin, user("next")])
    assert [(n["id"], n["parent"]) for n in nodes_of(core.get(sid))] == [
        (0, None),
        (1, 0),
        (2, 0),
        (3, 2),
    ]


def test_concurrent_turns_at_one_node_become_siblings(make_core: Any) -> None:
    core = make_core()
    sid = core.new_session()
    root = core.turn(sid, start())
    replies = core.concurrently(sid, [{"messages": [*root, user(f"try {i}")]} for i in range(3)])
    assert [r.status for r in replies] == [200, 200, 200]
    assert all(("x-sessiongate-recorded", "true") in r.headers for r in replies)
    assert [n["parent"] for n in nodes_of(core.get(sid))] == [None, 0, 0, 0]


def test_relayed_streams_branch_like_whole_turns(make_core: Any) -> None:
    core = make_core(replace(TREE, stream_upstream="relay"))
    sid = core.new_session()
    root = core.turn(sid, start())
    for text in ("a", "b"):
        reply = core.chat(sid, [*root, user(text)], stream=True)
        assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n"), reply.body
    session = core.get(sid)
    assert [n["parent"] for n in nodes_of(session)] == [None, 0, 0]
    assert session["metadata"]["tito_session_mismatch"] == []
    assert nodes_of(session)[2]["response_id"] != ""


def test_get_trajectory_and_linear_default(make_core: Any) -> None:
    core = make_core(replace(TREE, tree_pick_hook="keep_all"))
    sid = core.new_session()
    root = core.turn(sid, start())
    first = core.turn(sid, [*root, user("one")])
    core.turn(sid, [*root, user("two")])
    session = core.get(sid)
    assert set(nodes_of(session)[0]) >= {
        "id",
        "parent",
        "seq",
        "checkpoint_len",
        "finish_reason",
        "completion_span",
        "response_id",
    }
    assert [r["request"]["messages"][-1]["content"] for r in session["records"]] == [
        "Begin the task.",
        "two",
    ]
    assert nodes_of(session)[1]["checkpoint_len"] == len(canonical_ids(first))
    assert nodes_of(session)[1]["response_id"]  # the reply's id, the agent's join key

    reply = core.call("trajectory", sid)
    assert reply.status == 200
    tensors, header = read_safetensors_file(reply.body)
    leaves = json.loads(header["leaves"])
    assert header["session_mode"] == "tree"
    assert [leaf["node_id"] for leaf in leaves] == [1, 2]  # keep_all: commit order
    ids = bytes(tensors["token_ids.0"].data)
    assert list(memoryview(ids).cast("i")) == canonical_ids(first)
    assert tensors["routed_experts.1"].shape[1:] == (LAYERS, TOPK)
    assert json.loads(header["tree"])["nodes"][2]["parent"] == 0

    # The default is still linear: no tree, the records are the line.
    assert SessionSettings().session_mode == "linear"
    linear = make_core(SessionSettings())
    lid = linear.new_session()
    linear.turn(lid, start())
    assert "tree" not in linear.get(lid)["metadata"]


def test_addition_r3_asks_for_rows_since_the_branch_point(make_core: Any) -> None:
    """Each turn asks for rows from its attach node's checkpoint length - 1, and every
    leaf's R3 is byte-identical to what full R3 gives for the same tree."""
    leaves_r3 = {}
    for addition in (True, False):
        core = make_core(replace(KEEP_ALL, r3_addition=addition))
        sid = core.new_session()
        root = core.turn(sid, start())
        deeper = core.turn(sid, [*root, tool("a")])
        core.turn(sid, [*deeper, user("b")])
        core.turn(sid, [*root, user("fork")])  # attaches at node 0
        session = core.get(sid)
        table = nodes_of(session)
        if addition:
            # The active path is 0 -> 3: the fork asked for rows from node 0's end.
            fork_request = session["records"][1]["request"]
            assert fork_request["routed_experts_start_len"] == table[0]["checkpoint_len"] - 1
        document = core.samples(sid)
        leaves_r3[addition] = {
            s["metadata"]["leaf"]["node_id"]: s["rollout_routed_experts"]
            for s in document["samples"]
        }
        assert sorted(leaves_r3[addition]) == [2, 3]
    assert leaves_r3[True] == leaves_r3[False]


def test_tree_recovers_from_the_records_dir_byte_for_byte(make_core: Any, tmp_path: Path) -> None:
    store_dir = tmp_path / "records"
    settings = replace(TREE, r3_addition=True)
    core = make_core(settings, RecordsStore(StoreSettings(store_dir)))
    sid = core.new_session()
    root = core.turn(sid, start())
    a = core.turn(sid, [*root, tool("a")])
    core.turn(sid, [*root, tool("a")], seed=9)  # a retry
    core.turn(sid, [*a, user("on")], max_tokens=2)  # cut off: a truncated leaf
    core.turn(sid, [*root, user("fork")])
    # The store's RAM budget is 0: every node's record was replaced by one read from the file.
    assert all(isinstance(r, SpilledRecord) for r in core.core.sessions[sid].records)
    before = {op: core.call(op, sid).body for op in ("get", "samples", "trajectory")}
    core.close()

    # A restart (a linear-mode server: the session keeps its own mode).
    again = make_core(SessionSettings(r3=True, r3_topk=TOPK, r3_addition=True),
                      RecordsStore(StoreSettings(store_dir)))  # fmt: skip
    assert again.core.store is not None and again.core.store.recovery.turns == 5
    after = {op: again.call(op, sid).body for op in before}
    assert after == before
    assert again.core.sessions[sid].tree is not None
    assert again.core.sessions[again.new_session()].tree is None  # new ones are linear here
    # The recovered tree takes new turns anywhere, including on its truncated path's parent.
    again.turn(sid, [*a, user("on, again")])
    reply = again.chat(sid, [*core_cut_path(again, sid), user("go on")])
    assert reply.status == 409
    assert [(n["id"], n["parent"]) for n in nodes_of(again.get(sid))][-1] == (5, 1)


def core_cut_path(core: Core, sid: str) -> Messages:
    """The messages of the session's truncated node 3 (root -> 1 -> 3), from its records."""
    session = core.get(sid)
    assert nodes_of(session)[3]["finish_reason"] == "length"
    records = core.core.sessions[sid].records
    request = json.loads(records[3].request)
    reply = json.loads(records[3].response)["choices"][0]["message"]
    return [*request["messages"], {"role": "assistant", "content": reply["content"]}]


def test_session_mode_options_round_trip() -> None:
    from sessiongate.cli import build_parser
    from sessiongate.config.fields import ConfigError
    from sessiongate.config.gateway import GatewayConfig
    from sessiongate.server.serve import serve_config

    def parsed(*argv: str) -> SessionsConfig:
        return serve_config(build_parser().parse_args(["serve", *argv])).sessions

    assert session_mode_settings(parsed()) == {
        "session_mode": "linear",
        "tree_pick_hook": "drop_retries",
        "tree_postprocess_hook": "default_postprocess",
    }
    args = parsed("--session-mode", "tree", "--tree-pick-hook", f"{__name__}:reward_pick")
    forwarded = GatewayConfig.from_dict(
        {"sessions": GatewayConfig(sessions=args).to_dict()["sessions"]}
    )
    assert session_mode_settings(forwarded.sessions) == session_mode_settings(args)
    assert session_mode_settings(args)["session_mode"] == "tree"
    with pytest.raises(SystemExit, match="--tree-pick-hook: unknown tree pick hook"):
        session_mode_settings(parsed("--tree-pick-hook", "nope"))
    with pytest.raises(SystemExit):
        parsed("--session-mode", "forest")
    with pytest.raises(ConfigError, match="session_mode"):
        GatewayConfig.from_dict({"sessions": {"session_mode": "forest"}})


def test_first_messages_that_differ_start_a_new_root_and_strict_matching_holds(
    make_core: Any,
) -> None:
    core = make_core()
    sid = core.new_session()
    root = core.turn(sid, start())
    second = core.turn(sid, [*root, tool("r")])
    # An echo that edits the second assistant's text does not match node 1: it attaches at
    # node 0, after which an assistant message may not be appended (400, nothing changes).
    edited = [*second[:-1], {"role": "assistant", "content": "something else"}, user("next")]
    refused = core.chat(sid, edited)
    assert refused.status == 400 and "role 'assistant'" in error_of(refused)
    # Nothing new after a node: 400, as in linear mode.
    assert core.chat(sid, second).status == 400
    # A first turn that differs (here the system prompt) starts a new root, rendered whole;
    # so does an edited first reply (it is history the client brings, like few-shot turns).
    core.turn(sid, [{"role": "system", "content": "Be verbose."}, user("Begin.")])
    core.turn(sid, [*root[:-1], {"role": "assistant", "content": "mine"}, user("next")])
    assert [n["parent"] for n in nodes_of(core.get(sid))] == [None, 0, None, None]


# -- end to end through `serve` (once `--session-mode` is plumbed into it) ---------------------


def _serve_has_session_mode() -> bool:
    import subprocess
    import sys

    help_text = subprocess.run(
        [sys.executable, "-m", "sessiongate", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return "--session-mode" in help_text


SERVE_TREE = pytest.mark.skipif(
    not _serve_has_session_mode(), reason="serve has no --session-mode yet"
)


@SERVE_TREE
def test_serve_tree_mode_with_a_worker_restart(tmp_path: Path) -> None:
    """`serve --workers 1 --session-mode tree --records-dir`: a fork and a retry over real
    HTTP, then the worker is SIGKILLed and its replacement serves the same tree."""
    import os
    import signal

    import httpx

    from support.procs import free_port
    from support.tcp_workers import eventually

    port = free_port()
    mock = "--completion-tokens 6 --completion-tokens-jitter 2 --r3-layers 3 --r3-topk 2"
    args = ["serve", "--port", str(port), "--workers", "1", "--session-mode", "tree"]
    args += ["--records-dir", str(tmp_path / "records"), "--r3", "--r3-topk", "2"]
    with ServerProcess([*args, "--mock-args", mock], port) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            sid = client.post("/sessions").json()["session_id"]

            def turn(messages: Messages, **extra: Any) -> Messages:
                reply = client.post(
                    f"/sessions/{sid}/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 16, **extra},
                )
                assert reply.status_code == 200, reply.text
                message = reply.json()["choices"][0]["message"]
                return [*messages, {k: v for k, v in message.items() if v is not None}]

            root = turn(start())
            turn([*root, user("a")])
            a = turn([*root, user("a")], seed=4)  # a retry: the first attempt is dropped
            turn([*a, tool("a went on")])
            b = turn([*root, user("b")])  # a fork
            turn([*b, tool("b went on")])
            before = [client.get(f"/sessions/{sid}").content]
            before.append(client.post(f"/sessions/{sid}/samples").content)
            document = decode_samples_payload(before[1])
            assert leaf_ids(document) == [5, 3]
            pid = client.get("/health").json()["workers"][0]["pid"]
            os.kill(pid, signal.SIGKILL)
            eventually(
                lambda: client.get("/health").json()["workers"][0].get("pid") not in (None, pid),
                "the worker restarted",
            )
            eventually(lambda: client.get("/health").status_code == 200, "healthy")
            after = [client.get(f"/sessions/{sid}").content]
            after.append(client.post(f"/sessions/{sid}/samples").content)
            assert after == before
