"""The fan-out routes' pieces without processes: the Prometheus merge of `/engine_metrics`,
the per-engine gauges of `/metrics`, and which key guards `/flush_cache`."""

from __future__ import annotations

import asyncio

from sessiongate.dataplane.router.metrics import RouterMetrics, engine_gauges
from sessiongate.engines.fanout import Metric, handle_fanout, merge_metrics
from sessiongate.front.asgi import FrontendSettings, GatewayApp
from sessiongate.protocol import CoreReply, CoreRequest, Op

A, B = "http://a:1", "http://b:2"
LATENCY = "sglang_e2e_request_latency_seconds"
ENGINE_A = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified"} 3.0
# HELP sglang:e2e_request_latency_seconds Histogram of end-to-end request latency.
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="m"} 1.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 2.0
sglang:e2e_request_latency_seconds_sum{model_name="m"} 0.5
sglang:e2e_request_latency_seconds_count{model_name="m"} 2.0
"""
# Another engine: the same metrics, a label value with a comma and a quote, a timestamp,
# an untyped sample and a stray line.
ENGINE_B = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="a,\\"b\\"",engine_type="unified"} 1.0 1700000000000
plain_total 7
this is not a sample
# EOF
"""


def text_of(metrics: dict[str, Metric]) -> list[str]:
    lines: list[str] = []
    for name, family in metrics.items():
        if family.help is not None:
            lines.append(f"# HELP {name} {family.help}")
        if family.kind is not None:
            lines.append(f"# TYPE {name} {family.kind}")
        lines.extend(family.samples)
    return lines


def test_merge_labels_every_sample_and_declares_each_family_once() -> None:
    lines = text_of(merge_metrics([(A, ENGINE_A), (B, ENGINE_B)]))
    assert lines == [
        "# HELP sglang_num_running_reqs The number of running requests.",
        "# TYPE sglang_num_running_reqs gauge",
        f'sglang_num_running_reqs{{model_name="m",engine_type="unified",worker_addr="{A}"}} 3.0',
        # Quoted commas stay inside their value; the timestamp stays with the value.
        'sglang_num_running_reqs{model_name="a,\\"b\\"",engine_type="unified",'
        f'worker_addr="{B}"}} 1.0 1700000000000',
        "# HELP sglang_e2e_request_latency_seconds Histogram of end-to-end request latency.",
        "# TYPE sglang_e2e_request_latency_seconds histogram",
        # The bound is kept last, as the Gateway writes it.
        f'{LATENCY}_bucket{{model_name="m",worker_addr="{A}",le="0.1"}} 1.0',
        f'{LATENCY}_bucket{{model_name="m",worker_addr="{A}",le="+Inf"}} 2.0',
        f'{LATENCY}_sum{{model_name="m",worker_addr="{A}"}} 0.5',
        f'{LATENCY}_count{{model_name="m",worker_addr="{A}"}} 2.0',
        f'plain_total{{worker_addr="{B}"}} 7',
    ]


def test_an_engine_label_of_the_same_name_is_replaced() -> None:
    lines = text_of(merge_metrics([(A, 'x{worker_addr="elsewhere",k="v"} 1\n')]))
    assert lines == [f'x{{k="v",worker_addr="{A}"}} 1']


def test_engine_gauges_sum_every_source_by_normalised_url() -> None:
    front = {"upstreams": [{"url": "http://A:1/", "in_flight": 1, "sent": 10, "healthy": True}]}
    workers = [
        [{"url": A, "in_flight": 2, "sent": 5}, {"url": B, "in_flight": 0, "sent": 1}],
        [{"url": B, "in_flight": 1, "sent": 2}, {"url": "http://gone:3", "sent": 99}],
    ]
    gauges = engine_gauges([(A, True), (B, False)], workers, front)
    assert [(g.url, g.healthy, g.in_flight, g.sent) for g in gauges] == [
        (A, True, 3, 15),
        (B, False, 1, 3),
    ]
    text = RouterMetrics().render([], None, gauges).decode()
    assert f'sessiongate_engine_requests_in_flight{{engine="{A}"}} 3' in text
    assert f'sessiongate_engine_requests_total{{engine="{B}"}} 3' in text
    assert f'sessiongate_engine_healthy{{engine="{B}"}} 0' in text
    assert "# TYPE sessiongate_engine_requests_total counter" in text


def test_flush_cache_takes_the_api_key_not_the_admin_key() -> None:
    seen: list[str] = []

    async def handler(request: CoreRequest) -> CoreReply:
        seen.append(request.op)
        return CoreReply(200, [], b"")

    app = GatewayApp(handler, FrontendSettings(api_key="client", admin_key="admin"))

    async def status(path: str, key: str) -> int:
        async def body() -> bytes:
            return b""

        headers = [("authorization", f"Bearer {key}")]
        reply = await app.respond("POST", path, "", headers, body)
        assert reply is not None
        return reply.status

    async def main() -> None:
        # It changes no routing: the clients' key, as for the requests it follows.
        assert await status("/flush_cache", "client") == 200
        assert await status("/flush_cache", "admin") == 401
        assert await status("/engine_metrics", "client") == 200
        # The engine set itself stays the admin's.
        assert await status("/workers", "client") == 401

    asyncio.run(main())
    assert seen == [Op.FANOUT, Op.FANOUT]


def test_no_engine_is_a_503_and_other_methods_a_405() -> None:
    async def reply(method: str, path: str) -> CoreReply:
        return await handle_fanout(CoreRequest(op=Op.FANOUT, path=path, method=method), [])

    empty = asyncio.run(reply("POST", "/flush_cache"))
    assert (empty.status, empty.body) == (503, b'{"error":"no engine registered yet"}')
    assert asyncio.run(reply("DELETE", "/flush_cache")).status == 405
    assert asyncio.run(reply("POST", "/engine_metrics")).status == 405
    # No engine to read: an empty scrape, not an error.
    assert asyncio.run(reply("GET", "/engine_metrics")).status == 200
