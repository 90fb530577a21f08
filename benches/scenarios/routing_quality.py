"""Routing quality: which engine each request of an RL rollout lands on, and what it costs.

In a rollout the router's job is the engines' prefix-cache hit rate and their balance, not
microseconds: a GRPO group is n concurrent requests with the same prompt, and a re-prefilled
2,000-token prompt costs far more than any router. This bench sends one seeded workload,
identical for every arm, to four mock engines that model SGLang's cost (the step scheduler:
prefill time per uncached token, one decode step per running request; the prefix cache
filled when a prefill completes, per adapter and `extra_key`), and reads from the replies and
the engines what each arm did:

    python benches/scenarios/routing_quality.py                 # every variant, every arm
    python benches/scenarios/routing_quality.py --quick         # smaller, for a smoke run
    python benches/scenarios/routing_quality.py --variants grpo --arms sg:round_robin,client:rr
    python benches/scenarios/routing_quality.py --variants grpo --repeat 3   # medians of 3 runs

Variants: `grpo` (P prompts x n samples as n separate concurrent `/generate` calls: a shared
system prefix plus a unique part, lognormal lengths; several steps with `/flush_cache`
between them, as after a weight update), `multiturn` (agents extending their own prefix turn
by turn), `slow` (grpo with one engine at half speed), `lora` (grpo with a mix of adapters).

Arms: `sg:<policy>` (sessiongate `serve --workers 0 --policy <policy>`, each policy of its
configuration), `smg:<policy>` (the SGLang Model Gateway as sglang-router 0.3.2, in its own
venv: `SGLANG_ROUTER_PYTHON=/venv/bin/python`), `smg13:<arm>` (its successor smg 1.13, the
Shepherd Model Gateway, `smg launch`, in its own venv: `SMG_BIN=/venv/bin/smg` or
`SMG_PYTHON=/venv/bin/python`; arms `cache_aware`, `cache_aware_no_overload` (with
`--disable-worker-overload-protection`), `least_load`, `prefix_hash`, `power_of_two` and
`sticky` (`--sticky-sessions` over `least_load`), `manual` (`--policy manual --assignment-mode
min_load`, the key in the `x-smg-routing-key` header)), `client:rr` (the client alone, round robin
over the engines) and `client:lif` (the client alone with the rollout framework router's
rule: the engine with the fewest requests in flight). A peer whose venv is absent is
skipped with a message.

The rids have smg's request-id lineage shape, which `--sticky-sessions` reads as the routing
key (one `_r<n>` suffix, then one `_t<n>` suffix, stripped): `<run>-s<step>p<prompt>_r<n>`
for a GRPO sample (key: the group) and `<run>-a<agent>_t<turn>` for an agent's turn (key:
the agent). No other arm routes on the rid. Under concurrency `--sticky-sessions` does not
hold a new key's requests together (a GRPO group's samples arrive at once and are spread;
an agent's turns, one after the other, stay), so `smg13:manual`'s requests also carry the
key in the `x-smg-routing-key` header, which `--policy manual` pins at once; no other arm
is sent the header (sessiongate's `manual` and `consistent_hashing` would read it).

Under each variant's table: the oracle bound (the best hit rate a placement using every
engine could get on that workload, from the workload itself: `oracle_bound`) and the goals
for sessiongate's default arm (`sg:cache_aware`) against the best sglang-router and smg arm
(per figure): hit rate at least the best peer's and within 2% of the oracle (>= 0.98x),
makespan <= 0.95x the best peer's, work imbalance <= 1.15, and on multi-turn hit rate and
makespan at least as good as `client:rr`'s.

Figures per arm: prefix-cache hit rate (1 - the prompt tokens the engines prefilled over
the prompt tokens sent, from the engines' counters, so a router's own requests such as
sessiongate's sibling warm-ups are paid for; `reply_hit_rate` in the JSON is the replies'
`cached_tokens` over the prompt tokens, and `lost_tokens` for sessiongate's arms the prompt
tokens its cache_aware learned the engines had lost), re-prefilled tokens, the share of GRPO
groups kept on one engine, load imbalance (max/mean of per-engine work, prefilled plus
generated tokens, and of time-averaged in-flight from the engines' counters), mean step
makespan (wall), the busy
makespan (per step, the busiest engine's modelled step time, which leaves the host's own
CPU time out), and the router's added p50 on small idle requests. docs/performance.md,
"Routing quality", has the figures.

Each engine's prefix cache holds 200,000 tokens (`--cache-tokens`), more than any variant's
working set; smaller caches evict (least recently used first) and show what a router's
stale beliefs about them cost.

The engines' steps cost 100 us per uncached prompt token and 20 ms per decode step by
default (`--prefill-us-per-token`, `--decode-step-ms`): of the order of a large model on one
GPU, and enough for the engines' modelled time to outweigh the host's CPU time (four Python
engines, a router and this client on a few cores), which otherwise decides the makespan.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer import peer_python, smg_bin, started
from support.procs import ServerProcess, free_port

ENGINES = 4
VOCAB = (300, 7600)  # inside the built-in tokenizer's vocabulary (7,615 ids)
ADAPTERS = ("math", "code")
MULTITURN_NEW = 32  # tokens generated per agent turn (ignore_eos: exactly this many)
SMG_POLICIES = ("cache_aware", "round_robin", "power_of_two", "manual")
# smg 1.13 arms: name -> `smg launch` flags. `sticky`: --sticky-sessions pins a routing key
# (here the rid lineage: `<run>-s<step>p<prompt>` for a GRPO group, `<run>-a<agent>` for an
# agent) to the worker its first request went to; least_load places the keys, so the pin
# carries the affinity and the policy the balance.
SMG13_ARMS = {
    "cache_aware": ["--policy", "cache_aware"],
    "cache_aware_no_overload": ["--policy", "cache_aware", "--disable-worker-overload-protection"],
    "least_load": ["--policy", "least_load"],
    "prefix_hash": ["--policy", "prefix_hash"],
    "power_of_two": ["--policy", "power_of_two"],
    "sticky": ["--policy", "least_load", "--sticky-sessions"],
    "manual": ["--policy", "manual", "--assignment-mode", "min_load"],
}
# sessiongate arms beyond `sg:<policy>`: name -> `serve` flags (the rid lineage is the key).
SG_ARMS = {
    "cache_aware_no_hold": ["--policy", "cache_aware", "--no-hold-siblings"],
    "sticky": ["--policy", "least_load", "--sticky-sessions"],
    "cache_aware_sticky": ["--policy", "cache_aware", "--sticky-sessions"],
    "cache_aware_overload": ["--policy", "cache_aware", "--worker-overload-protection"],
}
# The smg 1.13 arms whose requests carry the group's (agent's) key in smg's routing-key
# header: `--sticky-sessions` does not hold a key's concurrent first requests together (a
# GRPO group's samples are spread; measured), `--policy manual` with the header does.
SMG13_KEY_HEADER = frozenset({"manual"})
ROUTING_KEY_HEADER = "x-smg-routing-key"
# The default arm and the peers the goals compare it with (docs/performance.md).
DEFAULT_ARM = "sg:cache_aware"
PEER_KINDS = ("smg", "smg13")


@dataclass
class Request:
    rid: str
    ids: list[int]
    max_new_tokens: int
    group: str
    adapter: str | None = None
    shared: int = 0  # leading tokens every request of the variant shares (the system prompt)


@dataclass
class Outcome:
    rid: str
    engine: int  # -1 until the engines' logs are read
    prompt: int
    cached: int
    generated: int
    latency: float
    output_ids: list[int] = field(default_factory=list)


@dataclass
class Workload:
    """Steps of concurrent requests; a step's requests go out together, steps one by one."""

    steps: list[list[Request]] = field(default_factory=list)
    # Multi-turn: each step is one turn of every agent, built from the previous replies.
    agents: int = 0
    turns: int = 0


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(count)]


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(rng.lognormvariate(0.0, sigma) * median)))


