"""Which SGLang release the engines run, so the gateway renders prompts by its rules.

The gateway renders a session turn's prompt itself and sends ids, so the prompt is right
only if it is rendered as the engine would render the same request, and that depends on the
engine's SGLang release (sglang_rules.py). `--sglang-version auto` (the default) asks the
configured engines at start: SGLang's `GET /server_info` (or the older `/get_server_info`)
carries `version` (sglang/srt/entrypoints/http_server.py, 0.5.16 and 0.5.23 alike).

- Every engine that answers must report the same version: engines of different releases
  behind one gateway would need different prompts for one session turn, so the start is
  refused, naming each engine's version.
- No engine answers with a version (an old mock, engines down, `--backend none`): the
  newest rules apply, and the start-up line says so.
- A given version (`--sglang-version 0.5.16`) is taken as it is; the engines are not asked.

Engines registered at run time are checked at registration (engines/registry.py): one whose
release renders differently from the gateway's rules is refused (409), since the workers'
tokenizers are fixed at start.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sessiongate.sglang_rules import NEWEST, parse_version, rules_for

__all__ = [
    "AUTO",
    "VersionChoice",
    "choose_sglang_version",
    "read_engine_versions",
    "registration_refusal",
]

AUTO = "auto"
# Each engine's bound at start: one that cannot answer its server info in this time counts
# as not reporting a version.
VERSION_TIMEOUT_S = 5.0

# url -> its reported version (None: it did not say).
VersionReader = Callable[[Sequence[str]], dict[str, str | None]]


def _server_version(url: str, timeout: float) -> str | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback too
    for path in ("/server_info", "/get_server_info"):
        try:
            with opener.open(url.rstrip("/") + path, timeout=timeout) as reply:
                document = json.loads(reply.read())
        except (OSError, ValueError):  # URLError and HTTPError are OSErrors
            continue
        version = document.get("version") if isinstance(document, dict) else None
        if isinstance(version, str) and version:
            return version
    return None


def read_engine_versions(
    urls: Sequence[str], timeout: float = VERSION_TIMEOUT_S
) -> dict[str, str | None]:
    """Each engine's SGLang version from its server info; None for one that did not say.
    Blocking (start-up only), one engine after the other."""
    return {url: _server_version(url, timeout) for url in urls}


@dataclass(frozen=True)
class VersionChoice:
    """The SGLang version whose rules apply, and the start-up line saying where it came from."""

    version: str
    source: str  # "flag", "engines" or "default"
    line: str


def choose_sglang_version(
    given: str,
    urls: Sequence[str],
    *,
    flag: str,
    read: VersionReader = read_engine_versions,
) -> VersionChoice:
    """The version of `given` (`flag`'s value: a version, or `auto` to ask the engines at
    `urls`). ValueError naming each engine's version when they disagree, or when `given` is
    no version."""
    if given != AUTO:
        if parse_version(given) is None:
            raise ValueError(f"{flag} {given!r} is neither {AUTO!r} nor a version like 0.5.16")
        rules = rules_for(given)
        return VersionChoice(given, "flag", f"{rules.label} ({flag} {given})")
    versions = read(urls) if urls else {}
    return _from_engines(versions, flag)


def _from_engines(versions: Mapping[str, str | None], flag: str) -> VersionChoice:
    reported = {url: v for url, v in versions.items() if v is not None}
    silent = [url for url, v in versions.items() if v is None]
    if len(set(reported.values())) > 1:
        each = ", ".join(f"{url} runs {v}" for url, v in reported.items())
        raise ValueError(
            "the engines run different SGLang versions, which render prompts differently, "
            f"and one gateway renders by one version's rules: {each}. Put engines of one "
            f"version behind each gateway (or give {flag} to choose one)"
        )
    if not reported:
        why = (
            f"no engine reported its version ({', '.join(silent)})"
            if silent
            else "no engine configured yet"
        )
        return VersionChoice(
            NEWEST.since, "default", f"{NEWEST.label}, the newest known ({why}; {flag} sets one)"
        )
    version = next(iter(reported.values()))
    line = f"{rules_for(version).label} (the engines run SGLang {version}"
    if silent:
        line += f"; {', '.join(silent)} did not say"
    return VersionChoice(version, "engines", line + ")")


def registration_refusal(engine_version: str | None, gateway_version: str) -> str | None:
    """Why an engine reporting `engine_version` may not join a gateway rendering by the
    rules of `gateway_version` (None: it may; also when it reports no version)."""
    if engine_version is None or gateway_version == AUTO:
        return None
    theirs, ours = rules_for(engine_version), rules_for(gateway_version)
    if theirs == ours:
        return None
    return (
        f"the engine runs SGLang {engine_version}, which renders prompts by {theirs.label}, "
        f"and this gateway renders by {ours.label} (SGLang {gateway_version}): its prompts "
        "would not be the engine's. Restart the gateway with the engine's version, or "
        "register an engine of the gateway's"
    )
