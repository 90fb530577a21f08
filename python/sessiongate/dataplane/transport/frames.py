"""Frame types of the IPC channel, including sessiongate's extensions (see docs/ipc.md)."""

from __future__ import annotations

import struct

from sessiongate.primitives import FRAME_ERROR, FRAME_REPLY, FRAME_REQUEST

# Extension types. REQUEST/REPLY/ERROR (1-3) keep the layout of docs/architecture.md
# ("Wire contracts").
FRAME_REPLY_HEAD = 4  # envelope {status, headers} + empty body; BODY frames then END follow
FRAME_BODY = 5  # one chunk of a streamed reply body (raw bytes)
FRAME_END = 6  # end of a streamed body (empty payload)
FRAME_CANCEL = 7  # router -> worker: the requester is gone; stop, send nothing more
FRAME_CREDIT = 8  # router -> worker: u32 BE count of further BODY frames allowed
FRAME_HEARTBEAT = 9  # worker -> router, request id 0: compact JSON status
# worker -> router, local workers only: one segment of a streamed body in a shared-memory
# file, JSON {"file": name, "length": n} (transport/reply_files.py); costs a credit as BODY.
FRAME_BODY_FILE = 10
# worker -> router, local workers only: the worker offers to write the rest of a streamed
# body on the client's connection, JSON {"socket": name} of a UNIX socket in the reply
# directory (transport/lent_replies.py); no credit.
FRAME_BODY_LEND = 11

FRAME_NAMES = {
    FRAME_REQUEST: "REQUEST",
    FRAME_REPLY: "REPLY",
    FRAME_ERROR: "ERROR",
    FRAME_REPLY_HEAD: "REPLY_HEAD",
    FRAME_BODY: "BODY",
    FRAME_END: "END",
    FRAME_CANCEL: "CANCEL",
    FRAME_CREDIT: "CREDIT",
    FRAME_HEARTBEAT: "HEARTBEAT",
    FRAME_BODY_FILE: "BODY_FILE",
    FRAME_BODY_LEND: "BODY_LEND",
}

# Bodies larger than this go as streamed chunks so they never hold the channel for long.
CHUNK_SIZE = 256 * 1024
# BODY frames a worker may send ahead of the router's consumption, per stream: bounds the
# router's memory to CREDIT_WINDOW x CHUNK_SIZE per streamed reply.
CREDIT_WINDOW = 8
# Seconds between a worker's heartbeats. The router calls a worker whose last beat is older
# than STALL_AFTER (two beats missed) "stalled" in /health: stopped (SIGSTOP, a debugger) or
# its event loop blocked. Two missed beats, not one, so a loaded worker does not flap.
HEARTBEAT_INTERVAL = 0.5
STALL_AFTER = 3 * HEARTBEAT_INTERVAL

_U32 = struct.Struct(">I")


def encode_credit(count: int) -> bytes:
    return _U32.pack(count)


def decode_credit(payload: bytes) -> int:
    if len(payload) != _U32.size:
        raise ValueError(f"CREDIT payload must be 4 bytes, got {len(payload)}")
    count: int = _U32.unpack(payload)[0]
    return count


__all__ = [
    "CHUNK_SIZE",
    "CREDIT_WINDOW",
    "FRAME_BODY",
    "FRAME_CANCEL",
    "FRAME_CREDIT",
    "FRAME_END",
    "FRAME_ERROR",
    "FRAME_HEARTBEAT",
    "FRAME_NAMES",
    "FRAME_REPLY",
    "FRAME_REPLY_HEAD",
    "FRAME_REQUEST",
    "decode_credit",
    "encode_credit",
]