def grpo_workload(
    seed: int, steps: int, prompts: int, samples: int, *, adapters: Sequence[str] = ()
) -> Workload:
    rng = random.Random(seed)
    system = _tokens(rng, 600)
    work = Workload()
    for step in range(steps):
        batch = []
        for p in range(prompts):
            unique = _tokens(rng, _lognormal(rng, 700, 0.6, 64, 3000))
            adapter = adapters[rng.randrange(len(adapters))] if adapters else None
            group = f"s{step}p{p}"
            for s in range(samples):
                # `<group>_r<n>`: smg's rid lineage, the group's routing key under
                # --sticky-sessions (one `_r<n>` suffix stripped).
                ids = system + unique
                batch.append(Request(f"{group}_r{s}", ids, 16, group, adapter, len(system)))
        rng.shuffle(batch)  # samples of a group do not arrive back to back
        work.steps.append(batch)
    return work


# -- targets --------------------------------------------------------------------------------


_RUNS = itertools.count()


class Target:
    """Where requests go: a router URL, or the client picking an engine itself."""

    def __init__(
        self,
        name: str,
        engines: list[str],
        router: str | None,
        rule: str = "",
        key_header: bool = False,
    ) -> None:
        self.name, self.engines, self.router, self.rule = name, engines, router, rule
        self.key_header = key_header  # send the group's key in smg's routing-key header
        self.run = f"{name.replace(':', '-')}-{next(_RUNS)}"
        self._turn = itertools.count()
        self.in_flight = [0] * len(engines)

    def pick(self) -> tuple[str, int | None]:
        if self.router is not None:
            return self.router, None
        if self.rule == "lif":  # fewest in flight, lowest index first (the framework's min())
            index = min(range(len(self.engines)), key=self.in_flight.__getitem__)
        else:
            index = next(self._turn) % len(self.engines)
        return self.engines[index], index


