"""Checks that a recorded session is token-exact."""

from __future__ import annotations

from typing import Any


def completion_ids(response: dict[str, Any]) -> list[int]:
    entries = response["choices"][0]["meta_info"]["output_token_logprobs"]
    return [int(entry[1]) for entry in entries]


def trajectory_problems(session: dict[str, Any]) -> list[str]:
    """Why `session` (a GET /sessions/{id} body) is not token-exact; empty when it is.

    Every turn's prompt must extend the previous turn's prompt + sampled completion, and
    the accumulated ids must be the last prompt + its completion.
    """
    problems: list[str] = []
    previous: list[int] = []
    for index, record in enumerate(session["records"]):
        prompt = record["request"]["input_ids"]
        if prompt[: len(previous)] != previous:
            problems.append(f"turn {index}: prompt does not extend the previous checkpoint")
        previous = prompt + completion_ids(record["response"])
    metadata = session["metadata"]
    if metadata["accumulated_token_ids"] != previous:
        problems.append("accumulated_token_ids != last prompt + completion")
    mismatch = metadata.get("tito_session_mismatch") or []
    if mismatch:
        problems.append(f"re-render mismatch: {mismatch}")
    return problems
