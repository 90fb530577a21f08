"""A scripted agent that talks to the session API like a rollout worker would."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


@dataclass
class AgentStats:
    turn_latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def run_session(
    client: httpx.AsyncClient,
    *,
    turns: int,
    index: int,
    stats: AgentStats,
    parent_id: str | None = None,
    child_turns: int = 0,
) -> list[str]:
    """Run one session (and its sub-agent child); return the ids of sessions it created."""
    body = {"parent_session_id": parent_id} if parent_id else None
    response = await client.post("/sessions", json=body)
    response.raise_for_status()
    session_id: str = response.json()["session_id"]
    created = [session_id]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful research agent."},
        {"role": "user", "content": f"Task {index}: find three facts about topic {index % 17}."},
    ]
    for turn in range(turns):
        started = time.perf_counter()
        reply = await client.post(
            f"/sessions/{session_id}/v1/chat/completions",
            json={"model": "demo", "messages": messages, "tools": TOOLS, "max_tokens": 48},
        )
        stats.turn_latencies.append(time.perf_counter() - started)
        if reply.status_code != 200:
            stats.errors.append(f"{session_id} turn {turn}: {reply.status_code} {reply.text}")
            return created
        message = reply.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        if turn == 0 and child_turns:
            created += await run_session(
                client, turns=child_turns, index=index * 1000, stats=stats, parent_id=session_id
            )
        if turn % 2 == 0:
            messages.append({"role": "tool", "content": f"result {turn} for task {index}"})
        else:
            messages.append({"role": "user", "content": f"Good. Now go deeper, step {turn}."})
    return created
