"""ChatTokenizer: a fast tokenizer plus its chat template, loaded without ``transformers``.

The gateway needs exactly three things from a model's tokenizer: render a conversation with
the model's chat template, turn that text into ids (and back), and know a few special ids
(end of turn, generation prompt). This module does that from a local Hugging Face tokenizer
directory (``tokenizer.json`` + ``tokenizer_config.json``) or from the built-in tokenizer
shipped in ``data/``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from sessiongate.sglang_rules import NEWEST, SglangRules
from sessiongate.tokenizer.message_shape import sglang_messages
from sessiongate.tokenizer.prompt_encoders import PromptEncoder, encoder_for_model_type
from sessiongate.tokenizer.template import CompiledTemplate, TokenizerError, compile_template
from sessiongate.tokenizer.tool_schema import template_tools

__all__ = [
    "BUILTIN_TOKENIZER_DIR",
    "BUILTIN_TOKENIZER_NAME",
    "RESERVED_TEMPLATE_VARIABLES",
    "ChatTokenizer",
    "TokenizerError",
    "check_template_kwargs",
    "load_tokenizer",
    "read_chat_template_file",
]

BUILTIN_TOKENIZER_DIR = Path(__file__).resolve().parent / "data"
# ``load_tokenizer("builtin")`` also selects the built-in (handy for CLI flags); a local
# directory literally called "builtin" can still be given as "./builtin".
BUILTIN_TOKENIZER_NAME = "builtin"

# Probe conversation used to derive facts from the template by rendering it.
_PROBE_USER = {"role": "user", "content": "Hi"}
_PROBE_MARK = "sessiongate-probe-7f3a"


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` and a compiled chat template, or the prompt encoder of a
    family that has none (DeepSeek V3.2 / V4: tokenizer/prompt_encoders.py).

    Instances are immutable after construction and safe to share between threads: the
    Rust tokenizer is thread-safe and the compiled template renders into a fresh context per
    call. Lazily derived facts (generation prompt, end-of-turn id) are idempotent to compute.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | PromptEncoder,
        eos_token: str,
        name_or_path: str,
        special_tokens: Mapping[str, Any] | None = None,
        template_origin: str | None = None,
        sglang_rules: SglangRules = NEWEST,
    ) -> None:
        self._tok = tokenizer
        # Which SGLang release's tool dump and message shaping `render` follows.
        self._sglang_rules = sglang_rules
        # The gateway controls ids itself: never pad, truncate or keep special tokens literal.
        self._tok.no_padding()
        self._tok.no_truncation()
        self._tok.encode_special_tokens = False
        self._name_or_path = name_or_path
        self._template: CompiledTemplate | PromptEncoder = (
            chat_template
            if isinstance(chat_template, PromptEncoder)
            else compile_template(chat_template, template_origin or name_or_path)
        )
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError(
                f"eos_token {eos_token!r} of {name_or_path} is not in its tokenizer vocabulary"
            )
        self._eos_token = eos_token
        self._eos_token_id = eos_id
        # Template variables, as transformers passes its special_tokens_map: only tokens that
        # are set (a template's `{{ bos_token }}` must render "" when there is none, not "None").
        self._special_vars: dict[str, Any] = {
            k: v for k, v in (special_tokens or {}).items() if v is not None
        }
        self._special_vars.setdefault("eos_token", eos_token)
        self._special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )
        self._generation_prompt_ids: tuple[int, ...] | None = None
        self._end_of_turn_token_id: int | None = None
        self._assistant_header: str | None = None

    # --- ids <-> text --------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids for ``text``; never adds BOS/EOS. Special-token strings map to their ids.

        TokenizerError (a ValueError, so callers answer 400) when ``text`` cannot be encoded
        as UTF-8 (a lone surrogate): the backend would raise a bare TypeError.
        """
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise TokenizerError(
                        f"text is not valid Unicode ({exc.reason} at position {exc.start})"
                    ) from exc
            raise

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    # --- chat template -------------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the chat template (no tokenization).

        ``chat_template_kwargs`` (a request's ``chat_template_kwargs`` object, e.g.
        ``{"enable_thinking": false}``) and ``template_kwargs`` become template variables, as
        in transformers; they may override special-token variables, ``template_kwargs`` win
        over ``chat_template_kwargs``, and neither may set ``messages``, ``tools`` or
        ``add_generation_prompt``.

        The messages reach the template shaped as SGLang shapes them (message_shape.py):
        assistant tool-call ``arguments`` given as JSON text become the object they denote
        (text that is not a JSON object raises TokenizerError), ``content: null`` becomes
        ``""``, other null members are dropped, a tool's text parts are joined. ``tools``
        reach it as SGLang's pydantic dump of them (tool_schema.py; an empty list is None),
        and a tool SGLang refuses raises TokenizerError. Neither ``messages`` nor ``tools``
        is changed.
        """
        _check_messages(messages)
        messages = sglang_messages(messages, self._sglang_rules)
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise TokenizerError("tools must be a list of objects or None")
        tools = template_tools(tools, self._sglang_rules)
        if isinstance(self._template, PromptEncoder):
            # An encoder takes its own switches only: no special-token variables.
            kwargs = dict(check_template_kwargs(chat_template_kwargs or {}))
            kwargs.update(template_kwargs)
            return self._template.render(messages, tools, kwargs)
        variables = {**self._special_vars}
        if chat_template_kwargs:
            variables.update(check_template_kwargs(chat_template_kwargs))
        variables.update(template_kwargs)
        variables["messages"] = messages
        variables["tools"] = tools
        variables["add_generation_prompt"] = add_generation_prompt
        return self._template.render(variables)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """``encode(render(...))``."""
        text = self.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            **template_kwargs,
        )
        return self.encode(text)

    @property
    def sglang_rules(self) -> SglangRules:
        """The SGLang release's rules `render` shapes tools and messages with."""
        return self._sglang_rules

    @property
    def chat_template(self) -> str:
        return self._template.source

    @property
    def renders_deterministically(self) -> bool:
        """Whether `render` is a pure function of its arguments: the template uses neither
        the clock (``strftime_now``) nor randomness (``lipsum``, the ``random`` filter)."""
        return self._template.deterministic

    @property
    def generation_prompt_ids(self) -> list[int]:
        """Ids that ``add_generation_prompt=True`` appends, found by diffing two renderings.

        Computed once with default template kwargs; a template whose generation prompt depends
        on kwargs (e.g. a thinking switch) may append something else when given them.
        """
        if self._generation_prompt_ids is None:
            without = self.render([_PROBE_USER], add_generation_prompt=False)
            with_prompt = self.render([_PROBE_USER], add_generation_prompt=True)
            if not with_prompt.startswith(without):
                raise TokenizerError(
                    f"chat template of {self._name_or_path} is not append-only: the rendering "
                    "with add_generation_prompt=True does not extend the one without"
                )
            self._generation_prompt_ids = tuple(self.encode(with_prompt[len(without) :]))
        return list(self._generation_prompt_ids)

    @property
    def end_of_turn_token_id(self) -> int:
        """The id that closes an assistant turn (ChatML: ``<|im_end|>``).

        Derived from the template: the first special token rendered after an assistant
        message's content. Falls back to eos when the template shows none.
        """
        if self._end_of_turn_token_id is None:
            self._end_of_turn_token_id = self._find_end_of_turn()
        return self._end_of_turn_token_id

    def _find_end_of_turn(self) -> int:
        probe = [_PROBE_USER, {"role": "assistant", "content": _PROBE_MARK}]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except TokenizerError:
            return self._eos_token_id
        at = text.rfind(_PROBE_MARK)
        if at < 0:
            return self._eos_token_id
        tail = self.encode(text[at + len(_PROBE_MARK) :])
        return next((i for i in tail if i in self._special_ids), self._eos_token_id)

    @property
    def assistant_header(self) -> str:
        """Text that opens every assistant turn, or "" if unknown: ``<|im_start|>assistant``
        for ChatML, ``<|im_assistant|>assistant<|im_middle|>`` and more for Kimi-style
        templates, ``]~b]ai`` for MiniMax-style ones.

        Derived from the template, as the rollout framework pins one per model family: the
        common start of the generation prompt and of an assistant message rendered last and
        before a user message (templates drop or add reasoning between those), trailing
        whitespace dropped. "" when the renders disagree, or when the text before a user's
        content contains it too (it would not tell the roles apart).
        """
        if self._assistant_header is None:
            self._assistant_header = self._find_assistant_header()
        return self._assistant_header

    def _find_assistant_header(self) -> str:
        mark = {"role": "assistant", "content": _PROBE_MARK}
        user_mark = {"role": "user", "content": _PROBE_MARK}
        try:
            base = self.render([_PROBE_USER], add_generation_prompt=False)
            openers = [
                self.render([_PROBE_USER], add_generation_prompt=True),
                self.render([_PROBE_USER, mark], add_generation_prompt=False),
                self.render([_PROBE_USER, mark, _PROBE_USER], add_generation_prompt=False),
            ]
            before_user = self.render([user_mark], add_generation_prompt=False)
        except TokenizerError:
            return ""
        if not all(text.startswith(base) for text in openers):
            return ""
        openers = [text[len(base) :] for text in openers]
        openers[1:] = [text.split(_PROBE_MARK, 1)[0] for text in openers[1:]]
        header = _common_prefix(openers).rstrip()
        if not header or header in before_user.split(_PROBE_MARK, 1)[0]:
            return ""
        return header

    # --- facts ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Size of the id space, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str:
        return self._eos_token

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens flagged ``special`` (what ``skip_special_tokens`` drops)."""
        return self._special_ids

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (shared; do not reconfigure it)."""
        return self._tok

    def __repr__(self) -> str:
        return f"ChatTokenizer({self._name_or_path!r}, vocab_size={self.vocab_size})"


