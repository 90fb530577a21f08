"""sessiongate's TITO against the rollout framework's own (`miles-tito-tokenizers`), for every
model family and every mock trajectory the package ships.

Each trajectory runs as a session through a real `sessiongate serve` in front of a replay
engine (tests/support/replay_engine.py) that answers every turn with the trajectory's
assistant message and the ids a model would have sampled, and records the prompt ids the
gateway sent. Those prompts must be what the package builds:

- turn 1: the package's full render, tokenized (`render_messages(..., add_generation_prompt=
  True, tools=...)`);
- every later turn: `get_tito_tokenizer(tok, family, allowed_append_roles=<the trajectory's
  roles>).merge_tokens(old, new, pretokenized, tools)`, `pretokenized` being the previous
  prompt (as the engine received it) plus the ids the engine sampled;
- a session resumed with the whole history as its first turn (assistant content null,
  tool-call arguments as JSON text, as an OpenAI client sends them): the package's render;
- the session's `tito_session_mismatch` (GET /sessions/{id}) has the entry types of the
  package's `create_comparator()` report on the same ids.

Families and templates: tests/support/peer_families.py (fixed templates are the package's
own files; rows that name the model's stock template use the test styles of
tests/support/family_templates.py: GLM47_STYLE for glm47, NEMOTRON3_STYLE for nemotron3,
KIMI_STYLE for kimi26, MINIMAX_STYLE for the minimax tool-only row, QWEN3_STYLE for
`default`); vocabularies: tests/support/peer_vocab.py. Thinking runs on and off where the
family's template has a switch (off: the model produced no reasoning, so no message has any).

One accepted difference is named, not hidden: tools reach the template as SGLang 0.5.23 dumps
them (`"defer_loading": null` ...), which sessiongate follows and the package's older copy
does not. The package's renders are made with SGLang's dump substituted
(tests/support/peer_expect.py says why), and `test_known_tool_difference` shows that this is
the only difference on turn 1. Skipped: only what the package itself refuses (no row of the
family allows the trajectory's appended roles).

One `serve` + one replay engine per deployment (family and template), all of its
trajectories as separate sessions through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from miles_tito_tokenizers.testing import mock_trajectories

from support.peer_expect import (
    FrameworkSide,
    Sampled,
    first_difference,
    known_tool_difference,
    split_turns,
    wire,
    without_reasoning,
)
from support.peer_families import (
    FAMILIES,
    Deployment,
    resolve,
    template_args,
)
from support.peer_vocab import VOCABULARIES
from support.procs import ServerProcess, free_port
from support.vocabularies import hf_tokenizer

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

TESTS_DIR = Path(__file__).resolve().parents[1]

# Every trajectory class the package's mock_trajectories defines (a class with MESSAGES).
TRAJECTORIES: list[type] = [
    value
    for value in vars(mock_trajectories).values()
    if isinstance(value, type) and hasattr(value, "MESSAGES")
]
assert len(TRAJECTORIES) == 17, [t.__name__ for t in TRAJECTORIES]


@dataclass(frozen=True)
class Case:
    family: str
    trajectory: type
    thinking: bool | None  # None: the template has no thinking switch
    deployment: Deployment | None  # None: the package refuses the trajectory's roles
    refusal: str = ""

    @property
    def id(self) -> str:
        name = self.trajectory.__name__.removesuffix("Trajectory")
        mode = "" if self.thinking is None else ("-think" if self.thinking else "-nothink")
        return f"{self.family}-{name}{mode}"

    def template_kwargs(self) -> dict[str, Any]:
        if self.thinking is None or self.deployment is None:
            return {}
        switch = self.deployment.thinking_switch
        assert switch is not None
        return {switch: self.thinking}

    def messages(self) -> list[dict[str, Any]]:
        messages = list(self.trajectory.MESSAGES)
        return without_reasoning(messages) if self.thinking is False else messages


def _cases() -> list[Case]:
    cases = []
    for family in FAMILIES:
        for trajectory in TRAJECTORIES:
            try:
                deployment, _ = resolve(family, trajectory.APPEND_ROLES)
            except ValueError as exc:
                cases.append(Case(family, trajectory, None, None, str(exc)))
                continue
            modes: list[bool | None] = [True, False] if deployment.thinking_switch else [None]
            cases.extend(Case(family, trajectory, t, deployment) for t in modes)
    # Grouped by deployment, so each serve runs once (Deployments stops the previous one).
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(
        cases,
        key=lambda c: (order[c.family], c.deployment.template_name if c.deployment else ""),
    )


CASES = _cases()


def _params(cases: list[Case]) -> list[Any]:
    """(case, mode) per test, a deployment's cases together: `live` (turn by turn) for every
    case, `resumed` (the whole history as the first turn) for trajectories of more than one
    turn (with one, it is the live session's turn 1). A trajectory the package refuses is
    one skipped `live` test."""
    params = []
    for case in cases:
        marks: list[Any] = []
        modes = ["live"]
        if case.deployment is not None and len(split_turns(case.trajectory.MESSAGES)) > 1:
            modes.append("resumed")
        params += [pytest.param(case, mode, id=f"{case.id}-{mode}", marks=marks) for mode in modes]
    return params


@dataclass
class Running:
    deployment: Deployment
    tokenizer: Any  # the package's PreTrainedTokenizerFast
    engine: ServerProcess
    gateway: ServerProcess
    client: httpx.Client

    def stop(self) -> None:
        self.client.close()
        for proc in (self.gateway, self.engine):
            proc.__exit__(None, None, None)


class Deployments:
    """Starts one deployment's engine and gateway on first use and keeps them while the
    (grouped) cases use it; a start failure is remembered and raised again for its cases."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.current: Running | None = None
        self.failed: dict[Deployment, str] = {}

    def get(self, deployment: Deployment) -> Running:
        if self.current is not None and self.current.deployment == deployment:
            return self.current
        self.close()
        if deployment in self.failed:
            raise RuntimeError(self.failed[deployment])
        try:
            self.current = self._start(deployment)
        except RuntimeError as exc:
            self.failed[deployment] = str(exc)
            raise
        return self.current

    def _start(self, deployment: Deployment) -> Running:
        family = deployment.family
        directory = self.root / f"{family}-{deployment.template_name}"
        VOCABULARIES[family](directory / "tokenizer", deployment.template_text)
        style_file = None
        if deployment.template_path is None and deployment.template_text is not None:
            style_file = directory / "template.jinja"
            style_file.write_text(deployment.template_text, encoding="utf-8")
        tokenizer = hf_tokenizer(directory / "tokenizer")
        port = free_port()
        engine = ServerProcess(
            ["--port", str(port)],
            port,
            module="support.replay_engine",
            env={"PYTHONPATH": str(TESTS_DIR)},
        ).__enter__()
        try:
            gateway_port = free_port()
            argv = [
                "serve",
                "--port",
                str(gateway_port),
                "--backend",
                engine.url,
                "--workers",
                "0",
                "--tokenizer",
                str(directory / "tokenizer"),
                "--tito-model",
                family,
                *template_args(deployment, style_file),
            ]
            gateway = ServerProcess(argv, gateway_port, timeout=60).__enter__()
        except BaseException:
            engine.__exit__(None, None, None)
            raise
        return Running(deployment, tokenizer, engine, gateway, httpx.Client(timeout=30))

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployments]:
    manager = Deployments(tmp_path_factory.mktemp("peer"))
    try:
        yield manager
    finally:
        manager.close()


