"""SGLang's native `POST /generate`: what it accepts, what it refuses, what it answers.

Read from SGLang 0.5.23 (`sglang/srt/` unless said otherwise): the route in
`entrypoints/http_server.py` (`generate_request`, `serve_generate_request`), the JSON
contract gate `sglang/api/v1/api_types.py` (`decode_GenerateRequest`, strict types, unknown
`sampling_params` keys refused), `managers/io_struct.py` `GenerateReqInput`
(`normalize_batch_and_arguments`: single or batch, rid and extra_key rules),
`sampling/sampling_params.py` `verify`, and `managers/tokenizer_manager.py`
(`_handle_batch_output`, `_stream_one_response`, `add_logprob_to_meta_info`,
`detokenize_logprob_tokens`, `_stream_batch_responses`) for the reply. Three kinds of
refusal, each with its own body: the contract gate's `{"error": "<serde text>"}`, a
`ValueError` from normalisation or validation `{"error": {"message": ...}}` (in a stream:
a 200 whose one event is the error, then `[DONE]`), and FastAPI's request validation
(`ErrorResponse`, as the chat route answers a body that is not JSON).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sessiongate.mock_engine.chat_request import ApiError, _lora
from sessiongate.mock_engine.completion import Completion
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.generate import ABORT_FINISH
from sessiongate.mock_engine.reply import weight_version_spans
from sessiongate.mock_engine.routed_experts import routed_experts_b64_parts
from sessiongate.mock_engine.tokens import TokenizerLike

# SamplingParams.max_new_tokens default (sampling/sampling_params.py, api_types.py).
DEFAULT_MAX_NEW_TOKENS = 128
# api_types.py `_FIELDS_SamplingParams`: any other key in sampling_params is refused.
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
ROUTED_EXPERTS_PLACEHOLDER = "@@sessiongate-mock-generate-routed-experts@@"


class ContractError(Exception):
    """api_types.py JsonContractError: a 400 `{"error": "<message>"}` before anything runs."""


class GenerateValueError(Exception):
    """A ValueError of the tokenizer manager: 400 `{"error": {"message": ...}}`, or in a
    stream an error event in a 200."""


# ---- the contract gate (api_types.py), serde's texts ----


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _bad(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, expected: str = "i64") -> None:
    if not _is_int(v):
        raise _bad(v, expected)


def _bool(v: Any, expected: str = "a boolean") -> None:
    if not isinstance(v, bool):
        raise _bad(v, expected)


def _str(v: Any, expected: str = "a string") -> None:
    if not isinstance(v, str):
        raise _bad(v, expected)


def _seq(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(v, "a sequence")
    return v


def _or_list(v: Any, one: Any, name: str) -> None:
    if isinstance(v, list):
        for e in v:
            one(e)
    elif isinstance(v, bool) and one is _int:
        raise _bad(v, f"a value or an array of values for {name}")
    else:
        try:
            one(v)
        except ContractError:
            raise _bad(v, f"a value or an array of values for {name}") from None


def _token_ids_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise _bad(v, "a value or an array of values for TokenIdsOrList")
    # "[] and [scalar, ...] are one flat list; anything else is a batch."
    if not v or (isinstance(v[0], (int, float)) and not isinstance(v[0], bool)):
        for e in v:
            _int(e)
    else:
        for row in v:
            for e in _seq(row):
                _int(e)


def _sampling(v: Any) -> None:
    if not isinstance(v, dict):
        raise _bad(v, "struct SamplingParams")
    ints = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval")
    floats = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty")
    bools = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")
    for key, x in v.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if x is None:
            continue
        if key in ints or key in ("sampling_seed", "beam_width"):
            _int(x)
        elif key in floats or key == "repetition_penalty":
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                raise _bad(x, "f64")
        elif key in bools or key == "no_stop_trim":
            _bool(x)
        elif key in ("stop", "stop_regex"):
            _or_list(x, _str, "StringOrList")
        elif key == "stop_token_ids":
            for e in _seq(x):
                _int(e)
        elif key in ("json_schema", "regex", "ebnf", "structural_tag"):
            _str(x)


def contract_check(body: Mapping[str, Any]) -> None:
    """api_types.py `decode_GenerateRequest` for the fields the mock reads (unknown
    top-level keys are ignored, as there)."""
    for key, x in body.items():
        if x is None and key not in ("return_prompt_token_ids", "routed_experts_start_len"):
            continue
        if key in ("rid", "text", "extra_key", "cache_salt"):
            _or_list(x, _str, "StringOrList")
        elif key == "input_ids" or key == "token_ids_logprob":
            _token_ids_or_list(x)
        elif key in ("stream", "return_text_in_logprobs", "require_reasoning"):
            _bool(x)
        elif key == "return_prompt_token_ids":
            _bool(x)
        elif key == "sampling_params":
            if isinstance(x, list):
                for e in x:
                    _sampling(e)
            elif isinstance(x, dict):
                _sampling(x)
            else:
                raise _bad(x, "a value or an array of values for SamplingParamsOrList")
        elif key in ("return_logprob", "return_hidden_states", "return_sampling_mask"):
            _or_list(x, _bool, "BoolOrList")
        elif key in ("logprob_start_len", "top_logprobs_num"):
            _or_list(x, _int, "Int64OrList")
        elif key in ("routed_dp_rank", "disagg_prefill_dp_rank", "priority"):
            _int(x)
        elif key == "routed_experts_start_len":
            _int(x)
        elif key in ("routing_key", "session_id"):
            _str(x)
        elif key == "lora_path":
            if isinstance(x, list):
                for e in x:
                    if e is not None:
                        _str(e)
            else:
                _or_list(x, _str, "OptionalStringOrList")


# ---- normalisation (io_struct.py GenerateReqInput) and validation ----


@dataclass(frozen=True, slots=True)
class GenItem:
    """One prompt of a /generate request, normalised as `GenerateReqInput.__getitem__`."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    seed: int | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    want_r3: bool = False
    r3_start: int = 0
    r3_error: str | None = None
    lora: str | None = None
    extra_key: str | None = None
    cache_salt: str | None = None
    return_prompt_token_ids: bool = False


