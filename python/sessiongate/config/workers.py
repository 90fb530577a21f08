"""The workers section: how many session worker processes, what happens when one exits,
and where they are when they are not this machine's children (`--worker-endpoints`, Ray);
for `sessiongate worker`, how it listens for its router (docs/deployment.md)."""

from __future__ import annotations

from dataclasses import dataclass

from sessiongate.config.fields import BOTH, ONLY_SERVE, ONLY_WORKER, option, section

ON_EXIT_CHOICES = ("restart", "fail")
# Seconds a new worker connection has to complete TLS and the handshake.
DEFAULT_HANDSHAKE_TIMEOUT = 10.0


@section(title="session workers (docs/deployment.md)", key="workers")
@dataclass(frozen=True)
class WorkersConfig:
    count: int | None = option(
        "--workers",
        parse=int,
        commands=ONLY_SERVE,
        help="session worker processes (default: number of cores; with --ray, worker "
        "actors); sessions are sharded over them by blake2b of the root session id. 0: "
        "in-process, one process serves HTTP and runs the session core (least added latency, "
        "one core, no worker isolation)",
    )
    on_exit: str = option(
        "--on-worker-exit",
        default="restart",
        choices=ON_EXIT_CHOICES,
        commands=ONLY_SERVE,
        help="restart a worker that exits and keep serving the other shards (default), or "
        "stop everything and exit non-zero (fail-fast)",
    )
    endpoints: str | None = option(
        "--worker-endpoints",
        metavar="HOST:PORT,...",
        commands=ONLY_SERVE,
        help="route to these `sessiongate worker` processes instead of starting local "
        "workers; the order fixes the shards (keep it for the deployment's lifetime)",
    )
    secret_file: str | None = option(
        "--secret-file",
        commands=BOTH,
        exclusive="secret",
        help="file with the workers' shared secret (>= 16 bytes; serve: required with "
        "--worker-endpoints)",
    )
    secret_env: str | None = option(
        "--secret-env",
        metavar="NAME",
        commands=ONLY_WORKER,
        exclusive="secret",
        help="environment variable holding the shared secret",
    )
    tls_ca: str | None = option(
        "--tls-ca",
        metavar="FILE",
        commands=ONLY_SERVE,
        help="connect to the workers over TLS and verify their certificates against FILE",
    )
    tls_insecure: bool = option(
        "--tls-insecure",
        default=False,
        kind="switch",
        commands=ONLY_SERVE,
        help="connect over TLS without verifying certificates (stops eavesdroppers, not an "
        "active man in the middle)",
    )
    tls_server_name: str | None = option(
        "--tls-server-name",
        metavar="NAME",
        commands=ONLY_SERVE,
        help="host name to expect in the workers' certificates (default: each endpoint's host)",
    )
    heartbeat_timeout: float = option(
        "--worker-heartbeat-timeout",
        default=10.0,
        parse=float,
        commands=ONLY_SERVE,
        help="reconnect to a remote worker silent for this many seconds (10)",
    )
    shared_memory_replies: bool = option(
        "--no-shared-memory-replies",
        default=True,
        kind="negated",
        commands=ONLY_SERVE,
        help="local workers send records GETs to the router as frames on their socket, not "
        "as files in /dev/shm (by default files, when it has 64 MiB free: about twice the "
        "GET throughput, the router never touches the bytes; docs/ipc.md)",
    )
    lent_replies: bool = option(
        "--no-lent-replies",
        default=True,
        kind="negated",
        commands=ONLY_SERVE,
        help="local workers do not write records GETs on the client's connection (by "
        "default they do, when the compiled front serves the GET and replies go through "
        "/dev/shm: a quarter of the gateway's CPU per MiB; docs/ipc.md)",
    )
    ray: bool = option(
        "--ray",
        default=False,
        kind="switch",
        commands=ONLY_SERVE,
        help="place --workers worker actors in a Ray cluster (pip install 'sessiongate[ray]')",
    )
    ray_address: str | None = option(
        "--ray-address",
        metavar="ADDR",
        commands=ONLY_SERVE,
        help="Ray cluster to join (as ray.init(address=...): 'auto', HOST:PORT, ray://...; "
        "'local' starts a private instance; default: $RAY_ADDRESS, else a cluster started on "
        "this machine, else a new local instance)",
    )
    num_cpus: float = option(
        "--worker-num-cpus",
        default=1.0,
        parse=float,
        commands=ONLY_SERVE,
        help="CPUs each Ray worker actor reserves (1)",
    )
    listen: str | None = option(
        "--listen",
        metavar="HOST:PORT",
        commands=ONLY_WORKER,
        required_in=ONLY_WORKER,
        help="address to listen on ([::1]:PORT for IPv6; port 0 picks a free port)",
    )
    tls_cert: str | None = option(
        "--tls-cert",
        commands=ONLY_WORKER,
        help="PEM certificate: accept only TLS connections",
    )
    tls_key: str | None = option(
        "--tls-key", commands=ONLY_WORKER, help="PEM private key of --tls-cert"
    )
    handshake_timeout: float = option(
        "--handshake-timeout",
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        parse=float,
        commands=ONLY_WORKER,
        help="seconds a new connection has to complete TLS and the handshake "
        f"({DEFAULT_HANDSHAKE_TIMEOUT:g})",
    )