# Template variables the renderer sets itself; a kwarg of the same name would silently replace
# the conversation (transformers fails with a TypeError there instead).
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def check_template_kwargs(kwargs: object) -> Mapping[str, Any]:
    """``kwargs`` if it can be passed to the template as variables, else TokenizerError."""
    if not isinstance(kwargs, Mapping):
        raise TokenizerError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise TokenizerError(f"chat_template_kwargs keys must be strings, got {key!r}")
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise TokenizerError(
                f"chat_template_kwargs may not set {key!r}: it is set from the request itself"
            )
    return kwargs


def _common_prefix(texts: list[str]) -> str:
    """The longest text every one of `texts` starts with (character by character)."""
    first, last = min(texts), max(texts)
    end = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), None)
    return first if end is None else first[:end]


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list | tuple):
        raise TokenizerError(f"messages must be a list, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizerError(f"messages[{i}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise TokenizerError(f"messages[{i}] has no string 'role'")


# --- loading ------------------------------------------------------------------------------


def load_tokenizer(
    path: str | os.PathLike[str] | None = None,
    *,
    chat_template_path: str | os.PathLike[str] | None = None,
    prompt_encoder: str | None = None,
    sglang_rules: SglangRules = NEWEST,
) -> ChatTokenizer:
    """Load the built-in tokenizer (``None`` or ``"builtin"``) or a local HF tokenizer dir.

    ``chat_template_path`` names a Jinja template file used instead of the tokenizer's own
    template (``--chat-template-path``, as the rollout framework sets
    ``tokenizer.chat_template`` and SGLang's ``--chat-template`` from the same file).
    ``prompt_encoder`` names a Python prompt encoder used instead of any template
    (``deepseek_v32``, ``deepseek_v4``: tokenizer/prompt_encoders.py); without either, a
    directory whose ``config.json`` names a DeepSeek V3.2 / V4 ``model_type`` is rendered with
    its encoder, as SGLang does.
    ``sglang_rules``: the SGLang release whose rendering rules apply (sglang_rules.py).
    """
    builtin = path is None or (isinstance(path, str) and path == BUILTIN_TOKENIZER_NAME)
    if chat_template_path is not None and prompt_encoder is not None:
        raise TokenizerError("give a chat template or a prompt encoder, not both")
    if prompt_encoder is None and chat_template_path is None and not builtin and path is not None:
        prompt_encoder = _checkpoint_encoder(Path(path))
    if prompt_encoder is not None:
        directory = BUILTIN_TOKENIZER_DIR if builtin or path is None else Path(path)
        name = BUILTIN_TOKENIZER_NAME if builtin or path is None else os.fspath(path)
        return _load_directory(
            directory, name=name, template=PromptEncoder(prompt_encoder), sglang_rules=sglang_rules
        )
    # `builtin` covers None; `or path is None` says so to the type checker.
    if chat_template_path is None:
        if builtin or path is None:
            return _load_builtin(sglang_rules)
        return _load_directory(Path(path), name=os.fspath(path), sglang_rules=sglang_rules)
    template = read_chat_template_file(chat_template_path)
    if builtin or path is None:
        return _load_directory(
            BUILTIN_TOKENIZER_DIR,
            name=BUILTIN_TOKENIZER_NAME,
            template=template,
            sglang_rules=sglang_rules,
        )
    return _load_directory(
        Path(path), name=os.fspath(path), template=template, sglang_rules=sglang_rules
    )


def read_chat_template_file(path: str | os.PathLike[str]) -> tuple[str, str]:
    """The source of a Jinja chat template file and its origin (the path), checked to
    compile; TokenizerError saying why when it is missing, unreadable or not a template."""
    file = Path(path)
    if not file.is_file():
        raise TokenizerError(f"chat template file not found: {file}")
    try:
        source = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"chat template file {file} is not readable: {exc}") from exc
    if not source.strip():
        raise TokenizerError(f"chat template file {file} is empty")
    compile_template(source, str(file))  # a syntax error now, not at the first turn
    return source, str(file)


@functools.cache
def _load_builtin(sglang_rules: SglangRules) -> ChatTokenizer:
    # Shared: instances are immutable, and every worker/test would otherwise reload the file.
    return _load_directory(
        BUILTIN_TOKENIZER_DIR, name=BUILTIN_TOKENIZER_NAME, sglang_rules=sglang_rules
    )


def _read_json(path: Path) -> object:
    # Anything unreadable is "none": the caller falls back to the template path.
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _checkpoint_encoder(directory: Path) -> str | None:
    """The encoder SGLang renders this checkpoint with (chat_encoding.py
    `resolve_chat_encoding_spec` in 0.5.23): DeepSeek V4 always, V3.2 only when the
    tokenizer has no chat template of its own. Read from config.json's `model_type`, as the
    framework's package does."""
    config = _read_json(directory / "config.json")
    encoder = encoder_for_model_type(config.get("model_type") if isinstance(config, dict) else None)
    if encoder == "deepseek_v32":
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        has_template = (directory / "chat_template.jinja").is_file() or (
            isinstance(tokenizer_config, dict) and tokenizer_config.get("chat_template") is not None
        )
        if has_template:
            return None
    return encoder


def _load_directory(
    directory: Path,
    *,
    name: str,
    template: tuple[str, str] | PromptEncoder | None = None,
    sglang_rules: SglangRules = NEWEST,
) -> ChatTokenizer:
    if not directory.exists():
        raise TokenizerError(
            f"tokenizer directory not found: {directory} "
            "(only local Hugging Face tokenizer directories are supported, no hub downloads)"
        )
    if not directory.is_dir():
        raise TokenizerError(f"tokenizer path is not a directory: {directory}")
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerError(
            f"{tokenizer_json} is missing: a fast-tokenizer tokenizer.json is required"
        )
    try:
        tok = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise TokenizerError(f"{tokenizer_json} could not be loaded: {exc}") from exc

    config = _read_json_object(directory / "tokenizer_config.json", required=True)
    special_map = _read_json_object(directory / "special_tokens_map.json", required=False)
    # A given template (source, origin) or encoder replaces the directory's: it need not
    # have one.
    chat_template: str | PromptEncoder
    origin: str | None
    if isinstance(template, PromptEncoder):
        chat_template, origin = template, None
    else:
        chat_template, origin = (
            template if template is not None else _find_chat_template(directory, config)
        )

    special_tokens: dict[str, Any] = {}
    for source in (special_map, config):  # tokenizer_config.json wins, as in transformers
        for key, value in source.items():
            if key.endswith("_token") and (content := _token_content(value)) is not None:
                special_tokens[key] = content
            elif key == "additional_special_tokens" and isinstance(value, list):
                special_tokens[key] = [c for v in value if (c := _token_content(v)) is not None]
    eos = special_tokens.get("eos_token")
    if not isinstance(eos, str):
        raise TokenizerError(
            f"no eos_token in {directory / 'tokenizer_config.json'} or special_tokens_map.json"
        )
    return ChatTokenizer(
        tok,
        chat_template=chat_template,
        eos_token=eos,
        name_or_path=name,
        special_tokens=special_tokens,
        template_origin=origin,
        sglang_rules=sglang_rules,
    )


def _read_json_object(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise TokenizerError(f"{path} is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _find_chat_template(directory: Path, config: Mapping[str, Any]) -> tuple[str, str]:
    """The template source and where it came from.

    A ``chat_template.jinja`` file wins over the config's ``chat_template`` key, as in recent
    transformers (which writes the file and drops the key when saving).
    """
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja_file} is not readable: {exc}") from exc
    config_path = directory / "tokenizer_config.json"
    value = config.get("chat_template")
    if value is None:
        raise TokenizerError(
            f"no chat template for {directory}: {config_path} has no 'chat_template' "
            "and there is no chat_template.jinja"
        )
    if isinstance(value, str):
        return value, str(config_path)
    # Named templates: a list of {"name", "template"} (or a plain mapping name -> template).
    named: dict[object, Any] = {}  # keys as the file has them, names or not
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    elif isinstance(value, Mapping):
        named = dict(value)
    if isinstance(named.get("default"), str):
        return named["default"], f"{config_path} (chat_template 'default')"
    raise TokenizerError(
        f"{config_path}: 'chat_template' has no 'default' template "
        f"(found: {sorted(str(k) for k in named)})"
    )


def _token_content(value: object) -> str | None:
    # Special tokens are stored either as strings or as AddedToken dicts with "content".
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None
