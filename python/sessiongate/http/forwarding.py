"""Which headers a proxy passes on, both ways: the one rule for every path that forwards
headers (the Python front's proxy, session turns, the workers' upstream client), the twin of
`rust/front/hop.rs`, which the compiled front applies (twin-tested in
tests/http/test_forwarding_twin.py).

Dropped in both directions:
- the hop-by-hop fields RFC 9110 §7.6.1 names, and `HTTP2-Settings` (RFC 9113 §3.2.1);
- every field the message's own `Connection` header names: that is how a client or an
  intermediary marks a field as meant for the next hop alone (a credential for the gateway,
  say), and a proxy MUST remove them before forwarding;
- the framing fields the sender recomputes (`Host`, `Content-Length`, `Content-Encoding`,
  `Accept-Encoding`: bodies are relayed verbatim, so compression is never asked for);
- `Expect`: the gateway answers `100-continue` itself and sends whole bodies upstream, so an
  engine's interim reply never stands in for its final one.
Replies also lose `Date` and `Server`, which the answering server sets itself.
"""

from __future__ import annotations

from collections.abc import Iterable

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "http2-settings",
        "expect",
        "host",
        "content-length",
        "content-encoding",
        "accept-encoding",
    }
)
# Reply headers the gateway's own HTTP server sets: relaying the upstream's too would put
# two of each on the wire (some clients, e.g. aiohttp, refuse a duplicate Server header).
OWN_REPLY_HEADERS = frozenset({"date", "server"})


def header_list(value: str) -> list[str]:
    """The elements of a comma-separated field value (RFC 9110 §5.6.1), trimmed of spaces
    and tabs and lowercased; empty elements are dropped."""
    return [item for part in value.split(",") if (item := part.strip(" \t").lower())]


def connection_named(headers: Iterable[tuple[str, str]]) -> set[str]:
    """The field names that the `Connection` headers (all of them) list."""
    return {
        token
        for name, value in headers
        if name.lower() == "connection"
        for token in header_list(value)
    }


def forwardable_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """A request's headers as a proxy forwards them (see the module docstring)."""
    pairs = list(headers)
    named = connection_named(pairs)
    return [(k, v) for k, v in pairs if (low := k.lower()) not in HOP_BY_HOP and low not in named]


def relayable_reply_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """An upstream reply's headers as the gateway relays them."""
    pairs = list(headers)
    named = connection_named(pairs) | OWN_REPLY_HEADERS
    return [(k, v) for k, v in pairs if (low := k.lower()) not in HOP_BY_HOP and low not in named]