def _session(
    run: Running,
    case: Case,
    requests: list[list[dict[str, Any]]],
    replies: list[Sampled],
) -> tuple[list[list[int]], dict[str, Any]]:
    """One session: the turns posted through the gateway. The prompts the engine received,
    and the session's metadata."""
    client, url, tools = run.client, run.gateway.url, case.trajectory.TOOLS
    created = client.post(f"{url}/sessions", json={})
    assert created.status_code == 200, created.text
    session = created.json()["session_id"]
    script = [{"message": r.message, "ids": r.ids, "texts": r.texts} for r in replies]
    loaded = client.post(f"{run.engine.url}/replay/{session}", json={"turns": script})
    assert loaded.status_code == 200, loaded.text
    try:
        for turn, messages in enumerate(requests):
            body: dict[str, Any] = {"model": "replay", "messages": [wire(m) for m in messages]}
            if tools:
                body["tools"] = tools
            if case.thinking is not None:
                body["chat_template_kwargs"] = case.template_kwargs()
            answer = client.post(f"{url}/sessions/{session}/v1/chat/completions", json=body)
            assert answer.status_code == 200, f"turn {turn + 1}: {answer.text[:2000]}"
        prompts = client.get(f"{run.engine.url}/replay/{session}").json()["prompts"]
        record = client.get(f"{url}/sessions/{session}")
        assert record.status_code == 200, record.text
        return prompts, record.json()["metadata"]
    finally:
        client.delete(f"{url}/sessions/{session}")


def _check_report(
    framework: FrameworkSide,
    case: Case,
    history: list[dict[str, Any]],
    prompts: list[list[int]],
    last: Sampled,
    metadata: dict[str, Any],
) -> tuple[list[str], str]:
    """`tito_session_mismatch` against the package's comparator on the same ids: the
    problems, and both reports' entry types (for the results table)."""
    accumulated = metadata["accumulated_token_ids"]
    problems = []
    if accumulated != prompts[-1] + last.ids:
        problems.append("accumulated_token_ids is not the last prompt + its sampled ids")
    ours = metadata["tito_session_mismatch"]
    theirs = framework.report(history, case.trajectory.TOOLS, accumulated)
    types = sorted({m["type"] for m in [*ours, *theirs]})
    # The requirement is the same entry types (both empty, or alike); the entries are the
    # framework's `Mismatch.to_dict()` (docs/api.md) and agree whole, so they are held to it.
    if ours != theirs:
        problems.append(f"tito_session_mismatch: sessiongate {ours!r}\n  package {theirs!r}")
    return problems, ",".join(types) or "none"


