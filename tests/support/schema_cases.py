"""Property-based checks of a running gateway against the OpenAPI document it serves.

Shared by the bounded test (tests/front/test_schema.py) and the long run
(benches/stress/schema_fuzz.py).
schemathesis generates requests from `/openapi.json`; every reply must be documented there
(status code, content type, body schema, headers) and must not be a server error other than
the upstream failures the document names (502, 503, 504).
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS

# Server errors a schema-valid request may meet: the upstream's (proxied) or a down worker.
ALLOWED_5XX = frozenset({502, 503, 504})
CHECK_NAMES = (
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
)


def load_schema(base_url: str) -> Any:
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    # Base URL of the requests (the document names no servers).
    return schema.configure(base_url=base_url) if hasattr(schema, "configure") else schema


def operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


class SessionPool:
    """Real session ids for generated requests: a random id only ever reaches the 404 path,
    so two of every three session cases are pointed at a fresh, existing session."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.client = httpx.Client(timeout=30)
        self.counter = itertools.count()

    def maybe_real(self, case: Any) -> None:
        params = case.path_parameters or {}
        if "session_id" in params and next(self.counter) % 3:
            created = self.client.post(self.base_url + "/sessions")
            assert created.status_code == 200, created.text
            params["session_id"] = created.json()["session_id"]

    def close(self) -> None:
        self.client.close()


# The plain proxies relay the engine's reply as it is: SGLang's `/health` is a 200 with no
# body and no Content-Type (http_server.py `health_generate`). Such an untyped engine reply
# is checked for its status only; the gateway's own replies on these routes are typed.
RELAYED_PATHS = frozenset({"/sessions/{session_id}/{path}", "/v1/{path}"})
UNTYPED_CHECKS = ("status_code_conformance", "response_headers_conformance")


def check_case(case: Any, base_url: str, pool: SessionPool) -> None:
    pool.maybe_real(case)
    response = case.call(base_url=base_url, timeout=30)
    names = CHECK_NAMES
    untyped = "content-type" not in {k.lower() for k in response.headers}
    if case.operation.path in RELAYED_PATHS and untyped:
        names = UNTYPED_CHECKS
    case.validate_response(response, checks=[CHECKS.get_one(name) for name in names])
    status = response.status_code
    assert status < 500 or status in ALLOWED_5XX, (
        f"server error {status} on {case.method} {case.formatted_path}: {response.text[:500]}"
    )


def fuzz_operation(
    operation: Any,
    base_url: str,
    pool: SessionPool,
    examples: int,
    seed: int | None = None,
    negative: bool = False,
) -> None:
    """Up to `examples` generated requests to one operation; raises on the first failure
    (not shrunk: a failing case is reported as generated, to keep runs bounded). `negative`
    generates requests that break the schema (wrong types, missing members) instead: they
    must be refused with a documented 4xx, never a server error."""
    mode = GenerationMode.NEGATIVE if negative else GenerationMode.POSITIVE

    @settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=seed is not None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        check_case(case, base_url, pool)

    if seed is not None:
        run._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]
    try:
        run()
    except Unsatisfiable:
        # Negative mode on an operation whose inputs no value can violate (no parameters,
        # or only an unconstrained string): nothing to test.
        if not negative:
            raise


def fuzz_all(
    base_url: str, examples: int, seed: int | None = None, negative: bool = False
) -> list[str]:
    """Every operation of the served document; the failures, one text each."""
    schema = load_schema(base_url)
    pool = SessionPool(base_url)
    failures: list[str] = []
    try:
        for operation in operations(schema):
            try:
                fuzz_operation(operation, base_url, pool, examples, seed, negative)
            except Exception as exc:
                failures.append(f"{operation.label}: {exc}")
    finally:
        pool.close()
    return failures
