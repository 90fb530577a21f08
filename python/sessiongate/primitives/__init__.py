"""Foundation primitives: shard selection, session ids, the IPC frame codec, the JSON relay,
session routing stamping and the in-place bytes sink.

Every function here has two implementations with identical results: the Rust core
(``sessiongate._core``) and a pure-Python twin (``_py_shard`` / ``_py_frame`` / ...). The module
level names are bound to the one :func:`sessiongate.twins.pick` chooses (the Rust core unless
the environment says ``SESSIONGATE_IMPL=python``); ``IMPL`` tells which one is active. Both
stay reachable as :data:`rust` and :data:`python` (or :func:`get_impl`) so tests and
benchmarks can compare them in one run. Exception classes come from
:mod:`sessiongate.primitives.errors` and are the same objects for both.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from sessiongate import twins
from sessiongate.twins import Impl

from . import _py_bytes_sink, _py_frame, _py_relay, _py_shard, _py_stamp
from .errors import (
    FrameCorrupt,
    FrameError,
    FrameTooLarge,
    ReplyContractError,
    RequestRewriteError,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "FRAME_ERROR",
    "FRAME_HEADER_SIZE",
    "FRAME_REPLY",
    "FRAME_REQUEST",
    "IMPL",
    "MAX_SESSION_ID_LEN",
    "BytesSink",
    "CachedTokensWatch",
    "ExtractedReply",
    "FrameCorrupt",
    "FrameDecoder",
    "FrameError",
    "FrameTooLarge",
    "HeaderStamper",
    "ReplyContractError",
    "RequestRewriteError",
    "decode_envelope",
    "decode_r3",
    "encode_envelope",
    "encode_frame",
    "encode_frame_header",
    "extract_reply",
    "get_impl",
    "new_session_id",
    "nvext_session_control",
    "python",
    "rewrite_request",
    "rust",
    "shard_index",
    "shard_indices",
    "shard_key",
    "validate_session_id",
]

# The names each implementation provides; the exception classes are shared, not per impl.
_API = (
    "DEFAULT_MAX_FRAME",
    "FRAME_ERROR",
    "FRAME_HEADER_SIZE",
    "FRAME_REPLY",
    "FRAME_REQUEST",
    "MAX_SESSION_ID_LEN",
    "BytesSink",
    "CachedTokensWatch",
    "ExtractedReply",
    "FrameDecoder",
    "HeaderStamper",
    "decode_envelope",
    "decode_r3",
    "extract_reply",
    "rewrite_request",
    "encode_envelope",
    "encode_frame",
    "encode_frame_header",
    "new_session_id",
    "nvext_session_control",
    "shard_index",
    "shard_indices",
    "shard_key",
    "validate_session_id",
)
_ERRORS = {
    "FrameError": FrameError,
    "FrameTooLarge": FrameTooLarge,
    "FrameCorrupt": FrameCorrupt,
    "ReplyContractError": ReplyContractError,
    "RequestRewriteError": RequestRewriteError,
}


_TWIN_MODULES = (_py_shard, _py_frame, _py_relay, _py_stamp, _py_bytes_sink)


def _python_twin(attr: str) -> object:
    for module in _TWIN_MODULES:
        if hasattr(module, attr):
            return getattr(module, attr)
    raise ImportError(f"sessiongate python primitives lack {attr!r}")


def _namespace(impl: Impl) -> SimpleNamespace:
    ns = SimpleNamespace(IMPL=impl, **_ERRORS)
    for attr in _API:
        setattr(ns, attr, twins.pick(attr, _python_twin(attr), impl))
    return ns


python = _namespace("python")
"""The pure-Python twins, always available."""

rust: SimpleNamespace | None = _namespace("rust") if twins.core() is not None else None
"""The Rust core, or None when ``sessiongate._core`` cannot be imported."""


def get_impl(name: Impl) -> SimpleNamespace:
    """The namespace of one implementation, for side-by-side tests and benchmarks."""
    if name == "python":
        return python
    if name == "rust" and rust is not None:
        return rust
    # `twins.pick` raises: an ImportError naming why the core is missing, or a ValueError for
    # a name that is no implementation.
    return _namespace(name)


_active = get_impl(twins.chosen())
IMPL: str = _active.IMPL

if TYPE_CHECKING:
    # Type checkers see the twins' signatures, which match _core.pyi.
    from ._py_bytes_sink import BytesSink
    from ._py_frame import (
        DEFAULT_MAX_FRAME,
        FRAME_ERROR,
        FRAME_HEADER_SIZE,
        FRAME_REPLY,
        FRAME_REQUEST,
        FrameDecoder,
        decode_envelope,
        encode_envelope,
        encode_frame,
        encode_frame_header,
    )
    from ._py_relay import (
        CachedTokensWatch,
        ExtractedReply,
        decode_r3,
        extract_reply,
        rewrite_request,
    )
    from ._py_shard import (
        MAX_SESSION_ID_LEN,
        new_session_id,
        shard_index,
        shard_indices,
        shard_key,
        validate_session_id,
    )
    from ._py_stamp import HeaderStamper, nvext_session_control
else:
    DEFAULT_MAX_FRAME = _active.DEFAULT_MAX_FRAME
    FRAME_ERROR = _active.FRAME_ERROR
    FRAME_HEADER_SIZE = _active.FRAME_HEADER_SIZE
    FRAME_REPLY = _active.FRAME_REPLY
    FRAME_REQUEST = _active.FRAME_REQUEST
    BytesSink = _active.BytesSink
    FrameDecoder = _active.FrameDecoder
    MAX_SESSION_ID_LEN = _active.MAX_SESSION_ID_LEN
    decode_envelope = _active.decode_envelope
    encode_envelope = _active.encode_envelope
    encode_frame = _active.encode_frame
    encode_frame_header = _active.encode_frame_header
    new_session_id = _active.new_session_id
    shard_index = _active.shard_index
    shard_indices = _active.shard_indices
    shard_key = _active.shard_key
    validate_session_id = _active.validate_session_id
    ExtractedReply = _active.ExtractedReply
    decode_r3 = _active.decode_r3
    extract_reply = _active.extract_reply
    rewrite_request = _active.rewrite_request
    CachedTokensWatch = _active.CachedTokensWatch
    HeaderStamper = _active.HeaderStamper
    nvext_session_control = _active.nvext_session_control