@pytest.mark.parametrize(("case", "mode"), _params(CASES))
def test_session(
    deployments: Deployments, case: Case, mode: str, request: pytest.FixtureRequest
) -> None:
    """The prompts sessiongate sends, and its mismatch report, are the package's."""
    if case.deployment is None:
        pytest.skip(f"the package refuses it: {case.refusal}")
    run = deployments.get(case.deployment)
    problems, types = (_live if mode == "live" else _resumed)(run, case)
    # Both reports' entry types, for the results table (a JUnit property).
    request.node.user_properties.append(("mismatch", types))
    assert not problems, "\n".join(problems)


def _live(run: Running, case: Case) -> tuple[list[str], str]:
    """Turn by turn: turn 1 is the package's render, each later turn its merge_tokens."""
    tools = case.trajectory.TOOLS
    framework = FrameworkSide(
        run.tokenizer, run.deployment, case.trajectory.APPEND_ROLES, case.template_kwargs()
    )
    turns = split_turns(case.messages())
    replies = [framework.sampled(request, assistant, tools) for request, assistant in turns]
    prompts, metadata = _session(run, case, [request for request, _ in turns], replies)
    assert len(prompts) == len(turns)

    problems = []
    for index, ((request, _), prompt) in enumerate(zip(turns, prompts, strict=True)):
        if index == 0:
            expected = framework.first_prompt(request, tools)
        else:
            old_request, old_assistant = turns[index - 1]
            pretokenized = prompts[index - 1] + replies[index - 1].ids
            expected = framework.merged_prompt(
                [*old_request, old_assistant], request, pretokenized, tools
            )
        if prompt != expected:
            diff = first_difference(run.tokenizer, expected, prompt)
            problems.append(f"turn {index + 1} of {len(turns)}: {diff}")
    last_request, last_assistant = turns[-1]
    history = [*last_request, last_assistant]
    report, types = _check_report(framework, case, history, prompts, replies[-1], metadata)
    return problems + report, types


def _resumed(run: Running, case: Case) -> tuple[list[str], str]:
    """The whole history as a session's first turn: the package's render."""
    turns = split_turns(case.messages())
    tools = case.trajectory.TOOLS
    framework = FrameworkSide(
        run.tokenizer, run.deployment, case.trajectory.APPEND_ROLES, case.template_kwargs()
    )
    request, assistant = turns[-1]
    reply = framework.sampled(request, assistant, tools)
    prompts, metadata = _session(run, case, [request], [reply])
    problems = []
    expected = framework.first_prompt(request, tools)
    if prompts[0] != expected:
        problems.append(first_difference(run.tokenizer, expected, prompts[0]))
    report, types = _check_report(framework, case, [*request, assistant], prompts, reply, metadata)
    return problems + report, types


# Templates that print each whole tool (`tool | tojson`), so the dump's tool-level
# `defer_loading` shows. The MiniMax fixed templates print `tool.function` only, the test
# styles no tools, and the DeepSeek encoders dump the tools again themselves.
PRINT_WHOLE_TOOLS = frozenset(
    {
        "qwen3_fixed.jinja",
        "qwen3.5_fixed.jinja",
        "qwen3_thinking_2507_and_next_fixed.jinja",
        "kimi_k25_fixed.jinja",
    }
)


def _tool_deployments() -> list[Any]:
    """Each deployment once, with its first trajectory that has tools."""
    seen: dict[Deployment, Case] = {}
    for case in CASES:
        if case.deployment is not None and case.trajectory.TOOLS:
            seen.setdefault(case.deployment, case)
    return [pytest.param(case, id=deployment.label) for deployment, case in seen.items()]


@pytest.mark.parametrize("case", _tool_deployments())
def test_known_tool_difference(tmp_path: Path, case: Case) -> None:
    """The accepted turn-1 difference, named: the package's own render differs from the
    render with SGLang 0.5.23's tool dump (what sessiongate and the engine use) by each
    tool's `"defer_loading": null` only, and only where the template prints whole tools."""
    assert case.deployment is not None
    family, tools = case.family, case.trajectory.TOOLS
    directory = VOCABULARIES[family](tmp_path / family, case.deployment.template_text)
    framework = FrameworkSide(
        hf_tokenizer(directory), case.deployment, case.trajectory.APPEND_ROLES, {}
    )
    request, _ = split_turns(case.trajectory.MESSAGES)[0]
    own = framework.tito.render_messages(request, add_generation_prompt=True, tools=tools)
    substituted = framework.render(request, tools, generation=True)
    assert (own != substituted) == (case.deployment.template_name in PRINT_WHOLE_TOOLS)
    assert known_tool_difference(framework.tito, request, tools) == substituted
