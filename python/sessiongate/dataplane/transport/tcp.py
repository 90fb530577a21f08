"""TCP plumbing of remote worker channels: endpoints, the shared secret, TLS contexts and
socket options. The handshake itself is in `handshake.py`."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

from sessiongate.process.children import listening_socket

logger = logging.getLogger(__name__)

SECRET_ENV = "SESSIONGATE_WORKER_SECRET"
MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str, *, allow_port_zero: bool = False) -> Endpoint:
    """`HOST:PORT`, `[IPv6]:PORT`; ValueError with the reason otherwise."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: put an IPv6 address in brackets, e.g. [::1]:7000")
    if not port_text.isdigit() or not (0 if allow_port_zero else 1) <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    return Endpoint(host, int(port_text))


def parse_endpoints(text: str) -> list[Endpoint]:
    endpoints = [parse_endpoint(part) for part in text.split(",") if part.strip()]
    if not endpoints:
        raise ValueError("no worker endpoint given")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"worker endpoints must be distinct: {text}")
    return endpoints


def _checked(secret: bytes, where: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the shared secret in {where} is {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def load_secret(path: str | None, env: str | None = None) -> bytes:
    """The shared secret from a file (surrounding whitespace stripped) or an environment
    variable; ValueError naming the problem."""
    if path:
        file = Path(path)
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the secret file {path}: {exc.strerror}") from None
        if file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("secret file %s is readable by other users (chmod 600 it)", path)
        return _checked(data, path)
    if env:
        value = os.environ.get(env)
        if not value:
            raise ValueError(f"environment variable {env} (the shared secret) is not set")
        return _checked(value.encode(), f"${env}")
    raise ValueError("a shared secret is required (--secret-file)")


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def client_tls_context(ca: str | None, insecure: bool) -> ssl.SSLContext:
    """Verify the worker's certificate against `ca` (and its host name), or with
    `insecure` encrypt without verifying (against eavesdroppers only: an active man in the
    middle could terminate TLS on both sides and relay the handshake)."""
    if insecure:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = ssl.create_default_context(cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay for small frames; keepalive so a vanished peer (host down, cable
    pulled) is noticed by the kernel within about 30 s instead of hours."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def listen_socket(endpoint: Endpoint, backlog: int = 16) -> socket.socket:
    """A worker's non-blocking listening socket (see `listening_socket`)."""
    return listening_socket(endpoint.host, endpoint.port, backlog)
