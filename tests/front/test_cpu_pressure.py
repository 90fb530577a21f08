"""The bulk sends' pause under CPU pressure (front/cpu_pressure.py), against its Rust twin
(rust/front/bulk.rs) and on its own."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate import _core
from sessiongate.front import cpu_pressure
from sessiongate.front.cpu_pressure import pauses, psi_some_total

REAL = (
    "some avg10=0.53 avg60=5.56 avg300=8.38 total=3414703333\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)

# PSI files are ASCII; both twins split fields on ASCII whitespace alike (Python's isspace
# and Rust's is_whitespace differ on a few control characters outside this alphabet).
ALPHABET = string.ascii_letters + string.digits + " \t\n\r=+.-"
LINES = st.one_of(
    st.text(ALPHABET, max_size=40),
    st.builds(
        lambda kind, avg, total: f"{kind} avg10={avg} total={total}",
        st.sampled_from(["some", "full", "Some", "some\t"]),
        st.text("0123456789.", max_size=6),
        st.one_of(
            st.integers(min_value=0, max_value=(1 << 64) + 5).map(str),
            st.text(ALPHABET, max_size=8),
            st.integers(min_value=0, max_value=1 << 40).map(lambda n: f"+{n}"),
        ),
    ),
)
TEXTS = st.lists(LINES, max_size=4).map("\n".join)


@settings(max_examples=400, deadline=None)
@given(TEXTS, TEXTS, st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_the_python_twin_pauses_as_the_compiled_front(
    before: str, after: str, elapsed_us: int
) -> None:
    assert _core.front_bulk_pauses(before, after, elapsed_us) == pauses(
        psi_some_total(before), psi_some_total(after), elapsed_us
    )


def test_a_real_psi_file_is_read() -> None:
    assert psi_some_total(REAL) == 3414703333
    assert psi_some_total("full avg10=0.00 total=5\n") is None
    assert psi_some_total("some avg10=0.00 total=x5\n") is None
    assert psi_some_total(f"some total={1 << 64}") is None


@pytest.mark.parametrize(
    ("before", "after", "elapsed_us", "paused"),
    [
        (1000, 1000 + 8001, 10_000, True),  # tasks waited for over 80% of the window
        (1000, 1000 + 8000, 10_000, False),
        (1000, 1000, 10_000, False),
        (5000, 1000, 10_000, False),  # a counter that went back is no stall
        (None, 9_999_999, 10_000, False),  # no PSI: never
        (1000, None, 10_000, False),
    ],
)
def test_sends_pause_only_past_the_threshold(
    before: int | None, after: int | None, elapsed_us: int, paused: bool
) -> None:
    assert pauses(before, after, elapsed_us) is paused

    def text(total: int | None) -> str:
        return "" if total is None else f"some avg10=0 total={total}\n"

    assert _core.front_bulk_pauses(text(before), text(after), elapsed_us) is paused


def test_without_psi_nothing_pauses(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_pressure, "PSI_CPU", Path("/nonexistent/pressure/cpu"))
    pressure = cpu_pressure.Pressure()
    monkeypatch.setattr(cpu_pressure, "WINDOW_S", 0.0)
    assert pressure.check() is False and pressure.check() is False


def test_a_contended_cpu_pauses_once_a_window(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=0 total=0\n")
    monkeypatch.setattr(cpu_pressure, "PSI_CPU", psi)
    pressure = cpu_pressure.Pressure()
    psi.write_text("some avg10=0 total=999999999\n")  # far more stall than any window
    monkeypatch.setattr(cpu_pressure, "WINDOW_S", 0.0)
    assert pressure.check() is True
    assert pressure.check() is False  # no stall since the last reading
