"""Choosing the SGLang version the prompts render by (engines/engine_versions.py), with the
engines' answers given, and the refusal of a registered engine of another rule set."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sessiongate.engines.engine_versions import choose_sglang_version, registration_refusal
from sessiongate.sglang_rules import NEWEST

FLAG = "--sglang-version"


def reader(answers: dict[str, str | None]):  # type: ignore[no-untyped-def]
    def read(urls: Sequence[str]) -> dict[str, str | None]:
        return {url: answers[url] for url in urls}

    return read


def test_a_given_version_is_taken_without_asking() -> None:
    def never(urls: Sequence[str]) -> dict[str, str | None]:
        raise AssertionError("the engines were asked")

    choice = choose_sglang_version("0.5.16", ["http://a"], flag=FLAG, read=never)
    assert (choice.version, choice.source) == ("0.5.16", "flag")
    assert choice.line == "SGLang 0.5.16 rules (--sglang-version 0.5.16)"


def test_a_given_version_must_be_one() -> None:
    with pytest.raises(ValueError, match="--sglang-version 'latest' is neither 'auto'"):
        choose_sglang_version("latest", [], flag=FLAG)


def test_auto_takes_the_version_the_engines_agree_on() -> None:
    read = reader({"http://a": "0.5.16", "http://b": "0.5.16", "http://c": None})
    choice = choose_sglang_version(
        "auto", ["http://a", "http://b", "http://c"], flag=FLAG, read=read
    )
    assert (choice.version, choice.source) == ("0.5.16", "engines")
    assert choice.line == (
        "SGLang 0.5.16 rules (the engines run SGLang 0.5.16; http://c did not say)"
    )


def test_auto_refuses_engines_that_disagree_naming_each() -> None:
    read = reader({"http://a": "0.5.16", "http://b": "0.5.23"})
    with pytest.raises(ValueError) as caught:
        choose_sglang_version("auto", ["http://a", "http://b"], flag=FLAG, read=read)
    assert "http://a runs 0.5.16, http://b runs 0.5.23" in str(caught.value)


@pytest.mark.parametrize(
    ("urls", "why"),
    [(["http://a"], "no engine reported its version (http://a)"), ([], "no engine configured yet")],
)
def test_auto_without_an_answer_takes_the_newest_rules(urls: list[str], why: str) -> None:
    choice = choose_sglang_version("auto", urls, flag=FLAG, read=reader({"http://a": None}))
    assert (choice.version, choice.source) == (NEWEST.since, "default")
    assert why in choice.line and "the newest known" in choice.line


@pytest.mark.parametrize(
    ("engine", "gateway", "refused"),
    [
        ("0.5.16", "0.5.16", False),
        ("0.5.19", "0.5.16", False),  # other release, same rules
        ("0.5.24", "0.5.23", False),
        ("0.5.16", "0.5.23", True),
        ("0.5.23", "0.5.20", True),
        (None, "0.5.16", False),  # says nothing: nothing to hold against it
        ("0.5.16", "auto", False),  # nothing resolved (remote workers): no check
    ],
)
def test_a_registration_is_refused_only_for_other_rules(
    engine: str | None, gateway: str, refused: bool
) -> None:
    assert (registration_refusal(engine, gateway) is not None) is refused