async def send(client: httpx.AsyncClient, target: Target, request: Request) -> Outcome:
    url, index = target.pick()
    body: dict[str, Any] = {
        "input_ids": request.ids,
        "sampling_params": {"max_new_tokens": request.max_new_tokens, "ignore_eos": True},
        # Unique per arm: the engines' request logs say which engine served which rid.
        "rid": f"{target.run}-{request.rid}",
    }
    if request.adapter is not None:
        body["lora_path"] = request.adapter
    if index is not None:
        target.in_flight[index] += 1
    headers = {ROUTING_KEY_HEADER: f"{target.run}-{request.group}"} if target.key_header else {}
    started_at = time.perf_counter()
    try:
        reply = await client.post(f"{url}/generate", json=body, headers=headers)
    finally:
        if index is not None:
            target.in_flight[index] -= 1
    latency = time.perf_counter() - started_at
    reply.raise_for_status()
    document = reply.json()
    meta = document["meta_info"]
    return Outcome(
        f"{target.run}-{request.rid}",
        index if index is not None else -1,
        int(meta["prompt_tokens"]),
        int(meta.get("cached_tokens") or 0),
        int(meta["completion_tokens"]),
        latency,
        list(document.get("output_ids") or []),
    )


async def engine_of_rids(client: httpx.AsyncClient, engines: list[str]) -> dict[str, int]:
    """Which engine served each rid, from the engines' logs of their last requests."""
    served: dict[str, int] = {}
    for index, url in enumerate(engines):
        log = (await client.get(f"{url}/mock/requests")).json()["requests"]
        for body in log:
            rid = body.get("rid")
            if isinstance(rid, str):
                served[rid] = index
    return served


async def engine_stats(client: httpx.AsyncClient, engines: list[str]) -> list[dict[str, Any]]:
    return [(await client.get(f"{url}/mock/stats")).json() for url in engines]


async def flush(client: httpx.AsyncClient, engines: list[str]) -> None:
    for url in engines:
        for _ in range(50):  # an engine flushes only when idle (SGLang's rule)
            if (await client.post(f"{url}/flush_cache")).status_code == 200:
                break
            await asyncio.sleep(0.1)


async def run_arm(
    target: Target, workload: Workload, variant: str, seed: int
) -> dict[str, float | str]:
    # Idle connections are dropped before the engines' own keep-alive (uvicorn: 5 s) can
    # close them under a request sent on one: that race was a client ReadError, not a
    # router's fault.
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512, keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await flush(client, target.engines)
        outcomes: list[Outcome] = []
        sent: list[Request] = []
        makespans = []
        busy: list[float] = []  # per step: the busiest engine's modelled time
        before = await engine_stats(client, target.engines)
        start = before
        steps: Iterator[list[Request]]
        steps = (
            multiturn_steps(workload, outcomes, seed)
            if variant == "multiturn"
            else iter(workload.steps)
        )
        for step_index, batch in enumerate(steps):
            if step_index and variant != "multiturn":
                await flush(client, target.engines)  # a weight update between steps
            sent += batch
            t0 = time.perf_counter()
            outcomes += await asyncio.gather(*(send(client, target, r) for r in batch))
            makespans.append(time.perf_counter() - t0)
            now = await engine_stats(client, target.engines)
            busy.append(
                max(n["busy_us"] - b["busy_us"] for n, b in zip(now, before, strict=True)) / 1e6
            )
            before = now
            served = await engine_of_rids(client, target.engines)
            for outcome in outcomes:
                if outcome.engine < 0:
                    outcome.engine = served.get(outcome.rid, -1)
        after = await engine_stats(client, target.engines)
        added = await added_p50(client, target)
        lost = await lost_tokens(client, target)
    prefilled = [
        a["prefilled_tokens"] - b["prefilled_tokens"] for a, b in zip(after, start, strict=True)
    ]
    row = summarise(target, sent, outcomes, makespans, busy, after, added, prefilled)
    if lost is not None:
        row["lost_tokens"] = float(lost)
    return row


