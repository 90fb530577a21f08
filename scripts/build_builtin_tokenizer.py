"""Build sessiongate's built-in chat tokenizer (python/sessiongate/tokenizer/data/).

The built-in tokenizer exists so that the gateway, the mock engine and the tests work with no
network and no model download. It is a small byte-level BPE trained on a synthetic corpus that
this script generates itself from word lists (English-like prose, chat turns, tool-call JSON,
code and numbers), plus a ChatML-style chat template.

The build is deterministic: the corpus comes from a seeded ``random.Random``, training runs
single-threaded, and the JSON files are written with fixed formatting, so running the script
twice yields byte-identical files (tests/session/test_tokenizer.py checks this).

Usage::

    python scripts/build_builtin_tokenizer.py            # rewrite the committed data/
    python scripts/build_builtin_tokenizer.py --out DIR  # build elsewhere (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

# BPE merge order depends only on pair counts (ties broken by pair ids), so parallel training is
# reproducible too; running single-threaded just takes thread scheduling out of the question.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "python" / "sessiongate" / "tokenizer" / "data"

SEED = 20240607
# Trained vocabulary (special tokens + 256 bytes + merges); the 6 added non-special tokens come
# on top, so the full id space is exactly 8192.
TRAINED_VOCAB_SIZE = 8186
CORPUS_TARGET_CHARS = 600_000

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML-style template. Written so that rendering is append-only: each message renders
# independently of later ones, the tools block lives inside the first system turn (or a turn of
# its own when there is no leading system message), and the generation prompt is a pure suffix.
# Like Qwen3's, `enable_thinking=false` (a chat_template_kwargs switch) closes an empty think
# block right after the generation prompt, so the model answers without reasoning.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- else -%}
{%- for part in content -%}
{%- if part is string -%}{{ part }}
{%- elif part.type == 'text' -%}{{ part.text }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(start=0) -%}
{%- if tools and messages -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages[0].role == 'system' -%}
{{- render_content(messages[0].content) + '\\n\\n' -}}
{%- set ns.start = 1 -%}
{%- endif -%}
{{- '# Tools\\n\\nThese functions are available, one JSON schema per line:\\n<tools>' -}}
{%- for tool in tools -%}
{{- '\\n' + tool | tojson -}}
{%- endfor -%}
{{- '\\n</tools>\\n\\nTo call a function, reply with one block per call:\\n' -}}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <arguments-object>}\\n</tool_call>' -}}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
{{- '<|im_start|>' + message.role + '\\n' -}}
{%- if message.role == 'assistant' -%}
{%- if message.reasoning_content is string and message.reasoning_content -%}
{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- render_content(message.content) -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '\\n<tool_call>\\n{"name": ' + fn.name | tojson + ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}
{%- else -%}{{- fn.arguments | tojson -}}
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{%- else -%}
{{- render_content(message.content) -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- endif -%}
{%- endif -%}
"""

# --- word lists (hand-written; the corpus only needs to look statistically like text) ---------

FUNCTION_WORDS = """the a an of to in on at for with from by about as into like through after
over between out against during without before under around among and or but if then because
while although so than that this these those there here it its they them their we our you your
he him his she her i me my is are was were be been being have has had do does did will would
can could should may might must not no yes all any some each every many much more most few
other such only own same very just also too now when where why how what which who whom""".split()

