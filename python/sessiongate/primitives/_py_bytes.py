"""Bytes-like arguments of the pure-Python twins (the twin of rust/buffer.rs)."""

from __future__ import annotations


def byte_view(
    obj: object, func: str, arg: str, expected: str = "a bytes-like object"
) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous bytes-like object (no copy)."""
    try:
        view = memoryview(obj)  # type: ignore[arg-type]  # any object: a TypeError is the answer
    except TypeError:
        raise TypeError(
            f"{func}() argument '{arg}' must be {expected}, not {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise TypeError(f"{func}() argument '{arg}' must be a C-contiguous bytes-like object")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