async def lost_tokens(client: httpx.AsyncClient, target: Target) -> int | None:
    """Prompt tokens a sessiongate arm's cache_aware learned lost from replies'
    `cached_tokens` (its `/metrics`), None for the other arms."""
    if target.router is None or not target.name.startswith("sg:"):
        return None
    text = (await client.get(f"{target.router}/metrics")).text
    counts = re.findall(r"^sessiongate_engine_prefix_lost_tokens_total\{[^}]*\} (\d+)$", text, re.M)
    return sum(int(n) for n in counts)


def multiturn_steps(
    workload: Workload, outcomes: list[Outcome], seed: int
) -> Iterator[list[Request]]:
    """Agents extending their own prefix: turn t's prompt is turn t-1's prompt, the ids the
    engine generated for it, and a new user message (read from `outcomes`, which the caller
    fills with each turn's replies before asking for the next turn)."""
    rng = random.Random(seed + 1)
    system = _tokens(rng, 400)
    prompts = {
        a: system + _tokens(rng, _lognormal(rng, 300, 0.5, 32, 1500))
        for a in range(workload.agents)
    }
    for turn in range(workload.turns):
        # `a<agent>_t<turn>`: smg's rid lineage (one `_t<n>` suffix stripped) keys the agent.
        yield [
            Request(f"a{a}_t{turn}", list(prompts[a]), MULTITURN_NEW, f"a{a}", None, len(system))
            for a in prompts
        ]
        replies = {o.rid.rpartition("-")[2]: o for o in outcomes}
        for a in prompts:
            reply = replies[f"a{a}_t{turn}"]
            prompts[a] += reply.output_ids + _tokens(rng, _lognormal(rng, 120, 0.5, 16, 600))


async def added_p50(client: httpx.AsyncClient, target: Target) -> float:
    """The router's added median on small idle requests (0 for the client-side arms)."""
    if target.router is None:
        return 0.0
    body = {"input_ids": [400, 401, 402], "sampling_params": {"max_new_tokens": 1}}

    async def timed(url: str) -> float:
        t0 = time.perf_counter()
        (await client.post(f"{url}/generate", json=body)).raise_for_status()
        return time.perf_counter() - t0

    direct, routed = [], []
    for _ in range(40):
        direct.append(await timed(target.engines[0]))
        routed.append(await timed(target.router))
    return (statistics.median(routed) - statistics.median(direct)) * 1000


def summarise(
    target: Target,
    sent: list[Request],
    outcomes: list[Outcome],
    makespans: list[float],
    busy: list[float],
    after: list[dict[str, Any]],
    added_ms: float,
    prefilled: list[int],
) -> dict[str, float | str]:
    """`prefilled`: the prompt tokens each engine prefilled during the run, the router's own
    requests (warm-ups) included. The hit rate and the work are counted from it, not from the
    replies' `cached_tokens`, so a warmed-up prompt's prefill is paid for where it ran."""
    prompt = sum(o.prompt for o in outcomes)
    cached = sum(o.cached for o in outcomes)
    work = [float(n) for n in prefilled]
    for o in outcomes:
        if o.engine >= 0:
            work[o.engine] += o.generated
    groups: dict[str, set[int]] = defaultdict(set)
    by_rid = {f"{target.run}-{r.rid}": r for r in sent}
    for o in outcomes:
        request = by_rid.get(o.rid)
        if request is not None:
            groups[request.group].add(o.engine)
    kept = sum(len(engines) == 1 for engines in groups.values()) / len(groups) if groups else 0.0
    in_flight = [a["in_flight_avg"] for a in after]
    return {
        "arm": target.name,
        "requests": len(outcomes),
        "hit_rate": 1 - sum(prefilled) / prompt if prompt else 0.0,
        "reply_hit_rate": cached / prompt if prompt else 0.0,
        "reprefilled": float(sum(prefilled)),
        "groups_on_one": kept,
        "work_imbalance": max(work) / statistics.mean(work) if any(work) else 0.0,
        "inflight_imbalance": max(in_flight) / statistics.mean(in_flight)
        if statistics.mean(in_flight)
        else 0.0,
        "makespan_s": statistics.mean(makespans),
        "busy_makespan_s": statistics.mean(busy),
        "added_p50_ms": added_ms,
        "unattributed": float(sum(o.engine < 0 for o in outcomes)),
    }