NOUNS = """time person year way day thing man world life hand part child eye woman place work
week case point government company number group problem fact question answer result session
request response server client model token text message function value error system user
assistant tool record turn worker router engine prompt context window batch queue thread file
directory path name key list table row column field type schema object array string integer
boolean number date hour minute second month city country river mountain ocean forest garden
house room door window kitchen table chair book paper letter story history science music art
game team school student teacher doctor market price money bank office meeting project plan
idea reason example method process service network memory cache disk machine cluster node
weather temperature rain snow wind sun moon star planet light sound voice language word
sentence paragraph page chapter note report summary data set sample test check update version
release feature bug issue change commit branch merge review build deploy image container pod
account password email address phone street order item product customer payment invoice
delivery package shipment event schedule calendar task job step stage phase goal target
metric score reward policy agent environment episode rollout trajectory gradient loss
hello thanks please sorry morning evening night weekend holiday trip flight hotel ticket
restaurant menu dinner lunch breakfast coffee tea water food recipe car train bus bike road
friend family parent brother sister dog cat animal tree flower health body heart mind question
problem solution option choice decision information knowledge research analysis experiment
result conclusion introduction section figure equation variable parameter argument output
input format header body status code line character byte length size limit timeout deadline
""".split()

VERBS = """be have do say go get make know think take see come want look use find give tell
work call try ask need feel become leave put mean keep let begin seem help talk turn start show
hear play run move live believe hold bring happen write provide sit stand lose pay meet include
continue set learn change lead understand watch follow stop create speak read allow add spend
grow open walk win offer remember love consider appear buy wait serve die send expect build stay
fall cut reach kill remain suggest raise pass sell require report decide pull return explain
hope develop carry break receive agree support hit produce eat cover catch draw choose cause
point listen realize place close involve increase fetch parse encode decode render route store
load save delete update compute measure record replay stream cancel retry validate check
search filter sort count merge split convert format schedule deploy restart monitor thank
like enjoy visit travel cook clean fix solve answer summarize translate describe compare
recommend calculate install configure""".split()

ADJECTIVES = """good new first last long great little own other old right big high different
small large next early young important few public bad same able late hard major better
economic strong possible whole free military true federal international full special easy
clear recent certain personal open red difficult available likely short single medical current
wrong private past foreign fine common poor natural significant similar hot dead central happy
serious ready simple left physical general environmental financial blue democratic dark various
entire close legal religious cold final main green nice huge popular traditional cultural quick
slow quiet loud bright warm cool fresh empty busy valid invalid missing unknown default
internal external remote local global primary secondary optional required exact fast""".split()

ADVERBS = """up so out just now how then more also here well only very even back there down
still in as too when never really most where much why again off always once however
quickly slowly carefully finally recently probably usually already often sometimes together
later soon almost enough quite rather""".split()

NAMES = """Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy
Rupert Sybil Trent Victor Walter Yvonne London Paris Berlin Tokyo Sydney Toronto Madrid Rome
Cairo Lagos Lima Oslo Seoul Mumbai Monday Tuesday Wednesday Thursday Friday Saturday Sunday
January February March April May June July August September October November December
Python Rust JSON HTTP API SQL Linux""".split()

# A little non-English text so common accented and CJK characters get merges of their own.
FOREIGN = """café naïve résumé über straße français español niño canción ação coração
привет мир спасибо данные γειά κόσμος 你好 世界 谢谢 数据 こんにちは 世界 ありがとう 안녕하세요
مرحبا שלום नमस्ते 😀 🚀 ✅ ⚠️ → ← ≤ ≥ ± \u00d7 ÷ € £ ¥ °C""".split()

SYLLABLES = """ba be bi bo bu ka ke ki ko ku ta te ti to tu ra re ri ro ru la le li lo lu ma me
mi mo mu na ne ni no nu sa se si so su pa pe pi po pu da de di do du ga ge gi go gu va ve vi vo
vu za ze zi zo zu cha che chi sho shu tra tre tri pro pre str ion ing er est ly ment ness able
tion sion ous ive al ic""".split()

SUFFIXES = ["", "", "", "s", "ed", "ing", "er", "ly", "ness", "ment", "able", "ful", "less"]

PUNCT_END = [".", ".", ".", "!", "?", ":", ";", "..."]


def pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.30:
        return rng.choice(FUNCTION_WORDS)
    if r < 0.55:
        return rng.choice(NOUNS) + rng.choice(SUFFIXES[:4])
    if r < 0.72:
        return rng.choice(VERBS) + rng.choice(SUFFIXES)
    if r < 0.84:
        return rng.choice(ADJECTIVES)
    if r < 0.89:
        return rng.choice(ADVERBS)
    if r < 0.93:
        return rng.choice(NAMES)
    if r < 0.96:
        return number(rng)
    if r < 0.98:
        return pseudo_word(rng)
    return rng.choice(FOREIGN)


