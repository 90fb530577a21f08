"""A session's checkpoints (session/state.py) held as the last one plus links, against the
plain model of keeping every checkpoint whole: any sequence of turns and rollbacks, with the
trailing ids a turn may replace (--max-trim-tokens), gives back the same ids at every depth."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.session.state import Session

# One turn: how many checkpoints it keeps (drawn against the count then), how many trailing
# ids of its base it replaces, and the ids it adds.
turns = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=1 << 16),
        st.integers(min_value=0, max_value=2),
        st.lists(st.integers(min_value=0, max_value=2**40), min_size=1, max_size=6),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(turns)
def test_links_give_back_every_checkpoint(steps: list[tuple[int, int, list[int]]]) -> None:
    session = Session(session_id="s", parent_id=None, root_id="s", created_at=0.0)
    model: list[list[int]] = []
    for draw, trim, added in steps:
        kept = draw % (len(model) + 1)
        base = model[kept - 1] if kept else []
        new = [*base[: max(0, len(base) - trim)], *added]
        session.commit_checkpoint(kept, new)
        model = [*model[:kept], new]
        assert session.checkpoint_count == len(model)
        assert list(session.accumulated_ids) == model[-1]
    assert [list(session.checkpoint(k + 1)) for k in range(len(model))] == model
    # Links hold only what differs from the next checkpoint, never a whole one.
    assert all(len(tail) <= 2 for _, tail in session.checkpoint_links)