# -- the oracle bound and the goals ----------------------------------------------------------


@dataclass(frozen=True)
class Oracle:
    hit_rate: float
    prompt: int  # prompt tokens sent
    paid: int  # the fewest of them a placement using every engine must prefill
    rule: str
    one_engine: float  # the same with the shared prompt paid once: every group on one engine


def multiturn_requests(workload: Workload, seed: int) -> list[list[Request]]:
    """The multi-turn workload's requests, built as a run builds them, each reply being
    MULTITURN_NEW tokens (`ignore_eos`; the tokens' values do not change the lengths)."""
    outcomes: list[Outcome] = []
    steps = []
    for batch in multiturn_steps(workload, outcomes, seed):
        steps.append(batch)
        for r in batch:
            output = [VOCAB[0]] * r.max_new_tokens
            outcomes.append(Outcome(f"oracle-{r.rid}", -1, len(r.ids), 0, len(output), 0.0, output))
    return steps


def oracle_bound(variant: str, workload: Workload, seed: int) -> Oracle:
    """The best hit rate any router could get on this workload from these engines.

    Assumes: a request can reuse only what its own engine has cached, and never its last
    prompt token (SGLang recomputes it: `cached_tokens` <= prompt - 1); the cache never evicts
    (200,000 tokens per engine); a group's followers start after its first prefill. Every
    engine is used (a router that spreads the load must): the shared system prompt is paid
    once per engine, min(engines, groups) when there are fewer groups than engines, per
    adapter (the cache is per adapter) and, for GRPO, per step (the caches are flushed
    between steps). GRPO, slow, LoRA: each group's unique part is paid once, and each other
    sample of the group pays its one last token. Multi-turn: each agent's first turn pays its
    unique part, and each later turn what it adds to the previous turn's cached prompt and
    output (the new message, and the last output token, which never had its KV computed).
    The oracle ignores balance and time: it is the hit rate's bound, not a schedule."""
    if variant == "multiturn":
        steps = multiturn_requests(workload, seed)
        agents: dict[str, list[Request]] = defaultdict(list)
        for batch in steps:
            for r in batch:
                agents[r.group].append(r)
        shared = steps[0][0].shared
        paid = min(ENGINES, len(agents)) * shared
        extra = (min(ENGINES, len(agents)) - 1) * shared
        for turns in agents.values():
            paid += len(turns[0].ids) - turns[0].shared
            for before, now in itertools.pairwise(turns):
                paid += len(now.ids) - (len(before.ids) + before.max_new_tokens - 1)
        rule = (
            "each agent's unique prefill once; the system prompt once per engine; later turns "
            "pay the new message and the last output token"
        )
    else:
        steps = workload.steps
        paid = extra = 0
        for batch in steps:
            by_adapter: dict[str | None, dict[str, list[Request]]] = defaultdict(dict)
            for r in batch:
                by_adapter[r.adapter].setdefault(r.group, []).append(r)
            for groups in by_adapter.values():
                first = next(iter(groups.values()))[0]
                paid += min(ENGINES, len(groups)) * first.shared
                extra += (min(ENGINES, len(groups)) - 1) * first.shared
                for requests in groups.values():
                    paid += len(requests[0].ids) - requests[0].shared + len(requests) - 1
        rule = (
            "each group's unique prefill once; the system prompt once per engine per adapter "
            "per step; other samples pay their last token"
        )
    prompt = sum(len(r.ids) for batch in steps for r in batch)
    if not prompt:
        return Oracle(0.0, 0, 0, rule, 0.0)
    return Oracle(1 - paid / prompt, prompt, paid, rule, 1 - (paid - extra) / prompt)