def number(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.4:
        return str(rng.randint(0, 100))
    if r < 0.6:
        return str(rng.randint(100, 100_000))
    if r < 0.75:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f}"
    if r < 0.85:
        return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if r < 0.93:
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return f"{rng.randint(0, 100)}%"


def sentence(rng: random.Random) -> str:
    words = [word(rng) for _ in range(rng.randint(4, 18))]
    for i in range(1, len(words) - 1):
        if rng.random() < 0.06:
            words[i] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(PUNCT_END)


def paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(1, 6)))


def identifier(rng: random.Random) -> str:
    parts = [rng.choice(VERBS), rng.choice(NOUNS)]
    if rng.random() < 0.3:
        parts.append(rng.choice(NOUNS))
    style = rng.random()
    if style < 0.6:
        return "_".join(parts)
    if style < 0.85:
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    return "-".join(parts)


def json_value(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth < 2 and r < 0.15:
        return {rng.choice(NOUNS): json_value(rng, depth + 1) for _ in range(rng.randint(1, 3))}
    if depth < 2 and r < 0.25:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))]
    if r < 0.45:
        return rng.randint(-50, 5000)
    if r < 0.55:
        return round(rng.uniform(-100, 100), rng.randint(1, 3))
    if r < 0.62:
        return rng.choice([True, False, None])
    if r < 0.80:
        return " ".join(word(rng) for _ in range(rng.randint(1, 5)))
    return rng.choice(NAMES)


def tool_schema(rng: random.Random) -> dict[str, object]:
    props = {}
    for _ in range(rng.randint(1, 4)):
        props[rng.choice(NOUNS)] = {
            "type": rng.choice(["string", "integer", "number", "boolean", "array", "object"]),
            "description": sentence(rng),
        }
    return {
        "type": "function",
        "function": {
            "name": identifier(rng),
            "description": sentence(rng),
            "parameters": {
                "type": "object",
                "properties": props,
                "required": sorted(props)[: rng.randint(0, len(props))],
            },
        },
    }


def tool_call_block(rng: random.Random) -> str:
    args = {rng.choice(NOUNS): json_value(rng) for _ in range(rng.randint(1, 4))}
    call = {"name": identifier(rng), "arguments": args}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


def code_snippet(rng: random.Random) -> str:
    name, var, other = identifier(rng), rng.choice(NOUNS), rng.choice(NOUNS)
    n = rng.randint(0, 64)
    r = rng.random()
    if r < 0.4:
        return (
            f"def {name.replace('-', '_')}({var}: int, {other}: str = None) -> dict:\n"
            f'    """{sentence(rng)}"""\n'
            f"    if {var} >= {n} and not {other}:\n"
            f'        raise ValueError(f"bad {var}: {{{var}!r}}")\n'
            f"    for i in range(len({other})):\n"
            f"        {var} += i * {n}\n"
            f"    return {{'{var}': {var}, '{other}': [{n}, {n + 1}]}}\n"
        )
    if r < 0.7:
        return (
            f"const {var} = async ({other}) => {{\n"
            f"  const res = await fetch(`/api/v1/{var}/${{{other}.id}}`);\n"
            f"  if (res.status !== {200 + n}) {{ throw new Error('{sentence(rng)}'); }}\n"
            f"  return res.json();\n"
            f"}};\n"
        )
    if r < 0.85:
        return (
            f"fn {name.replace('-', '_')}(&self, {var}: &[u8]) -> Result<usize, Error> {{\n"
            f"    let {other} = {var}.len().saturating_sub({n});\n"
            f"    Ok({other})\n"
            f"}}\n"
        )
    return (
        f"$ curl -s http://localhost:{8000 + n}/sessions/{rng.getrandbits(64):016x} "
        f"| jq '.records[{n}].{var}'\n"
        f"SELECT {var}, COUNT(*) FROM {other}s WHERE id > {n} GROUP BY {var};\n"
    )


