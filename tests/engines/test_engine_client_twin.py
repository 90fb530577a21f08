"""What both engine clients say and do when an engine fails is specified once: the Python
functions (engines/client.py, http/client.py, engines/pool.py) and the compiled front's
(rust/front/failure.rs) give the same 502 texts and the same retry engine for generated
inputs."""

from __future__ import annotations

from urllib.parse import urlsplit

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sessiongate._core import (
    front_connect_failed_text,
    front_connect_timed_out,
    front_retry_target,
    front_transport_error_text,
    front_url_hostname,
)
from sessiongate.engines.client import transport_error_text
from sessiongate.engines.pool import retry_target
from sessiongate.http.client import connect_failed_text, connect_timed_out

texts = st.text(st.characters(exclude_categories=("Cs",)))


@settings(max_examples=500, deadline=None)
@given(texts, texts, texts, texts, texts)
def test_transport_error_text_twin(
    method: str, url: str, path: str, kind: str, detail: str
) -> None:
    want = transport_error_text(method, url, path, kind, detail)
    assert front_transport_error_text(method, url, path, kind, detail) == want


@settings(max_examples=500, deadline=None)
@given(texts, st.integers(0, 65535), texts)
def test_connect_failed_text_twin(host: str, port: int, why: str) -> None:
    assert front_connect_failed_text(host, port, why) == connect_failed_text(host, port, why)


@settings(max_examples=2000, deadline=None)
@given(st.floats(allow_nan=False) | st.floats(min_value=1e-6, max_value=10.0))
# Exactly halfway between two shortest forms: Python's repr takes the even digit.
@example(562949953421312.25)
@example(2.5e22)
@example(2.0**-24)
def test_connect_timeout_text_twin(seconds: float) -> None:
    # The timeout as Python's str(float) writes it, at every magnitude.
    assert front_connect_timed_out(seconds) == connect_timed_out(seconds)


hosts = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.-]{0,20}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
)


@settings(max_examples=500, deadline=None)
@given(hosts)
def test_connect_failures_name_the_host_as_python_splits_it(host: str) -> None:
    assert front_url_hostname(host) == urlsplit(f"http://{host}:80").hostname


@st.composite
def engine_sets(draw: st.DrawFn) -> tuple[list[int], int, list[bool]]:
    size = draw(st.integers(1, 8))
    order = draw(st.permutations(list(range(size))))
    failed = draw(st.integers(0, size - 1))
    available = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    return list(order), failed, available


@settings(max_examples=1000, deadline=None)
@given(engine_sets())
def test_retry_target_twin(case: tuple[list[int], int, list[bool]]) -> None:
    order, failed, available = case
    want = retry_target(order, failed, available)
    assert front_retry_target(order, failed, available) == want
    if want is not None:
        assert want != failed
