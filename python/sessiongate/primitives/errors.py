"""Exception classes shared by the Rust core and the pure-Python twins.

They live in a pure-Python module (not in ``sessiongate._core``) so that both implementations
raise the *same* classes: ``except FrameError`` works whichever twin is active, and
``SESSIONGATE_IMPL=python`` works even where the compiled module is missing or broken. The
Rust code imports these classes lazily, the first time it raises one.
"""

from __future__ import annotations

__all__ = [
    "FrameCorrupt",
    "FrameError",
    "FrameTooLarge",
    "ReplyContractError",
    "RequestRewriteError",
]


class FrameError(ValueError):
    """A frame or envelope could not be encoded or decoded.

    Also raised by every ``FrameDecoder.feed`` after an earlier decode error: a byte stream
    that lost its framing cannot be resynchronised, so the decoder stays closed.
    """


class FrameTooLarge(FrameError):
    """A frame is longer than the ``max_frame`` cap (on encode or on decode)."""


class FrameCorrupt(FrameError):
    """A frame header is impossible (its length field is below the 9-byte minimum)."""


class ReplyContractError(ValueError):
    """An upstream chat reply breaks the SGLang-style contract (a 502 for the client).

    The message starts with ``"upstream reply breaks the chat contract: "``, then the same
    detail as ``sessiongate.session.reply.parse_reply``.
    """


class RequestRewriteError(ValueError):
    """A client request body cannot take the upstream fields: not JSON, or not an object."""
