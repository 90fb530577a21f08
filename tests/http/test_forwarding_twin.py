"""The compiled front's header rule equals the Python one (twin rule).

`http/forwarding.py` says which headers a proxy passes on (the Python front, session turns,
the workers' upstream client); `_core.front_forwarded_headers` is the rule the compiled
front applies (rust/front/hop.rs). Generated header lists, with `Connection` values naming
some of their own fields, must keep exactly the same headers in the same order.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate._core import front_forwarded_headers
from sessiongate.http.forwarding import (
    HOP_BY_HOP,
    forwardable_headers,
    header_list,
    relayable_reply_headers,
)

NAMES = [*sorted(HOP_BY_HOP), "date", "server", "x-hop", "X-Kept", "authorization", "x-a"]


def cased(name: str) -> st.SearchStrategy[str]:
    return st.sampled_from([name, name.upper(), name.title()])


header_name = st.sampled_from(NAMES).flatmap(cased)
# A Connection value: names (some of the headers, some not), odd spacing, empty elements.
connection_value = st.lists(
    st.one_of(header_name, st.sampled_from(["close", "", " ", "\t"])), max_size=5
).map(lambda items: ",".join(f" {i}\t" if n % 2 else i for n, i in enumerate(items)))
header = st.one_of(
    st.tuples(header_name, st.text(st.characters(min_codepoint=32, max_codepoint=255))),
    st.tuples(cased("connection"), connection_value),
)


def rust(headers: list[tuple[str, str]], reply: bool) -> list[tuple[str, str]]:
    wire = [(k, v.encode("latin-1")) for k, v in headers]
    return [(k, v.decode("latin-1")) for k, v in front_forwarded_headers(wire, reply)]


@settings(max_examples=400, deadline=None)
@given(headers=st.lists(header, max_size=10))
def test_request_and_reply_rules_are_twins(headers: list[tuple[str, str]]) -> None:
    assert rust(headers, reply=False) == forwardable_headers(headers)
    assert rust(headers, reply=True) == relayable_reply_headers(headers)


CASES = [
    # Fields a Connection header names are dropped, whatever their case, with the list.
    (
        [("Connection", "keep-alive, X-Hop"), ("X-Hop", "secret"), ("x-kept", "1")],
        [("x-kept", "1")],
    ),
    # Every Connection header counts.
    ([("connection", "x-a"), ("Connection", "x-b"), ("X-A", "1"), ("x-b", "2")], []),
    # Upgrade offers and Expect never travel.
    ([("Upgrade", "h2c"), ("HTTP2-Settings", "AAM"), ("Expect", "100-continue")], []),
]


@pytest.mark.parametrize(("headers", "kept"), CASES)
def test_known_cases(headers: list[tuple[str, str]], kept: list[tuple[str, str]]) -> None:
    assert forwardable_headers(headers) == kept
    assert rust(headers, reply=False) == kept


def test_header_list_trims_spaces_and_tabs_only() -> None:
    assert header_list(" A,\tb ,, c\t") == ["a", "b", "c"]
    assert header_list("") == []
