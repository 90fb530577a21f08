"""Load driver pieces without servers: workload generator, trace format, stats, SSE parsing."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys

import pytest

from sessiongate.loadgen.cli import _warmup
from sessiongate.loadgen.http import Exchange, _SseState
from sessiongate.loadgen.pacing import Pacing, drive
from sessiongate.loadgen.stats import Collector, percentile, summarize
from sessiongate.loadgen.trace import TraceError, TraceHeader, read_trace, write_trace
from sessiongate.loadgen.workload import SessionSpec, SyntheticOptions, SyntheticWorkload


def _shape(spec: SessionSpec) -> tuple[object, ...]:
    return (
        len(spec.turns),
        tuple(tuple(_shape(c) for c in t.children) for t in spec.turns),
    )


def _roots(n: int, **options: object) -> list[SessionSpec]:
    workload = SyntheticWorkload(SyntheticOptions(**options))  # type: ignore[arg-type]
    return [workload.root(i) for i in range(n)]


def test_synthetic_is_reproducible_and_prefix_stable():
    opts = {"seed": 7, "turns": 5, "turns_stddev": 2, "child_prob": 0.4, "fanout": 2, "depth": 2}
    a = _roots(12, **opts)
    b = _roots(30, **opts)[:12]
    assert [_shape(r) for r in a] == [_shape(r) for r in b]
    assert [r.turns[0].messages for r in a] == [r.turns[0].messages for r in b]
    other = _roots(12, **{**opts, "seed": 8})
    assert [r.turns[0].messages for r in a] != [r.turns[0].messages for r in other]
    # The iterator yields the same roots as root(i).
    it = iter(SyntheticWorkload(SyntheticOptions(**opts)))  # type: ignore[arg-type]
    assert [_shape(next(it)) for _ in range(12)] == [_shape(r) for r in a]


def test_synthetic_tree_rules():
    roots = _roots(40, turns=4, child_prob=0.5, fanout=3, depth=2, max_spawns=1, child_turns=2)
    saw_children = False
    for root in roots:
        for node, parent, parent_turn in root.walk():
            level = node.id.count(".")
            assert level <= 2
            spawning = [t for t in node.turns if t.children]
            assert len(spawning) <= 1  # max_spawns
            for turn in spawning:
                assert len(turn.children) == 3  # fanout
                saw_children = True
            if parent is not None:
                assert len(node.turns) == 2  # child_turns, stddev 0
                assert node in parent.turns[parent_turn].children
            else:
                assert len(node.turns) == 4
            if level == 2:
                assert not spawning  # depth limit
    assert saw_children


def test_synthetic_messages_and_lengths():
    root = _roots(1, turns=6, system_tokens=5, prompt_tokens=7, append_tokens=3,
                  append_messages=2, tool_ratio=1.0, max_tokens=9)[0]  # fmt: skip
    first = root.turns[0].messages
    assert [m["role"] for m in first] == ["system", "user"]
    assert len(first[0]["content"].split()) == 5
    for turn in root.turns[1:]:
        assert [m["role"] for m in turn.messages] == ["tool", "tool"]
        assert all(len(m["content"].split()) == 3 for m in turn.messages)
    assert {t.max_tokens for t in root.turns} == {9}


@pytest.mark.parametrize(
    "options",
    [{"turns": 0}, {"tool_ratio": 2}, {"fanout": 0}, {"append_messages": 0}, {"max_tokens": 0}],
)
def test_synthetic_rejects_bad_options(options):
    with pytest.raises(ValueError, match="--"):
        SyntheticWorkload(SyntheticOptions(**options))


def test_trace_round_trip_keeps_everything():
    roots = _roots(6, seed=3, turns=3, turns_stddev=1, child_prob=0.6, fanout=2, depth=2,
                   think_time=0.5, think_time_stddev=0.2, wait_children=False)  # fmt: skip
    out = io.StringIO()
    written = write_trace(out, roots, TraceHeader(tools=[{"type": "function"}], r3=True))
    assert written == sum(r.count()[0] for r in roots)
    header, again = read_trace(io.StringIO(out.getvalue()))
    assert header.r3 is True and header.tools == [{"type": "function"}]
    assert [_shape(r) for r in again] == [_shape(r) for r in roots]
    for a, b in zip(roots, again, strict=True):
        for (na, _, _), (nb, _, _) in zip(a.walk(), b.walk(), strict=True):
            assert na.id == nb.id
            for ta, tb in zip(na.turns, nb.turns, strict=True):
                assert (ta.messages, ta.max_tokens, ta.delay_s) == (
                    tb.messages,
                    tb.max_tokens,
                    tb.delay_s,
                )
                assert ta.wait_children == tb.wait_children or not ta.children


def test_trace_children_may_come_in_any_order():
    lines = [
        {"id": "c", "parent": "p", "parent_turn": 1, "turns": [{"messages": [{"role": "user"}]}]},
        {"id": "p", "turns": [{"messages": [{"role": "user", "content": "a"}]}] * 2},
    ]
    _, roots = read_trace(io.StringIO("\n".join(json.dumps(x) for x in lines) + "\n\n"))
    assert [r.id for r in roots] == ["p"]
    assert [c.id for c in roots[0].turns[1].children] == ["c"]
    assert roots[0].turns[0].max_tokens == 32  # default


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "line 1: not JSON"),
        ('{"turns": []}', "non-empty string 'id'"),
        ('{"id": "a", "turns": []}', "non-empty 'turns'"),
        ('{"id": "a", "turns": [{"messages": []}]}', "non-empty list"),
        ('{"id": "a", "turns": [{"messages": [{"content": "x"}]}]}', "string 'role'"),
        ('{"id": "a", "turns": [{"messages": [{"role": "user"}], "max_tokens": 0}]}', ">= 1"),
        ('{"id": "a", "turns": [{"messages": [{"role": "user"}], "colour": 1}]}', "unknown keys"),
        ('{"id": "a", "parent": "zz", "parent_turn": 0, "turns": [{"messages": [{"role": "u"}]}]}',
         "parent 'zz' is not in the trace"),
        ('{"id": "a", "parent": "a", "parent_turn": 0, "turns": [{"messages": [{"role": "u"}]}]}',
         "no root reaches"),
        ('{"id": "a", "turns": [{"messages": [{"role": "u"}]}]}\n{"sessiongate_trace": 1}',
         "header line must come before"),
    ],
)  # fmt: skip
def test_trace_errors_name_the_problem(text, message):
    with pytest.raises(TraceError, match=message):
        read_trace(io.StringIO(text))


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 90) == pytest.approx(90.0)


def _ex(kind: str, start: float, latency: float, status: int = 200, **kw: object) -> Exchange:
    ex = Exchange(kind=kind, started=start, latency_s=latency, status=status, **kw)  # type: ignore[arg-type]
    if status != 200:
        ex.error_key = str(status)
    return ex


def test_summary_counts_measured_requests_only():
    c = Collector(t0=0.0)
    ids = ("s", None, "s")
    c.add(_ex("chat", 0.0, 1.0, completion_tokens=100), session=ids, trace_id="s0", warmup=True)
    c.add(_ex("chat", 1.0, 0.5, completion_tokens=10, prompt_tokens=5), session=ids, trace_id="s1")
    c.add(_ex("chat", 1.5, 0.5, completion_tokens=10, prompt_tokens=5), session=ids, trace_id="s1")
    c.add(_ex("chat", 2.0, 0.1, status=502), session=ids, trace_id="s1")
    c.add(_ex("records", 2.0, 0.25, bytes_received=1000), session=ids, trace_id="s1")
    s = summarize(c)
    assert s["measured_s"] == pytest.approx(1.25)
    assert s["turns"] == {"sent": 3, "ok": 2, "per_s": pytest.approx(2 / 1.25, abs=1e-3)}
    assert s["tokens"]["completion"] == 20
    assert s["latency_ms"]["p50"] == pytest.approx(500.0)
    assert s["errors"]["by_status"] == {"502": 1}
    assert s["records_get"]["bytes_total"] == 1000
    assert s["warmup_requests"] == 1
    assert s["ttft_ms"] is None


def test_sse_state_accumulates_content_and_tool_calls():
    ex = Exchange(kind="chat", started=0.0)
    state = _SseState()
    call_1 = {"index": 0, "id": "c1", "function": {"name": "se", "arguments": '{"q"'}}
    call_2 = {"index": 0, "function": {"name": "arch", "arguments": ": 1}"}}
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "hello "}}]},
        {"choices": [{"delta": {"tool_calls": [call_1]}}]},
        {"choices": [{"delta": {"tool_calls": [call_2]}}]},
        {
            "choices": [{"delta": {}, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 9},
        },
    ]
    for event in events:
        state.feed(json.dumps(event), ex)
    state.feed("[DONE]", ex)
    assert state.done and state.first_token is not None
    message = state.message()
    assert message is not None
    assert message["content"] == "hello "
    assert message["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"q": 1}'}
    assert (ex.prompt_tokens, ex.completion_tokens) == (4, 9)


def test_warmup_and_pacing_arguments():
    assert _warmup("10") == (10, 0.0)
    assert _warmup("2.5s") == (0, 2.5)
    for bad in ("-1", "xs", "abc"):
        with pytest.raises(argparse.ArgumentTypeError):
            _warmup(bad)
    with pytest.raises(ValueError, match="--sessions or --duration"):
        Pacing().check()
    with pytest.raises(ValueError, match="--concurrency"):
        Pacing(sessions=1, concurrency=0).check()


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, capsys, tmp_path):
    from sessiongate.loadgen import cli
    from sessiongate.loadgen.plot import PlotUnavailable, require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(PlotUnavailable, match=r"pip install 'sessiongate\[plot\]'"):
        require_matplotlib()
    # The CLI refuses before sending anything (the URL has no server behind it).
    args = ["bench", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png")]
    assert cli.main(args) == 2
    assert "sessiongate[plot]" in capsys.readouterr().err


class _FakeTrees:
    """run_tree stand-in: records order, warm-up flags and the peak number in flight."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self.started: list[tuple[str, bool]] = []
        self.finished: list[str] = []
        self.in_flight = 0
        self.peak = 0

    async def __call__(self, spec: SessionSpec, warmup: bool) -> None:
        self.started.append((spec.id, warmup))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.hold_s)
        self.in_flight -= 1
        self.finished.append(spec.id)


