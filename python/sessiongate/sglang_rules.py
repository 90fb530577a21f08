"""Which SGLang version's rendering rules apply: the text a chat template sees depends on it.

SGLang does not hand a request's ``tools`` and ``messages`` to the chat template as sent: it
validates them into its pydantic models and renders their dumps (tokenizer/tool_schema.py,
tokenizer/message_shape.py). Those models change between releases, so the same request renders to
different prompts on different engines: SGLang 0.5.16's ``Function`` writes
``"strict": false`` into every tool and lists ``description`` before ``name``, 0.5.23's
keeps the client's keys in the client's order. A gateway whose prompt must be token for
token the engine's has to render with the rules of the version its engines run.

`SglangRules` is one set of those rules (one frozen dataclass per behaviour set, named by
the first release that has it); `rules_for` picks the set of a version string. A kernel
module (it imports nothing of sessiongate): the tokenizer renders with the rules, and the
router, which never loads a tokenizer, refuses a registered engine whose release renders
differently (engines/engine_versions.py).
docs/tokenizer.md ("SGLang version rules") lists every rule and the file it was read from.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass

__all__ = [
    "NEWEST",
    "OLDEST",
    "RULE_SETS",
    "SGLANG_0_5_16",
    "SGLANG_0_5_20",
    "SGLANG_0_5_23",
    "SglangRules",
    "parse_version",
    "rules_for",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SglangRules:
    """How one range of SGLang releases shapes tools and messages for the chat template.

    `since`: the first release with these rules (the version the rules were read from when
    the first one is not known). Field by field, sglang/srt/entrypoints/openai/protocol.py:
    """

    since: str
    # `Function` keeps the client's key order (`key_order`, 0.5.23+); else the model's
    # declaration order: description, name, parameters, strict, defer_loading.
    function_keys_as_sent: bool
    # `Function.strict` is `bool = False` (always dumped, `"strict": false` when unset, a
    # null refused); else `Optional[bool] = None`, dropped from the dump when unset.
    strict_always_dumped: bool
    # Message members the generic message model does not declare in this release: pydantic
    # drops them before the template sees the message (`phase` is declared from 0.5.20,
    # `prefix` from 0.5.23).
    undeclared_message_members: frozenset[str]
    # Roles the generic message model refuses in this release (`root` is accepted from 0.5.23).
    refused_roles: frozenset[str]

    @property
    def label(self) -> str:
        """How messages name these rules: 'SGLang 0.5.16 rules'."""
        return f"SGLang {self.since} rules"


# Read from the sglang-0.5.16 wheel (the rollout framework's Docker image pins it); the
# 0.5.19 wheel has the same models.
SGLANG_0_5_16 = SglangRules(
    since="0.5.16",
    function_keys_as_sent=False,
    strict_always_dumped=True,
    undeclared_message_members=frozenset({"phase", "prefix"}),
    refused_roles=frozenset({"root"}),
)
# 0.5.20 declares `phase` (read from the 0.5.20 wheel; 0.5.21 and 0.5.22 are the same).
SGLANG_0_5_20 = SglangRules(
    since="0.5.20",
    function_keys_as_sent=False,
    strict_always_dumped=True,
    undeclared_message_members=frozenset({"prefix"}),
    refused_roles=frozenset({"root"}),
)
# Read from the sglang-0.5.23 wheel: `root`, `prefix` and the `Function` that keeps the
# client's keys are all new in it.
SGLANG_0_5_23 = SglangRules(
    since="0.5.23",
    function_keys_as_sent=True,
    strict_always_dumped=False,
    undeclared_message_members=frozenset(),
    refused_roles=frozenset(),
)

RULE_SETS: tuple[SglangRules, ...] = (SGLANG_0_5_16, SGLANG_0_5_20, SGLANG_0_5_23)
OLDEST = RULE_SETS[0]
NEWEST = RULE_SETS[-1]

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")
# sglang/version.py's answer when the package was not built (a source checkout): a
# development build, most likely newer than any release.
_UNBUILT = "0.0.0.dev0"


def parse_version(version: str) -> tuple[int, int, int] | None:
    """The release numbers of an SGLang version string ('0.5.16', '0.5.23.post1',
    '0.5.22rc0'); None when it starts with none."""
    match = _VERSION.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


@functools.cache  # one warning per version and process, however often it is asked
def rules_for(version: str) -> SglangRules:
    """The rules of SGLang `version`: the newest set whose `since` is not after it. A
    version newer than every known one gets the newest rules; one older than the oldest
    known gets the oldest, with a warning (nobody read that release); an unparsable one
    (or an unbuilt source checkout's '0.0.0.dev0') gets the newest, with a warning."""
    numbers = parse_version(version)
    if numbers is None or version.strip() == _UNBUILT:
        logger.warning("SGLang version %r is not a release number: %s apply", version, NEWEST.label)
        return NEWEST
    chosen: SglangRules | None = None
    for rules in RULE_SETS:
        since = parse_version(rules.since)
        assert since is not None
        if since <= numbers:
            chosen = rules
    if chosen is None:
        logger.warning(
            "SGLang %s is older than the oldest release sessiongate knows (%s): %s apply",
            version,
            OLDEST.since,
            OLDEST.label,
        )
        return OLDEST
    return chosen
