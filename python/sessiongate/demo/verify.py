"""Checks that a recorded session is token-exact."""

from __future__ import annotations

import json
from typing import Any


def completion_ids(response: dict[str, Any]) -> list[int]:
    entries = response["choices"][0]["meta_info"]["output_token_logprobs"]
    return [int(entry[1]) for entry in entries]


def trajectory_problems(session: dict[str, Any]) -> list[str]:
    """Why `session` (a GET /sessions/{id} body) is not token-exact; empty when it is.

    Every turn's prompt must extend the previous turn's prompt + sampled completion (but
    for the session's `max_trim_tokens` trailing ids: GLM 4.7's sampled stop token, which the
    next message renders itself), and the accumulated ids must be the last prompt + its
    completion.
    """
    problems: list[str] = []
    previous: list[int] = []
    trim = int((session.get("metadata") or {}).get("max_trim_tokens") or 0)
    for index, record in enumerate(session["records"]):
        prompt = record["request"]["input_ids"]
        kept = previous[: max(0, len(previous) - trim)]
        if prompt[: len(kept)] != kept:
            problems.append(f"turn {index}: prompt does not extend the previous checkpoint")
        previous = prompt + completion_ids(record["response"])
    metadata = session["metadata"]
    if metadata["accumulated_token_ids"] != previous:
        problems.append("accumulated_token_ids != last prompt + completion")
    # sessiongate's own view: the framework's report also counts a last turn cut off by
    # max_tokens (no end-of-turn token sampled) as special_token_count.
    mismatch = metadata.get("tito_session_mismatch_detail") or []
    if mismatch:
        problems.append(f"re-render mismatch: {mismatch}")
    return problems


class RecordsVerifier:
    """Records hook for the bench driver: checks every fetched session as it arrives.

    Bodies are checked and dropped at once, so a long run keeps only the problems.
    """

    def __init__(self) -> None:
        self.checked = 0
        self.exact = 0
        self.problems: list[str] = []

    def __call__(self, handle: object, body: bytes) -> None:
        session_id = getattr(handle, "session_id", str(handle))
        self.checked += 1
        try:
            problems = trajectory_problems(json.loads(body))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            problems = [f"records are not a session document: {type(exc).__name__}: {exc}"]
        if problems:
            self.problems += [f"{session_id}: {p}" for p in problems]
        else:
            self.exact += 1