def _workload() -> SyntheticWorkload:
    return SyntheticWorkload(SyntheticOptions(turns=1))


def test_pacing_concurrency_cap_and_warmup_phase():
    trees = _FakeTrees(hold_s=0.01)
    marks: list[int] = []
    pacing = Pacing(sessions=12, concurrency=3, warmup_sessions=4)
    asyncio.run(
        drive(_workload(), trees, pacing, on_measured=lambda: marks.append(len(trees.finished)))
    )
    assert [sid for sid, _ in trees.started] == [f"s{i}" for i in range(16)]
    assert [w for _, w in trees.started] == [True] * 4 + [False] * 12
    assert marks == [4]  # the measured phase began once every warm-up tree had finished
    assert trees.peak == 3
    assert len(trees.finished) == 16


def test_pacing_poisson_arrivals_and_duration():
    trees = _FakeTrees()
    asyncio.run(drive(_workload(), trees, Pacing(sessions=20, request_rate=500.0)))
    assert len(trees.finished) == 20  # unlimited concurrency: every arrival starts
    timed = _FakeTrees(hold_s=0.01)
    asyncio.run(drive(_workload(), timed, Pacing(duration_s=0.2, concurrency=2)))
    assert 0 < len(timed.started) == len(timed.finished)  # launches stop, in-flight finish