def goals(
    variant: str, rows: list[dict[str, float | str]], oracle: Oracle
) -> list[tuple[str, bool | None, str]]:
    """The bench's goals for sessiongate's default arm: (goal, met or None when it cannot be
    judged, figures). The best peer is per figure, over every sglang-router and smg arm run."""
    by_arm = {str(row["arm"]): row for row in rows}
    ours = by_arm.get(DEFAULT_ARM)
    if ours is None:
        return [(f"{DEFAULT_ARM} was not run", None, "")]
    peers = [row for row in rows if str(row["arm"]).partition(":")[0] in PEER_KINDS]
    checks: list[tuple[str, bool | None, str]] = []
    hit, span = float(ours["hit_rate"]), float(ours["makespan_s"])
    if peers:
        best_hit = max(peers, key=lambda row: float(row["hit_rate"]))
        best_span = min(peers, key=lambda row: float(row["makespan_s"]))
        bh, bs = float(best_hit["hit_rate"]), float(best_span["makespan_s"])
        checks.append(
            (
                "hit rate >= best peer's",
                hit >= bh,
                f"{hit:.3f} vs {bh:.3f} ({best_hit['arm']})",
            )
        )
        checks.append(
            (
                "makespan <= 0.95x best peer's",
                span <= 0.95 * bs,
                f"{span:.2f} s vs {bs:.2f} s ({best_span['arm']}): {span / bs:.2f}x",
            )
        )
    else:
        checks.append(("against the best peer", None, "no sglang-router or smg arm ran"))
    checks.append(
        (
            "hit rate within 2% of the oracle",
            hit >= 0.98 * oracle.hit_rate,
            f"{hit:.3f} vs {oracle.hit_rate:.3f}: {hit / oracle.hit_rate:.3f}x"
            if oracle.hit_rate
            else "no oracle",
        )
    )
    imbalance = float(ours["work_imbalance"])
    checks.append(("work imbalance <= 1.15", imbalance <= 1.15, f"{imbalance:.2f}"))
    if variant == "multiturn":
        rr = by_arm.get("client:rr")
        if rr is None:
            checks.append(("at least client:rr", None, "client:rr was not run"))
        else:
            rh, rs = float(rr["hit_rate"]), float(rr["makespan_s"])
            checks.append(("hit rate >= client:rr's", hit >= rh, f"{hit:.3f} vs {rh:.3f}"))
            checks.append(("makespan <= client:rr's", span <= rs, f"{span:.2f} s vs {rs:.2f} s"))
    return checks


def report(variant: str, rows: list[dict[str, float | str]], oracle: Oracle) -> str:
    lines = [
        f"oracle bound ({variant}): hit rate {oracle.hit_rate:.3f} "
        f"({oracle.paid:,} of {oracle.prompt:,} prompt tokens prefilled: {oracle.rule}); "
        f"{oracle.one_engine:.3f} if every group sat on one engine (an arm above the bound "
        "paid the system prompt on fewer engines)",
        f"goals ({DEFAULT_ARM} against the best sglang-router / smg arm):",
    ]
    for goal, met, figures in goals(variant, rows, oracle):
        verdict = "n/a" if met is None else ("met" if met else "NOT met")
        lines.append(f"  {goal}: {verdict} ({figures})" if figures else f"  {goal}: {verdict}")
    return "\n".join(lines)


# -- processes ------------------------------------------------------------------------------


