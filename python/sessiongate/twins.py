"""The one switch between the Rust core and the pure-Python twins.

Every primitive exists twice with identical results: in the compiled core
(``sessiongate._core``) and as a pure-Python twin. :func:`pick` chooses one for a named
primitive, for the whole process by ``SESSIONGATE_IMPL``: ``python`` takes the twins, ``rust``
the core (an ImportError naming the cause when it cannot be imported), unset the core when it
imports, else the twins with a warning. The facades (:mod:`sessiongate.primitives`,
:mod:`sessiongate.engines.policy`) go through it. Nothing here imports the core until a choice
needs it, so option parsing that reaches a facade does not load it.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType
from typing import Literal, TypeVar

Impl = Literal["rust", "python"]
IMPL_ENV = "SESSIONGATE_IMPL"

T = TypeVar("T")


@functools.cache
def _load_core() -> tuple[ModuleType | None, ImportError | None]:
    try:
        return importlib.import_module("sessiongate._core"), None
    except ImportError as exc:  # e.g. a source checkout without `maturin develop`
        return None, exc


def core() -> ModuleType | None:
    """The compiled core, or None when it cannot be imported."""
    return _load_core()[0]


def require_core() -> ModuleType:
    """The compiled core, or an ImportError that says why it is missing."""
    module, error = _load_core()
    if module is None:
        raise ImportError(f"the Rust core is not available: {error}")
    return module


@functools.cache
def chosen() -> Impl:
    """The implementation ``SESSIONGATE_IMPL`` selects for this process (decided once)."""
    choice = os.environ.get(IMPL_ENV, "")
    if choice not in ("", "rust", "python"):
        raise ValueError(
            f"{IMPL_ENV}={choice!r} is not supported; use 'rust', 'python' or leave it unset"
        )
    if choice == "python":
        return "python"
    module, error = _load_core()
    if module is None:
        if choice == "rust":
            raise ImportError(f"{IMPL_ENV}=rust but sessiongate._core cannot be imported: {error}")
        # Unset: keep working, but loudly, since every hot path is now much slower.
        warnings.warn(
            f"sessiongate._core is unavailable ({error}); using the pure-Python primitives",
            RuntimeWarning,
            stacklevel=2,
        )
        return "python"
    return "rust"


def pick(name: str, python_twin: T, impl: Impl | None = None) -> T:
    """The primitive ``name``: the core's, or ``python_twin``, as ``impl`` says (None: as
    ``SESSIONGATE_IMPL`` says, :func:`chosen`)."""
    which = chosen() if impl is None else impl
    if which == "python":
        return python_twin
    if which != "rust":
        raise ValueError(
            f"unknown primitives implementation {which!r}; expected 'rust' or 'python'"
        )
    module = require_core()
    try:
        found: T = getattr(module, name)
    except AttributeError:
        raise ImportError(f"sessiongate rust primitives lack {name!r}") from None
    return found
