"""`sessiongate bench`: a load driver for multi-turn and sub-agent session families.

See docs/bench.md. Modules, one job each: `workload` (session specs and the synthetic
generator), `trace` (the JSONL trace format), `http` (one timed HTTP exchange, SSE
parsing), `targets` (sessiongate session API, plain OpenAI with routing stamps), `driver`
(runs one session family), `pacing` (concurrency, Poisson arrivals, duration, warm-up),
`stats` (records and the summary), `progress`, `report`, `plot`, `runner` (wires a run
together for the CLI and the demo) and `cli`. Tree sessions (`--session-mode tree`):
`tree_workload` (retries, forks, resumes), `tree_driver` (runs one), `tree_log` (what the
driver did, what it expects), `tree_check` (against the gateway's tree and samples).
"""
