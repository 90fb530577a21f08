"""Decoding and checking a /samples payload (the rollout framework's wire format)."""

from __future__ import annotations

import json
import struct
from array import array
from typing import Any

_WIRE_DTYPES = {
    "tokens": ("I64", "q"),
    "loss_mask": ("U8", "B"),
    "rollout_log_probs": ("F64", "d"),
    "rollout_routed_experts": ("I32", "i"),
    "rollout_indexer_topk": ("I32", "i"),
}


_ITEM = {"I64": 8, "F64": 8, "I32": 4, "U8": 1}


def read_safetensors(payload: bytes) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes), checking the container's rules: u64 LE header
    length, a JSON object header, data offsets that tile the data section exactly."""
    (header_len,) = struct.unpack_from("<Q", payload)
    header = json.loads(payload[8 : 8 + header_len])
    assert "__metadata__" not in header  # the framework's save passes no metadata
    data = payload[8 + header_len :]
    spans = sorted((info["data_offsets"], name) for name, info in header.items())
    at = 0
    tensors = {}
    for (begin, end), name in spans:
        assert begin == at, f"{name} does not start where the previous tensor ended"
        info = header[name]
        count = 1
        for dim in info["shape"]:
            count *= dim
        assert end - begin == count * _ITEM[info["dtype"]]
        # Aligned to its item size (8-byte padded header + widest-first layout).
        assert (8 + header_len + begin) % _ITEM[info["dtype"]] == 0, name
        tensors[name] = (info["dtype"], tuple(info["shape"]), data[begin:end])
        at = end
    assert at == len(data), "trailing bytes after the last tensor"
    return tensors


def decode_samples_payload(payload: bytes) -> dict[str, Any]:
    """The framework's driver-side decode: JSON fields from `_samples_meta`, tensors per
    sample (dtype-checked), null markers only for tensor fields, no unreferenced tensor."""
    tensors = read_safetensors(payload)
    dtype, shape, raw = tensors.pop("_samples_meta")
    assert dtype == "U8" and len(shape) == 1
    meta = json.loads(raw.decode("utf-8"))
    samples = []
    for i, sample_meta in enumerate(meta["samples"]):
        nulls = set(sample_meta.pop("nulls"))
        assert nulls <= set(_WIRE_DTYPES)
        sample = dict(sample_meta)
        for field_name, (want, code) in _WIRE_DTYPES.items():
            if field_name in nulls:
                sample[field_name] = None
                continue
            dtype, shape, raw = tensors.pop(f"{field_name}.{i}")
            assert dtype == want, f"{field_name} has dtype {dtype}"
            values = array(code, raw)
            sample[field_name] = (shape, values) if want == "I32" else list(values)
        samples.append(sample)
    assert not tensors, f"unreferenced tensors {sorted(tensors)}"
    return {
        "samples": samples,
        "session_metadata": meta["session_metadata"],
        "empty_reason": meta["empty_reason"],
    }


def check_with_safetensors(payload: bytes, reply: dict[str, Any]) -> None:
    """The real reader agrees, and the reference writer gives the very same bytes."""
    try:
        import numpy as np
        import safetensors.numpy
    except ImportError:
        return  # covered by test_payload_matches_the_reference_writer's skip reason
    loaded = safetensors.numpy.load(payload)
    rebuilt: dict[str, Any] = {}
    for i, sample in enumerate(reply["samples"]):
        assert loaded[f"tokens.{i}"].dtype == np.int64
        assert loaded[f"tokens.{i}"].tolist() == sample["tokens"]
        assert loaded[f"loss_mask.{i}"].tolist() == sample["loss_mask"]
        assert loaded[f"rollout_log_probs.{i}"].tolist() == sample["rollout_log_probs"]
        rebuilt[f"tokens.{i}"] = np.asarray(sample["tokens"], dtype=np.int64)
        rebuilt[f"loss_mask.{i}"] = np.asarray(sample["loss_mask"], dtype=np.uint8)
        rebuilt[f"rollout_log_probs.{i}"] = np.asarray(sample["rollout_log_probs"])
        for name in ("rollout_routed_experts", "rollout_indexer_topk"):
            if sample[name] is not None:
                shape, values = sample[name]
                arr = np.asarray(values, dtype=np.int32).reshape(shape)
                assert np.array_equal(loaded[f"{name}.{i}"], arr)
                rebuilt[f"{name}.{i}"] = arr
    meta = np.frombuffer(loaded["_samples_meta"].tobytes(), dtype=np.uint8)
    rebuilt["_samples_meta"] = meta
    assert safetensors.numpy.save(rebuilt) == payload
