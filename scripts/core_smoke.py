"""Load the Rust core and check a few primitives against values computed here, with the
standard library only: the proof that a wheel's `_core` runs on the machine (or emulator)
that runs this script. Prints the core's build info and one line per check; exits 1 on any
mismatch.

    python scripts/core_smoke.py                       # the installed sessiongate
    qemu-aarch64-static -L ROOT ROOT/usr/bin/python3.11 scripts/core_smoke.py  # with
        PYTHONPATH=<an unpacked aarch64 wheel>: see `make prove-aarch64`
"""

from __future__ import annotations

import base64
import hashlib
import json
import platform
import struct
import sys


def main() -> int:
    from sessiongate import _core

    print(f"machine {platform.machine()}, python {platform.python_version()}")
    print(f"core {json.dumps(_core.build_info(), sort_keys=True)}")
    failures = 0

    def check(name: str, got: object, want: object) -> None:
        nonlocal failures
        ok = got == want
        failures += not ok
        print(f"{'ok ' if ok else 'BAD'} {name}" + ("" if ok else f": {got!r} != {want!r}"))

    key = "0123456789abcdef0123456789abcdef"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    check("shard_index", _core.shard_index(key, 7), int.from_bytes(digest, "big") % 7)
    check("shard_key", _core.shard_key(key + ".child"), key)
    payload = b"payload"
    frame = _core.encode_frame(_core.FRAME_REQUEST, 42, payload)
    check("encode_frame", frame, struct.pack(">QQB", 9 + len(payload), 42, 1) + payload)
    meta, body = _core.decode_envelope(_core.encode_envelope({"op": "health"}, b"raw"))
    check("envelope", (meta, bytes(body)), ({"op": "health"}, b"raw"))
    rows = struct.pack("<6i", 1, 2, 3, 4, 5, 6)
    r3 = _core.decode_r3(base64.b64encode(rows).decode(), layers=1, topk=2)
    check("decode_r3", r3.tolist(), [[[1, 2]], [[3, 4]], [[5, 6]]])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