def chat_turns(rng: random.Random) -> str:
    # Role names at line starts, as the chat template lays them out (special tokens excluded:
    # they are never part of BPE merges).
    out = []
    if rng.random() < 0.5:
        out.append("system\n" + paragraph(rng))
    for _ in range(rng.randint(1, 4)):
        out.append("user\n" + paragraph(rng))
        if rng.random() < 0.35:
            out.append("assistant\n" + tool_call_block(rng))
            out.append("tool\n" + json.dumps(json_value(rng), ensure_ascii=False))
        if rng.random() < 0.2:
            out.append("assistant\n<think>\n" + paragraph(rng) + "\n</think>\n\n" + paragraph(rng))
        else:
            out.append("assistant\n" + paragraph(rng))
    return "\n".join(out)


def documents(rng: random.Random) -> Iterator[str]:
    kinds = [
        (0.40, lambda: paragraph(rng)),
        (0.25, lambda: chat_turns(rng)),
        (
            0.12,
            lambda: json.dumps(tool_schema(rng), ensure_ascii=False, indent=rng.choice([None, 2])),
        ),
        (0.08, lambda: tool_call_block(rng)),
        (0.10, lambda: code_snippet(rng)),
        (0.05, lambda: " ".join(number(rng) for _ in range(rng.randint(3, 20)))),
    ]
    while True:
        r = rng.random()
        for p, make in kinds:
            if r < p:
                yield make()
                break
            r -= p
        else:
            yield kinds[0][1]()


def build_corpus() -> list[str]:
    rng = random.Random(SEED)
    docs, total = [], 0
    for doc in documents(rng):
        docs.append(doc)
        total += len(doc)
        if total >= CORPUS_TARGET_CHARS:
            return docs
    raise AssertionError("unreachable")


def build_tokenizer(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    # No normalizer: any text must round-trip byte-exactly.
    # "\n" is split off as its own pre-token before byte-level splitting, so no merge can ever
    # glue a newline to its neighbours. The chat template ends every turn with "<|im_end|>\n",
    # which makes every message boundary a token boundary (TITO relies on this).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def tokenizer_config(tok: Tokenizer) -> dict[str, object]:
    added = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    # Shaped like a Hugging Face tokenizer_config.json so other tools can load the directory.
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": 131072,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_json(path: Path, obj: object) -> None:
    # Fixed formatting (explicit indent, trailing newline) keeps the output stable.
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def tokenizer_json_text(tok: Tokenizer) -> str:
    """tokenizers' serialisation, laid out with one vocab entry / merge per line.

    Plain ``indent`` would spread each merge pair over four lines; one entry per line keeps the
    file small and its diffs readable. Key order is tokenizers' own (vocab in id order).
    """
    data = json.loads(tok.to_str(pretty=False))
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    data["model"]["vocab"], data["model"]["merges"] = "@VOCAB@", "@MERGES@"
    text = json.dumps(data, ensure_ascii=False, indent=1)

    def dump(x: object) -> str:
        return json.dumps(x, ensure_ascii=False)

    vocab_text = "{\n" + ",\n".join(f"{dump(k)}:{v}" for k, v in vocab.items()) + "\n}"
    merges_text = "[\n" + ",\n".join(dump(m) for m in merges) + "\n]"
    text = text.replace('"@VOCAB@"', vocab_text, 1).replace('"@MERGES@"', merges_text, 1)
    assert json.loads(text) == json.loads(tok.to_str(pretty=False))
    return text + "\n"


def build(out: Path) -> None:
    tok = build_tokenizer(build_corpus())
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json_text(tok), encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config(tok))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    build(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        size = (args.out / name).stat().st_size
        print(f"wrote {args.out / name} ({size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
