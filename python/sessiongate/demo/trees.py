"""The demo's tree sessions: each shape the tree mode exists for, placed on purpose.

The bench's tree workload draws retries, forks and resumes at random; the demo wants every
one of them in a few sessions, so it builds the sessions itself from the same pieces (the
synthetic main line, `later_turn` for branch turns). Shapes, cycled over the sessions:

- `retry`: 4 turns, turn 3 sent twice (the first reply is an abandoned leaf the default
  picker drops: 2 leaves, 1 sample);
- `fork`: 4 turns, a 2-turn branch forks after turn 2 and runs alongside (2 samples);
- `resume`: 5 turns, then 2 turns resumed from turn 1 (2 samples);
- `all`: 4 turns, turn 2 retried, a fork after turn 2, a resume from turn 1 (4 leaves,
  3 samples).

Turn numbers are 1-based here; retries never hit turn 1, whose abandoned reply would be a
second root (kept: a root has no siblings).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from sessiongate.loadgen.tree_workload import BranchSpec, TreeSessionSpec
from sessiongate.loadgen.workload import SyntheticOptions, SyntheticWorkload, later_turn


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    turns: int
    retry: int | None = None  # 0-based main-line turn sent twice
    fork_after: int | None = None  # 0-based main-line turn a 2-turn fork continues
    resume_after: int | None = None  # 0-based main-line turn a 2-turn resume continues
    leaves: int = 0
    samples: int = 0


SHAPES = (
    Shape("retry", 4, retry=2, leaves=2, samples=1),
    Shape("fork", 4, fork_after=1, leaves=2, samples=2),
    Shape("resume", 5, resume_after=0, leaves=2, samples=2),
    Shape("all", 4, retry=1, fork_after=1, resume_after=0, leaves=4, samples=3),
)
BRANCH_TURNS = 2


def demo_options(seed: int) -> SyntheticOptions:
    # Like the linear demo's turns; replies fit max_tokens (a cut path cannot go on).
    return SyntheticOptions(
        seed=seed, system_tokens=12, prompt_tokens=24, append_tokens=12, max_tokens=48
    )


def shape_of(index: int) -> Shape:
    return SHAPES[index % len(SHAPES)]


def tree_session(index: int, seed: int) -> TreeSessionSpec:
    shape = shape_of(index)
    options = demo_options(seed)
    line = SyntheticWorkload(dataclasses.replace(options, turns=float(shape.turns))).root(index)
    rng = random.Random(f"sessiongate-demo-tree|{seed}|{index}")
    retries = [int(t == shape.retry) for t in range(shape.turns)]
    main = BranchSpec("main", None, line.turns, retries)

    def branch(label: str, after: int) -> BranchSpec:
        turns = [later_turn(rng, options) for _ in range(BRANCH_TURNS)]
        return BranchSpec(label, after, turns, [0] * BRANCH_TURNS)

    forks = [] if shape.fork_after is None else [branch("fork0", shape.fork_after)]
    resume = None if shape.resume_after is None else branch("resume", shape.resume_after)
    return TreeSessionSpec(f"t{index}-{shape.name}", main, forks, resume)


def tree_sessions(count: int, seed: int) -> list[TreeSessionSpec]:
    return [tree_session(i, seed) for i in range(count)]
