"""`--config FILE` (TOML) and `--print-config`: a file with one value per section starts a
gateway that reports and behaves by those values; flags on the command line win over the
file; a key that is not an option, or a value of the wrong type or out of range, stops the
start with a message naming it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs


def one_value_per_section(tmp_path: Path, port: int, engine: str) -> str:
    return f"""
log_level = "info"

[listen]
port = {port}

[front]
max_body_bytes = 4096

[engines]
urls = ["{engine}"]
health_interval = 2.5

[engines.routing]
policy = "round_robin"

[engines.reliability]
retry_max_retries = 2

[sessions]
allowed_append_roles = "system,tool,user"

[session_routing]
mode = "smg_routing_key"

[limits]
max_sessions = 1

[records]
dir = "{tmp_path / "records"}"

[workers]
count = 1
"""


def sessiongate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sessiongate", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_print_config_shows_the_files_values_and_the_flags_win(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(one_value_per_section(tmp_path, 8123, "http://127.0.0.1:9"))
    shown = sessiongate("serve", "--config", str(path), "--print-config", "--max-sessions", "5")
    assert shown.returncode == 0, shown.stderr
    effective = tomllib.loads(shown.stdout)  # the output is a valid file to start from
    assert effective["log_level"] == "info"
    assert effective["listen"]["port"] == 8123
    assert effective["front"]["max_body_bytes"] == 4096
    assert effective["engines"]["urls"] == ["http://127.0.0.1:9"]
    assert effective["engines"]["health_interval"] == 2.5
    assert effective["engines"]["routing"]["policy"] == "round_robin"
    assert effective["engines"]["reliability"]["retry_max_retries"] == 2
    assert effective["sessions"]["allowed_append_roles"] == "system,tool,user"
    assert effective["session_routing"]["mode"] == "smg_routing_key"
    assert effective["limits"]["max_sessions"] == 5  # the flag wins over the file
    assert effective["records"]["dir"] == str(tmp_path / "records")
    assert effective["workers"]["count"] == 1
    # Options the file left out keep their defaults; the routing table is the chosen
    # policy's variant (round_robin reads no tunable of its own, only those of every policy:
    # siblings', overload protection's, the sticky keys').
    assert effective["engines"]["reliability"]["cb_failure_threshold"] == 10
    assert set(effective["engines"]["routing"]) == {
        "policy",
        "hold_siblings",
        "worker_overload_protection",
        "worker_overload_waiting_requests",
        "worker_overload_token_usage",
        "load_monitor_interval",
        "sticky_sessions",
        "routing_key_headers",
        "max_idle_secs",
        "eviction_interval_secs",
    }
    # Reading the printed file back gives the same configuration.
    again = tmp_path / "again.toml"
    again.write_text(shown.stdout)
    assert sessiongate("serve", "--config", str(again), "--print-config").stdout == shown.stdout


def test_secrets_are_never_printed(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[front]\napi_key = "sekret-value"\n')
    shown = sessiongate("serve", "--config", str(path), "--print-config")
    assert shown.returncode == 0, shown.stderr
    assert "sekret-value" not in shown.stdout
    assert "# api_key: set (--api-key)" in shown.stdout


def test_a_gateway_behaves_by_its_file(tmp_path: Path) -> None:
    with mock_engine() as engine:
        port = free_port()
        path = tmp_path / "gateway.toml"
        path.write_text(one_value_per_section(tmp_path, port, engine.url))
        with ServerProcess(["serve", "--config", str(path)], port, timeout=60) as gateway:
            health = httpx.get(gateway.url + "/health", timeout=10).json()
            assert len(health["workers"]) == 1  # [workers] count
            with httpx.Client(base_url=gateway.url, timeout=30) as client:
                assert client.post("/sessions").status_code == 200
                refused = client.post("/sessions")  # [limits] max_sessions = 1
                assert refused.status_code == 429, refused.text
                big = client.post("/v1/chat/completions", content=b"x" * 5000)
                assert big.status_code == 413  # [front] max_body_bytes
            # [records] dir: the worker's shard directory.
            assert (tmp_path / "records" / "worker-0").is_dir()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[limits]\nmax_sesions = 1\n", "unknown key 'limits.max_sesions'"),
        ("[limit]\nmax_sessions = 1\n", "unknown key 'limit'"),
        ('[limits]\nmax_sessions = "many"\n', "limits.max_sessions (--max-sessions) must be an"),
        ("[engines.routing]\npolicy = 'fastest'\n", "engines.routing.policy (--policy) must be"),
        ("[engines.routing]\ncache_threshold = 2.0\n", "[engines.routing] cache_threshold must"),
        ("[workers]\nlisten = '127.0.0.1:0'\n", "workers.listen (--listen) is not an option of"),
        (
            "[engines.routing]\npolicy = 'round_robin'\ncache_threshold = 0.5\n",
            "engines.routing.cache_threshold does not apply to policy 'round_robin'",
        ),
        ("[front\n", "is not valid TOML"),
    ],
)
def test_a_bad_key_or_value_fails_at_start_naming_it(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    started = sessiongate("serve", "--config", str(path), "--backend", "http://127.0.0.1:9")
    assert started.returncode != 0
    assert named in started.stderr, started.stderr
    assert "Traceback" not in started.stderr


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    started = sessiongate("serve", "--config", str(tmp_path / "nope.toml"))
    assert started.returncode != 0
    assert "cannot read" in started.stderr and "nope.toml" in started.stderr


def test_the_worker_command_reads_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text("[sessions]\nmax_trim_tokens = 4\n[limits]\nmax_sessions = 9\n")
    shown = sessiongate(
        "worker",
        "--config",
        str(path),
        "--print-config",
        "--listen",
        "127.0.0.1:0",
        "--secret-env",
        "S",
        "--backend",
        "http://127.0.0.1:9",
    )
    assert shown.returncode == 0, shown.stderr
    effective = tomllib.loads(shown.stdout)
    assert effective["sessions"]["max_trim_tokens"] == 4
    assert effective["limits"]["max_sessions"] == 9
    assert effective["workers"]["listen"] == "127.0.0.1:0"
    assert "listen" not in tomllib.loads(sessiongate("serve", "--print-config").stdout)["workers"]


def test_the_documented_example_file_is_a_valid_configuration() -> None:
    """docs/deployment.md's full example reads as it says (no process needed)."""
    from sessiongate.config.gateway import GatewayConfig

    docs = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
    example = docs.read_text().split("A full example")[1].split("```toml")[1].split("```")[0]
    config = GatewayConfig.from_dict(tomllib.loads(example), where="docs/deployment.md")
    assert config.engines.routing.policy == "cache_aware"
    assert config.workers.count == 8 and config.records.dir == "/data/sessiongate"