@dataclass(slots=True)
class GenRequest:
    items: list[GenItem]
    is_single: bool
    stream: bool
    extras: dict[str, Any] = field(default_factory=dict)


def _lax_bool(v: Any) -> bool:
    """pydantic's lax bool (FastAPI validates GenerateReqInput before the contract gate)."""
    if isinstance(v, bool):
        return v
    if _is_int(v) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return v.lower() in ("true", "1", "yes", "on")
    raise ApiError(
        str([{"type": "bool_parsing", "loc": ("body",), "msg": "Input should be a valid boolean"}]),
        "Bad Request",
    )


def _per_item(value: Any, num: int, default: Any) -> list[Any]:
    if value is None:
        return [default] * num
    if isinstance(value, list):
        if len(value) != num:
            raise GenerateValueError(f"the mock engine needs one value per prompt, got {value}")
        return value
    return [value] * num


def _verify_sampling(sp: Mapping[str, Any]) -> None:
    """sampling_params.py `SamplingParams.verify`, the checks the mock applies."""
    temperature = sp.get("temperature")
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0):
        raise GenerateValueError(
            f"temperature must be a non-negative finite number, got {temperature}."
        )
    top_p = sp.get("top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GenerateValueError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = sp.get("top_k")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise GenerateValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    max_new = sp.get("max_new_tokens")
    if max_new is not None and max_new < 0:
        raise GenerateValueError(f"max_new_tokens must be at least 0, got {max_new}.")


def parse_generate(
    body: dict[str, Any], cfg: MockEngineConfig, tokenizer: TokenizerLike
) -> GenRequest:
    """Validate a /generate body in SGLang's order: FastAPI's lax types, the contract
    gate, `normalize_batch_and_arguments`, LoRA, tokenisation and `verify`, the scheduler's
    routed_experts_start_len check."""
    want_r3_raw = body.get("return_routed_experts")
    want_r3 = _lax_bool(want_r3_raw) if want_r3_raw is not None else False
    contract_check(body)
    stream = body.get("stream") is True
    prompts, is_single, from_text = _prompts(body)
    sampling = body.get("sampling_params")
    _refuse_parallel_sampling(sampling)
    num = len(prompts)
    if is_single:
        rids, keys, salts = _single_request_keys(body, sampling)
    else:
        rids, keys, salts = _batch_request_keys(body, num)
    samplings = _per_item(sampling if isinstance(sampling, list) else None, num, sampling or {})
    loras = _per_item(body.get("lora_path"), num, None)
    return_logprobs = _per_item(body.get("return_logprob"), num, False)
    starts = _per_item(body.get("logprob_start_len"), num, -1)
    tops = _per_item(body.get("top_logprobs_num"), num, 0)
    # tokenizer_manager.py `_validate_and_resolve_lora` runs for the whole request first.
    resolved = _resolve_loras(loras, cfg)
    r3_start = body.get("routed_experts_start_len") or 0
    items: list[GenItem] = []
    for i in range(num):
        ids = _prompt_ids(prompts[i], from_text, tokenizer)
        sp = samplings[i] or {}
        _verify_sampling(sp)
        stop = sp.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        r3_error = None
        if want_r3 and cfg.r3_enabled:  # scheduler.py `handle_generate_request`
            r3_error = _r3_start_error(r3_start, len(ids))
        items.append(
            GenItem(
                rid=rids[i],
                prompt_ids=ids,
                max_new_tokens=sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
                if sp.get("max_new_tokens") is not None
                else DEFAULT_MAX_NEW_TOKENS,
                stop=stops,
                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                ignore_eos=sp.get("ignore_eos") is True,
                no_stop_trim=sp.get("no_stop_trim") is True,
                seed=sp.get("sampling_seed"),
                return_logprob=return_logprobs[i] is True,
                logprob_start_len=starts[i],
                top_logprobs_num=tops[i],
                return_text_in_logprobs=body.get("return_text_in_logprobs") is True,
                want_r3=want_r3 and cfg.r3_enabled,
                r3_start=r3_start,
                r3_error=r3_error,
                lora=resolved[i],
                extra_key=keys[i],
                cache_salt=salts[i],
                return_prompt_token_ids=body.get("return_prompt_token_ids") is True,
            )
        )
    if not stream:
        for item in items:
            if item.r3_error is not None:
                # tokenizer_manager.py `_handle_abort_finish_reason`: 400 -> ValueError.
                raise GenerateValueError(item.r3_error)
    return GenRequest(items, is_single, stream)


def _prompts(body: Mapping[str, Any]) -> tuple[list[Any], bool, bool]:
    """The prompts of a body (texts or token id lists), whether it is a single request, and
    whether the prompts are texts."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise GenerateValueError("Either text, input_ids or input_embeds should be provided.")
    prompts: list[Any]
    if text is not None:
        is_single = isinstance(text, str)
        prompts = [text] if is_single else list(text)
        from_text = True
    else:
        assert isinstance(input_ids, list)  # the contract gate saw to it
        if len(input_ids) == 0:
            raise GenerateValueError("input_ids cannot be empty.")
        is_single = _is_int(input_ids[0])
        prompts = [input_ids] if is_single else list(input_ids)
        from_text = False
    return prompts, is_single, from_text


def _refuse_parallel_sampling(sampling: Any) -> None:
    """SGLang's check that every item has the same `n`, then the mock's refusal of n > 1."""
    samplings = sampling if isinstance(sampling, list) else [sampling or {}]
    n = samplings[0].get("n") or 1 if samplings else 1
    if any((s.get("n") or 1) != n for s in samplings):
        raise GenerateValueError(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    if n > 1:
        raise GenerateValueError("the mock engine does not model parallel sampling (n > 1)")


def _single_request_keys(
    body: Mapping[str, Any], sampling: Any
) -> tuple[list[str], list[str | None], list[str | None]]:
    """The rid, extra_key and cache_salt of a single-prompt request, as one-item lists."""
    rid = body.get("rid")
    extra_key, cache_salt = body.get("extra_key"), body.get("cache_salt")
    if isinstance(sampling, list):
        raise GenerateValueError("the mock engine needs sampling_params to be an object")
    rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
    for name, value in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if value is not None and not isinstance(value, str):
            raise GenerateValueError(f"{name} should be a string for a single request.")
    return rids, [extra_key or None], [cache_salt or None]


def _batch_request_keys(
    body: Mapping[str, Any], num: int
) -> tuple[list[str], list[str | None], list[str | None]]:
    """The rids, extra_keys and cache_salts of a batch, one per prompt; rids are unique."""
    rid = body.get("rid")
    extra_key, cache_salt = body.get("extra_key"), body.get("cache_salt")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    else:
        if len(rid) != num:
            raise GenerateValueError(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = list(rid)
    keys: list[str | None] = []
    salts: list[str | None] = []
    for name, value, out in (("extra_key", extra_key, keys), ("cache_salt", cache_salt, salts)):
        if value is None:
            out.extend([None] * num)
        elif isinstance(value, str):
            out.extend([value or None] * num)
        else:
            if len(value) != num:
                raise GenerateValueError(f"The length of {name} should be equal to the batch size.")
            out.extend(v or None for v in value)
    if len(set(rids)) != len(rids):
        dupes = [r for r in dict.fromkeys(rids) if rids.count(r) > 1]
        raise GenerateValueError(f"Duplicate request IDs detected within the request: {dupes}")
    return rids, keys, salts


def _resolve_loras(loras: list[Any], cfg: MockEngineConfig) -> list[str | None]:
    """The adapter of each item (`_lora`'s checks), a refusal as GenerateValueError."""
    resolved: list[str | None] = []
    for lora in loras:
        try:
            resolved.append(_lora({"lora_path": lora}, cfg.model_name, cfg.lora_adapters))
        except ApiError as exc:
            raise GenerateValueError(exc.message) from None
    return resolved


def _prompt_ids(prompt: Any, from_text: bool, tokenizer: TokenizerLike) -> list[int]:
    """A prompt as token ids: a text tokenised, ids checked against the vocabulary."""
    if from_text:
        return list(tokenizer.encode(prompt))
    ids = list(prompt)
    if ids and (min(ids) < 0 or max(ids) >= tokenizer.vocab_size):
        raise GenerateValueError(f"input_ids out of range [0, {tokenizer.vocab_size})")
    return ids


def _r3_start_error(r3_start: int, prompt_len: int) -> str | None:
    """scheduler.py's refusal of a routed_experts_start_len outside the prompt, if any."""
    if r3_start < 0:
        return (
            f"recv_req.routed_experts_start_len={r3_start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if r3_start > prompt_len:
        return (
            f"recv_req.routed_experts_start_len={r3_start} is higher than the number "
            f"of input tokens len(req.origin_input_ids)={prompt_len}. Please use a "
            "smaller routed_experts_start_len."
        )
    return None


# ---- generation tweaks: stop strings and stop token ids ----


def apply_stops(item: GenItem, completion: Completion, tokenizer: TokenizerLike) -> Completion:
    """Cut `completion` at the first stop token id or stop string, as the scheduler's
    `check_finished` does; the text loses the matched stop (unless no_stop_trim), the ids
    keep the token that completed it (detokenizer_manager.py `trim_matched_stop`)."""
    if not item.stop and not item.stop_token_ids:
        return completion
    ids = completion.ids
    for k in range(1, len(ids) + 1):
        tok = ids[k - 1]
        matched: Any = None
        text = tokenizer.decode(ids[: k - 1] if tok in item.stop_token_ids else ids[:k])
        if tok in item.stop_token_ids and tok != tokenizer.end_of_turn_token_id:
            matched = tok
        elif item.stop:
            for s in item.stop:
                at = text.find(s)
                if at >= 0:
                    matched = s
                    if not item.no_stop_trim:
                        text = text[:at]
                    break
        if matched is None:
            continue
        return replace(
            completion,
            ids=ids[:k],
            logprobs=completion.logprobs[:k],
            content=text,
            content_token_count=k,
            finish_reason="stop",
            meta_finish_reason={"type": "stop", "matched": matched},
            token_texts=completion.token_texts[:k],
            token_bytes=completion.token_bytes[:k],
        )
    return completion


# ---- the reply (tokenizer_manager.py) ----


def _prompt_logprob(item: GenItem, completion: Completion, pos: int) -> float | None:
    # The first prompt token has no logprob (nothing before it predicts it).
    if pos == 0:
        return None
    seed = completion.key[pos % len(completion.key)]
    return -round(((seed * 2654435761 + pos * 40503) % 100000) / 25000.0, 6) or 0.0


def _entry(lp: float | None, tid: int, text: str | None) -> list[Any]:
    return [lp, tid, text]


def _top(
    item: GenItem, lp: float | None, tid: int, vocab: int, decode: Any, with_text: bool
) -> list[list[Any]] | None:
    """The mock's top-k at one position: the chosen token first, then ids at fixed strides
    with lower logprobs (sorted, as SGLang's are)."""
    if lp is None:
        return None
    out = []
    for j in range(item.top_logprobs_num):
        t = (tid + j * 7919) % vocab
        v = round(lp - 0.5 * j, 6) if j else lp
        out.append(_entry(v, t, decode([t]) if with_text else None))
    return out


def meta_info(
    item: GenItem,
    completion: Completion,
    *,
    upto: int,
    finished: bool,
    cached: int,
    weight_version: str,
    cfg: MockEngineConfig,
    tokenizer: TokenizerLike,
    e2e_latency: float | None,
    sent_ts: float | None,
    prompt_tokens: int | None = None,
) -> tuple[dict[str, Any], dict[str, list[bytes | memoryview]]]:
    """`_handle_batch_output`'s meta_info after `upto` output tokens, keys in its order."""
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": completion.meta_finish_reason if finished else None,
        "prompt_tokens": completion.prompt_tokens if prompt_tokens is None else prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
    }
    if item.return_logprob:
        with_text = item.return_text_in_logprobs
        decode = tokenizer.decode
        start = item.logprob_start_len
        inputs = []
        if start >= 0:
            for pos in range(start, len(item.prompt_ids)):
                tid = item.prompt_ids[pos]
                text = decode([tid]) if with_text else None
                inputs.append(_entry(_prompt_logprob(item, completion, pos), tid, text))
        outputs = [
            _entry(
                completion.logprobs[i],
                completion.ids[i],
                completion.token_texts[i] if with_text else None,
            )
            for i in range(upto)
        ]
        meta["input_token_logprobs"] = inputs
        meta["output_token_logprobs"] = outputs
        meta["output_token_logprobs_length"] = len(outputs)
        if item.top_logprobs_num > 0:
            vocab = tokenizer.vocab_size
            meta["input_top_logprobs"] = [
                _top(item, e[0], e[1], vocab, decode, with_text) for e in inputs
            ]
            meta["output_top_logprobs"] = [
                _top(item, e[0], e[1], vocab, decode, with_text) for e in outputs
            ]
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = upto
    meta["cached_tokens"] = cached
    meta["weight_versions"] = weight_version_spans(weight_version, upto)
    meta["cached_tokens_details"] = {"device": cached, "host": 0} if cached > 0 else None
    splices: dict[str, list[bytes | memoryview]] = {}
    if finished and item.want_r3 and item.r3_error is None:
        meta["routed_experts"] = ROUTED_EXPERTS_PLACEHOLDER
        splices[ROUTED_EXPERTS_PLACEHOLDER] = routed_experts_b64_parts(
            [*item.prompt_ids, *completion.ids[:upto]],
            cfg.r3_layers,
            cfg.r3_topk,
            cfg.r3_experts,
            item.r3_start,
            seed=cfg.seed,
        )
    if finished and e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if sent_ts is not None:
        meta["response_sent_to_client_ts"] = sent_ts
    return meta, splices


def out_dict(item: GenItem, text: str, ids: Sequence[int], meta: dict[str, Any]) -> dict[str, Any]:
    """One output: text, output_ids, meta_info (and prompt_token_ids when asked)."""
    out: dict[str, Any] = {"text": text, "output_ids": list(ids), "meta_info": meta}
    if item.return_prompt_token_ids:
        out["prompt_token_ids"] = item.prompt_ids
    return out


def r3_abort_meta(item: GenItem, weight_version: str) -> dict[str, Any]:
    """The one chunk of a stream the scheduler aborted for its routed_experts_start_len
    (`set_finish_with_abort`: status 400, err_type BadRequestError, prompt cut to 1)."""
    finish = {**ABORT_FINISH, "message": item.r3_error, "status_code": 400}
    finish["err_type"] = "BadRequestError"
    return {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": 1,
        "weight_version": weight_version,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "weight_versions": weight_version_spans(weight_version, 0),
        "cached_tokens_details": None,
    }