def sessiongate_policies() -> list[str]:
    """sessiongate's engine routing policies: its configuration's list, else the `--policy`
    choices `serve --help` lists; [] when serve has no such flag."""
    with contextlib.suppress(ImportError):
        from sessiongate.config.engines import POLICIES

        return list(POLICIES)
    help_text = subprocess.run(
        [sys.executable, "-m", "sessiongate", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"--policy \{([^}]*)\}", help_text)
    return match.group(1).split(",") if match else []


@dataclass(frozen=True)
class EngineCost:
    """What the mock engines' steps cost (their step scheduler's flags)."""

    prefill_us_per_token: float
    decode_step_ms: float
    # Each engine's prefix cache budget (`--prefix-cache-tokens`), least recently used evicted.
    cache_tokens: int = 200_000


@contextlib.contextmanager
def engines(variant: str, cost: EngineCost) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for index in range(ENGINES):
            port = free_port()
            argv = ["mock-engine", "--port", str(port), "--step-scheduler", "--seed", str(index)]
            argv += ["--prefill-us-per-token", str(cost.prefill_us_per_token)]
            argv += ["--decode-step-ms", str(cost.decode_step_ms)]
            argv += ["--lora-adapters", ",".join(ADAPTERS)]
            argv += ["--prefix-cache-tokens", str(cost.cache_tokens)]
            if variant == "slow" and index == ENGINES - 1:
                argv += ["--speed", "0.5"]
            urls.append(stack.enter_context(ServerProcess(argv, port, timeout=60)).url)
        yield urls


@contextlib.contextmanager
def arm_target(arm: str, urls: list[str]) -> Iterator[Target | None]:
    kind, _, policy = arm.partition(":")
    if kind == "client":
        yield Target(arm, urls, None, rule=policy)
        return
    port = free_port()
    if kind == "sg":
        argv = ["serve", "--port", str(port), "--workers", "0"]
        argv += [arg for url in urls for arg in ("--backend", url)]
        if policy in SG_ARMS:
            argv += SG_ARMS[policy]
        elif policy != "default":
            argv += ["--policy", policy]
        with ServerProcess(argv, port, timeout=60) as proc:
            yield Target(arm, urls, proc.url)
        return
    if kind == "smg13":
        yield from smg13_target(arm, policy, urls, port)
        return
    peer = peer_python()
    if peer is None:
        print(f"  {arm}: skipped (no sglang-router venv: set SGLANG_ROUTER_PYTHON)")
        yield None
        return
    cmd = [peer, "-m", "sglang_router.launch_router", "--port", str(port), "--log-level", "warn"]
    cmd += ["--policy", policy, "--worker-urls", *urls]
    # Its metrics listener defaults to 0.0.0.0:29000, which another process may hold.
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if policy == "manual":
        cmd += ["--assignment-mode", "min_load"]
    with started(cmd, port):
        yield Target(arm, urls, f"http://127.0.0.1:{port}")


def smg13_target(arm: str, name: str, urls: list[str], port: int) -> Iterator[Target | None]:
    """smg 1.13 (`smg launch`) in front of the engines, once it lists them all healthy."""
    binary = smg_bin()
    if binary is None:
        print(f"  {arm}: skipped (no smg: set SMG_BIN=/venv/bin/smg or SMG_PYTHON)")
        yield None
        return
    if name not in SMG13_ARMS:
        raise SystemExit(f"{arm}: unknown smg13 arm; expected one of {', '.join(SMG13_ARMS)}")
    cmd = [binary, "launch", "--port", str(port), "--host", "127.0.0.1", "--log-level", "warn"]
    cmd += ["--worker-urls", *urls, *SMG13_ARMS[name]]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with started(cmd, port):
        url = f"http://127.0.0.1:{port}"
        wait_for_workers(url, len(urls))
        yield Target(arm, urls, url, key_header=name in SMG13_KEY_HEADER)


def wait_for_workers(url: str, count: int, timeout: float = 60.0) -> None:
    """smg registers its --worker-urls asynchronously after /health answers: wait until
    `GET /workers` lists `count` of them healthy and ready."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            workers = httpx.get(f"{url}/workers", timeout=2).json().get("workers", [])
            ready = [w for w in workers if w.get("is_healthy") and w.get("status") == "ready"]
            if len(ready) >= count:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: fewer than {count} workers ready after {timeout:.0f} s")
        time.sleep(0.2)


def default_arms() -> list[str]:
    policies = sessiongate_policies() or ["default"]
    return [
        *(f"sg:{p}" for p in policies),
        *(f"sg:{name}" for name in SG_ARMS),
        *(f"smg:{p}" for p in SMG_POLICIES),
        *(f"smg13:{name}" for name in SMG13_ARMS),
        "client:rr",
        "client:lif",
    ]


def workload_for(variant: str, args: argparse.Namespace) -> Workload:
    if variant == "multiturn":
        return Workload(agents=args.prompts * 2, turns=args.steps + 2)
    adapters = ADAPTERS if variant == "lora" else ()
    return grpo_workload(args.seed, args.steps, args.prompts, args.samples, adapters=adapters)


def table(rows: list[dict[str, float | str]]) -> str:
    columns = [
        ("arm", "{}"),
        ("hit_rate", "{:.3f}"),
        ("reprefilled", "{:,.0f}"),
        ("groups_on_one", "{:.2f}"),
        ("work_imbalance", "{:.2f}"),
        ("inflight_imbalance", "{:.2f}"),
        ("makespan_s", "{:.2f}"),
        ("busy_makespan_s", "{:.2f}"),
        ("added_p50_ms", "{:.2f}"),
    ]
    lines = ["| " + " | ".join(name for name, _ in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[name]) for name, fmt in columns) + " |")
    return "\n".join(lines)


def median_row(runs: list[dict[str, float | str]]) -> dict[str, float | str]:
    """One arm's runs as one row: each figure's median (the arm's name kept)."""
    if len(runs) == 1:
        return runs[0]
    row: dict[str, float | str] = {}
    for key, value in runs[0].items():
        if isinstance(value, str):
            row[key] = value
        else:
            row[key] = statistics.median(float(run[key]) for run in runs)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="grpo,multiturn,slow,lora")
    parser.add_argument("--arms", default="", help="comma list (default: every arm available)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="GRPO prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="GRPO samples per prompt (n)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 steps x 6 prompts x 4 samples")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every arm, interleaved; the table shows each figure's median and the "
        "log every run (one run's spread between arms is often the noise: the same arm "
        "measured 0.72 and 0.79 GRPO hit rate in two runs)",
    )
    # The engines' modelled time must outweigh the host's own CPU time (four Python engines,
    # a router and this client on a few cores), or the makespan measures the host: 100 us
    # per uncached token (10,000 prefill tokens/s) and 20 ms per decode step are of the
    # order of a large model on one GPU.
    parser.add_argument("--prefill-us-per-token", type=float, default=100.0)
    parser.add_argument("--decode-step-ms", type=float, default=20.0)
    # Caches that never evict on these workloads by default; smaller ones show what stale
    # beliefs about them cost (the oracle bound then no longer holds: it never evicts).
    parser.add_argument(
        "--cache-tokens",
        type=int,
        default=EngineCost.cache_tokens,
        help="each engine's prefix cache in tokens (200000: no workload here evicts)",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts, args.samples = 2, 6, 4
    arms = [a for a in args.arms.split(",") if a] or default_arms()
    results: dict[str, list[dict[str, float | str]]] = {}
    oracles: dict[str, dict[str, float]] = {}
    cost = EngineCost(args.prefill_us_per_token, args.decode_step_ms, args.cache_tokens)
    for variant in [v for v in args.variants.split(",") if v]:
        print(f"== {variant}")
        workload = workload_for(variant, args)
        runs: dict[str, list[dict[str, float | str]]] = defaultdict(list)
        for _ in range(max(1, args.repeat)):
            for arm in arms:
                # Fresh engines per arm: their counters (time-averaged in flight) and caches
                # start from zero, and no arm inherits another's warm state.
                with engines(variant, cost) as urls, arm_target(arm, urls) as target:
                    if target is None:
                        continue
                    row = asyncio.run(run_arm(target, workload, variant, args.seed))
                    hit, makespan = row["hit_rate"], row["makespan_s"]
                    print(f"  {arm}: hit {hit:.3f}, makespan {makespan:.2f} s")
                    runs[arm].append(row)
        rows = [median_row(arm_runs) for arm_runs in runs.values()]
        results[variant] = rows
        print(table(rows))
        oracle = oracle_bound(variant, workload, args.seed)
        print(report(variant, rows, oracle))
        if args.cache_tokens < EngineCost.cache_tokens:
            print(
                f"  (caches of {args.cache_tokens:,} tokens evict: the oracle, which never "
                "evicts, is no bound here, and the goals above do not apply)"
            )
        oracles[variant] = {
            "hit_rate": oracle.hit_rate,
            "paid": oracle.paid,
            "prompt": oracle.prompt,
            "one_engine": oracle.one_engine,
        }
    if args.json:
        args.json.write_text(json.dumps({"rows": results, "oracle": oracles}, indent=1))
    counts = Counter(len(rows) for rows in results.values())
    return 0 if counts else 1


if __name__ == "__main__":
    sys.exit(main())
