"""A real gateway over a given engine process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from support.procs import ServerProcess, free_port

R3_ENGINE = ["--r3-layers", "3", "--r3-topk", "2", "--lora-adapters", "client-adapter,trained"]


@contextmanager
def gateway_over(engine: ServerProcess, *args: str, workers: str = "1") -> Iterator[httpx.Client]:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", workers, "--backend", engine.url, *args]
    with (
        ServerProcess(argv, port, timeout=60) as proc,
        httpx.Client(base_url=proc.url, timeout=30) as client,
    ):
        yield client
