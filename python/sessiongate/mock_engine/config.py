"""Typed settings of the mock engine, shared by the CLI, the app factory and tests."""

from __future__ import annotations

from dataclasses import dataclass

from sessiongate.sglang_rules import SglangRules, parse_version, rules_for

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, slots=True)
class MockEngineConfig:
    """Everything that shapes the mock engine's replies; validated on construction."""

    host: str = "127.0.0.1"
    port: int = 8001
    seed: int = 0
    tokenizer: str | None = None  # None = the built-in ChatML tokenizer
    model_name: str = "sessiongate-mock"
    completion_tokens: int = 32
    completion_tokens_jitter: int = 0
    ttft_ms: float = 0.0
    token_delay_ms: float = 0.0
    fail_rate: float = 0.0
    fail_status: int = 500
    r3_layers: int = 0  # 0 = R3 off
    r3_topk: int = 0
    r3_experts: int = 64
    tool_call_rate: float = 0.0
    # Tokens per engine step of a stream: SGLang's --stream-interval (default 1).
    stream_chunk_tokens: int = 1
    log_level: str = "warning"
    # SGLang's --weight-version (default "default"); changed at run time by
    # POST /update_weight_version.
    weight_version: str = "default"
    # The SGLang release the mock stands in for: reported as `version` (/server_info,
    # /v1/loads) and whose rules render chat prompts (sglang_rules.py).
    sglang_version: str = "0.5.23"
    # Loaded LoRA adapter names (SGLang: --enable-lora --lora-paths NAME=PATH ...);
    # empty = LoRA disabled, so any lora_path is rejected like SGLang does.
    lora_adapters: tuple[str, ...] = ()
    # SGLang's --reasoning-parser: completions open with a <think> block that is split into
    # reasoning_content. Any name is accepted; all behave like qwen3 / deepseek-r1.
    reasoning_parser: str | None = None
    # SGLang's --tool-call-parser. With it or a reasoning parser, a stream step's logprobs
    # get a chunk of their own when no text carries them (serving_chat.py); without both, a
    # step without text loses them. Requests with tools always take the mock's tool path.
    tool_call_parser: str | None = None
    # Draw words with non-ASCII characters too (multi-token characters, "\ufffd" token texts).
    non_ascii: bool = False
    # Indexer top-k capture (sparse-attention models): meta_info.indexer_topk when both > 0.
    indexer_layers: int = 0
    indexer_topk: int = 0
    # SGLang's --enable-cache-report: usage.prompt_tokens_details.cached_tokens.
    enable_cache_report: bool = False
    # Token budget of the mock's prefix cache (0 = no cache: cached_tokens is always 0).
    prefix_cache_tokens: int = 1 << 20
    # The step scheduler (off: each request sleeps ttft + token delays on its own, as
    # before). On: requests are admitted into one running batch; a prefill step costs
    # prefill_us_per_token per uncached prompt token, a decode step decode_step_ms and
    # gives every running request one token; speed divides every step's time.
    step_scheduler: bool = False
    prefill_us_per_token: float = 20.0
    decode_step_ms: float = 5.0
    speed: float = 1.0
    # SGLang's --max-running-requests: more wait in the queue (num_waiting_reqs).
    max_running_requests: int = 64
    # SGLang's --max-prefill-tokens: the uncached prompt tokens one prefill step admits (the
    # first request of a step is admitted whatever its size; SGLang would chunk it).
    max_prefill_tokens: int = 16384
    # http_server.py HEALTH_CHECK_TIMEOUT (env SGLANG_HEALTH_CHECK_TIMEOUT, default 20 s): how
    # long GET /health_generate waits for its one-token generation, e.g. on a paused engine,
    # before answering 503.
    health_check_timeout: float = 20.0
    # Model paths POST /update_weights_from_disk fails to load (the mock has no weights to
    # read, so a test names the paths that fail); "" always fails.
    reject_model_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} is not in 0..65535")
        if self.completion_tokens < 1:
            problems.append("completion_tokens must be >= 1")
        if not 0 <= self.completion_tokens_jitter < self.completion_tokens:
            problems.append("completion_tokens_jitter must be in [0, completion_tokens)")
        if self.ttft_ms < 0 or self.token_delay_ms < 0:
            problems.append("delays must be >= 0")
        if not 0.0 <= self.fail_rate <= 1.0:
            problems.append("fail_rate must be in [0, 1]")
        if not 400 <= self.fail_status <= 599:
            problems.append("fail_status must be an HTTP error status (400..599)")
        if self.r3_layers < 0 or self.r3_topk < 0:
            problems.append("r3_layers and r3_topk must be >= 0")
        if not 1 <= self.r3_experts <= 65536:
            problems.append("r3_experts must be in 1..65536")
        if self.r3_experts <= 256 and self.r3_topk > self.r3_experts:
            problems.append("r3_topk must be <= r3_experts (experts per token are distinct)")
        if not 0.0 <= self.tool_call_rate <= 1.0:
            problems.append("tool_call_rate must be in [0, 1]")
        if self.stream_chunk_tokens < 1:
            problems.append("stream_chunk_tokens must be >= 1")
        if self.indexer_layers < 0 or self.indexer_topk < 0:
            problems.append("indexer_layers and indexer_topk must be >= 0")
        if self.prefix_cache_tokens < 0:
            problems.append("prefix_cache_tokens must be >= 0")
        if self.prefill_us_per_token < 0 or self.decode_step_ms < 0:
            problems.append("prefill_us_per_token and decode_step_ms must be >= 0")
        if not self.speed > 0:
            problems.append("speed must be > 0")
        if self.max_prefill_tokens < 1:
            problems.append("max_prefill_tokens must be >= 1")
        if self.max_running_requests < 1:
            problems.append("max_running_requests must be >= 1")
        if not self.health_check_timeout > 0:
            problems.append("health_check_timeout must be > 0")
        if not self.weight_version:
            problems.append("weight_version must not be empty")
        if parse_version(self.sglang_version) is None:
            problems.append(f"sglang_version {self.sglang_version!r} is not a release number")
        if any(not name or ":" in name for name in self.lora_adapters):
            problems.append("lora adapter names must be non-empty and contain no ':'")
        if self.log_level not in _LOG_LEVELS:
            problems.append(f"log_level must be one of {', '.join(_LOG_LEVELS)}")
        if problems:
            raise ValueError("invalid mock-engine config: " + "; ".join(problems))

    @property
    def sglang_rules(self) -> SglangRules:
        """The rendering rules of `sglang_version`."""
        return rules_for(self.sglang_version)

    @property
    def r3_enabled(self) -> bool:
        return self.r3_layers > 0 and self.r3_topk > 0

    @property
    def indexer_enabled(self) -> bool:
        return self.indexer_layers > 0 and self.indexer_topk > 0
