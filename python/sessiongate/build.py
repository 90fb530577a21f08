"""Which build of sessiongate is running: the package's version and the Rust core's build
(version, target, profile), for `sessiongate --version` and `/metrics`'
`sessiongate_build_info`, so an operator can tell which build answered."""

from __future__ import annotations

from sessiongate import __version__

# What is reported of a core that cannot be imported (the twins then serve everything).
_NO_CORE = {"version": "none", "target": "none", "profile": "none", "rustc": "none"}


def core_build() -> dict[str, str]:
    """`_core.build_info()`: version, target, profile and rustc of the Rust core."""
    try:
        from sessiongate._core import build_info
    except ImportError:
        return dict(_NO_CORE)
    return build_info()


def build_labels() -> dict[str, str]:
    """`version` (the package), `core_version`, `target`, `profile` (the Rust core) and
    `impl` (the primitives in use: `rust`, or `python` under SESSIONGATE_IMPL=python)."""
    from sessiongate.primitives import IMPL

    core = core_build()
    return {
        "version": __version__,
        "core_version": core["version"],
        "target": core["target"],
        "profile": core["profile"],
        "impl": IMPL,
    }


def version_text() -> str:
    """`sessiongate 0.1.0 (core 0.1.0, x86_64-unknown-linux-gnu, release, rustc 1.95.0 ...)`."""
    core = core_build()
    return (
        f"sessiongate {__version__} (core {core['version']}, {core['target']}, "
        f"{core['profile']}, {core['rustc']})"
    )
