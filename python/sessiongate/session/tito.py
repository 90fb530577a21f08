"""Token-in, token-out prompt construction: sampled tokens are never re-tokenized.

Turn 1 renders the messages with the chat template. Every later turn reuses the stored
checkpoint (prompt ids + sampled completion ids) and tokenizes only what the agent appended,
rendered under a small synthetic prefix so the cost does not grow with the history.
"""

from __future__ import annotations

import json
import marshal
import threading
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from sessiongate.errors import BadRequest, TitoMismatch
from sessiongate.session.messages import Message
from sessiongate.session.tito_compare import (
    ComparatorSpec,
    FrameworkComparator,
    compare_like_framework,
)
from sessiongate.tokenizer import ChatTokenizer, TokenizerError, check_template_kwargs

# Renders the appended messages after an assistant turn without re-rendering the history.
_SYNTHETIC_SYSTEM: Message = {"role": "system", "content": "sessiongate synthetic prefix"}
# Distinct kwargs sets whose turn suffix is remembered; clients choose kwargs freely, so the
# cache must not grow with them.
_SUFFIX_CACHE_SIZE = 64
# Prefix renderings remembered by `appended_ids`, bounded in count and in size: the request's
# tools are part of both the key and the text, and clients choose them freely.
_PREFIX_CACHE_SIZE = 64
_PREFIX_CACHE_BYTES = 8 << 20

TemplateKwargs = Mapping[str, Any]


def parse_chat_template_kwargs(value: object) -> dict[str, Any]:
    """A request's `chat_template_kwargs` field as a dict; absent (None) is empty.

    Raises BadRequest for anything but an object (as the framework does) and for keys the
    template cannot take (`messages`, `tools`, `add_generation_prompt`).
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    try:
        check_template_kwargs(value)
    except TokenizerError as exc:
        raise BadRequest(str(exc)) from exc
    return dict(value)


def merge_chat_template_kwargs(defaults: TemplateKwargs, request: object) -> dict[str, Any]:
    """Server defaults overlaid by a request's `chat_template_kwargs` (request keys win,
    one level deep, like the framework's merge). Validates the request value."""
    return {**defaults, **parse_chat_template_kwargs(request)}


def _render_key(kwargs: TemplateKwargs, tools: object, tool_calls: object) -> bytes | None:
    """A key that is equal only for equal template variables, or None (not cacheable).

    marshal's format 2 writes exact built-in types only (a subclass is refused; a tuple is
    not a list, 1 not "1" not 1.0 not True, floats bit for bit), dicts in their order, and
    does not depend on refcounts or interning (format 3 does).
    """
    # Any values: marshal itself refuses (ValueError) what it cannot write exactly.
    values: Any = (kwargs, tools, tool_calls)
    try:
        return marshal.dumps(values, 2)
    except (ValueError, TypeError):
        return None


def _kwargs_key(kwargs: TemplateKwargs) -> str:
    # Values may be lists or objects (unhashable); their JSON text is a stable key. repr is the
    # fallback for Python callers passing non-JSON values.
    if type(kwargs) is dict and not kwargs:
        return "{}"  # most turns: what json.dumps gives, without its setup cost
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"), default=repr)


class TitoEngine:
    """Builds prompt ids for a turn and checks checkpoints, for one chat template.

    `chat_template_kwargs` are the server-level template variables (`--chat-template-kwargs`).
    Every method that renders takes the turn's effective kwargs as `template_kwargs` (from
    `resolve_chat_template_kwargs`: defaults overlaid by the request's); None there means the
    server-level ones.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        max_trim_tokens: int = 0,
        chat_template_kwargs: TemplateKwargs | None = None,
        boundary_stop_tokens: Sequence[str] = (),
        end_of_turn_token: str | None = None,
        comparator: ComparatorSpec | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_trim_tokens = max_trim_tokens
        # Stop tokens that also open the next message (TitoFamily.boundary_stop_tokens).
        self.boundary_stop_ids = frozenset(_token_ids(tokenizer, boundary_stop_tokens))
        try:
            defaults = check_template_kwargs(dict(chat_template_kwargs or {}))
        except TokenizerError as exc:
            raise ValueError(f"server chat_template_kwargs: {exc}") from exc
        self.chat_template_kwargs: dict[str, Any] = dict(defaults)
        # Derived with default template variables: the stop token does not depend on switches
        # such as enable_thinking in any template we know of. A family may name it (Inkling
        # closes each message block with a special token before the turn's stop token).
        if end_of_turn_token is not None:
            (self.end_of_turn_id,) = _token_ids(tokenizer, [end_of_turn_token])
        else:
            self.end_of_turn_id = tokenizer.end_of_turn_token_id
        self._suffix_lock = threading.Lock()
        self._suffix_cache: dict[str, tuple[int, ...]] = {}
        # Only a template that uses no clock or randomness renders the same prefix twice.
        self._prefix_reusable = tokenizer.renders_deterministically
        self._prefix_lock = threading.Lock()
        self._prefix_cache: dict[bytes, str] = {}
        self._prefix_cache_bytes = 0
        try:
            self.turn_suffix_ids = self.turn_suffix_for(None)
        except BadRequest as exc:  # a bad server setting is a startup error, not a 400
            raise ValueError(f"server chat_template_kwargs: {exc}") from exc
        # `tito_session_mismatch`'s comparator: the family's (`--tito-model`), resolved now so
        # a tokenizer without its tokens is a startup error; else derived from the template
        # on first use (`framework_comparator`).
        self._comparator = _resolve(tokenizer, comparator) if comparator is not None else None

    def resolve_chat_template_kwargs(self, request_value: object) -> dict[str, Any]:
        """The kwargs a turn renders with: server defaults overlaid by the request's
        `chat_template_kwargs` (request wins). BadRequest if the request value is not an
        object."""
        return merge_chat_template_kwargs(self.chat_template_kwargs, request_value)

    def _effective(self, kwargs: TemplateKwargs | None) -> TemplateKwargs:
        return self.chat_template_kwargs if kwargs is None else kwargs

    def turn_suffix_for(self, template_kwargs: TemplateKwargs | None) -> list[int]:
        """Ids the template renders after an assistant's end-of-turn token (ChatML: "\\n").

        The model stops at the end-of-turn token, so these never appear in sampled ids; they
        are inserted at the junction so the prompt matches what the template would render.
        A template may lay out turns differently under some kwargs, so the answer is cached
        per kwargs set.
        """
        kwargs = self._effective(template_kwargs)
        key = _kwargs_key(kwargs)
        cached = self._suffix_cache.get(key)
        if cached is None:
            # Computed outside the lock: rendering is pure, so a race only computes it twice.
            cached = tuple(self._find_turn_suffix_ids(kwargs))
            with self._suffix_lock:
                if len(self._suffix_cache) >= _SUFFIX_CACHE_SIZE:
                    self._suffix_cache.pop(next(iter(self._suffix_cache)))
                self._suffix_cache[key] = cached
        return list(cached)

    def _find_turn_suffix_ids(self, kwargs: TemplateKwargs) -> list[int]:
        turn: Message = {"role": "assistant", "content": "ok"}
        try:
            rendered = self.tokenizer.apply_chat_template(
                [_SYNTHETIC_SYSTEM, turn], add_generation_prompt=False, chat_template_kwargs=kwargs
            )
        except ValueError:
            # DeepSeek V3.2's encoder refuses, in thinking mode, an assistant turn without
            # reasoning; the text after the end-of-turn token does not depend on it.
            turn = {**turn, "reasoning_content": "ok"}
            try:
                rendered = self.tokenizer.apply_chat_template(
                    [_SYNTHETIC_SYSTEM, turn],
                    add_generation_prompt=False,
                    chat_template_kwargs=kwargs,
                )
            except ValueError as exc:
                raise BadRequest(f"chat template could not render a turn: {exc}") from exc
        if self.end_of_turn_id not in rendered:
            return []
        last = len(rendered) - 1 - rendered[::-1].index(self.end_of_turn_id)
        return rendered[last + 1 :]

    def first_turn_ids(
        self,
        messages: Sequence[Message],
        tools: object,
        template_kwargs: TemplateKwargs | None = None,
    ) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                add_generation_prompt=True,
                tools=_tools_or_none(tools),
                chat_template_kwargs=self._effective(template_kwargs),
            )
        except ValueError as exc:
            raise BadRequest(f"chat template could not render the messages: {exc}") from exc

    def appended_ids(
        self,
        last_assistant: Message,
        appended: Sequence[Message],
        tools: object,
        template_kwargs: TemplateKwargs | None = None,
    ) -> list[int]:
        """Ids of `appended` plus the generation prompt, as rendered after `last_assistant`."""
        stub = _assistant_stub(last_assistant)
        tool_list = _tools_or_none(tools)
        kwargs = self._effective(template_kwargs)
        try:
            without = self._prefix_text(stub, tool_list, kwargs)
            with_new = self.tokenizer.render(
                [_SYNTHETIC_SYSTEM, stub, *appended],
                add_generation_prompt=True,
                tools=tool_list,
                chat_template_kwargs=kwargs,
            )
        except ValueError as exc:
            raise BadRequest(f"chat template could not render the new messages: {exc}") from exc
        if not with_new.startswith(without):
            roles = [m.get("role") for m in appended]
            raise BadRequest(
                f"the chat template is not append-only for the appended roles {roles}: "
                "rendering them changes the text of earlier messages"
            )
        try:
            return self.tokenizer.encode(with_new[len(without) :])
        except ValueError as exc:  # text the tokenizer refuses (tokenizer.encode)
            raise BadRequest(f"the new messages could not be tokenized: {exc}") from exc

    def _prefix_text(
        self, stub: Message, tools: list[dict[str, Any]] | None, kwargs: TemplateKwargs
    ) -> str:
        """The synthetic prefix rendered alone (what `appended_ids` cuts off).

        It depends on the kwargs, the tools and the stub's tool calls only (the stub's content
        is ""), so a deterministic template's rendering is reused. A render that raises is
        not cached: the next call raises the same way.
        """
        key = _render_key(kwargs, tools, stub["tool_calls"]) if self._prefix_reusable else None
        if key is not None:
            cached = self._prefix_cache.get(key)
            if cached is not None:
                return cached
        text = self.tokenizer.render(
            [_SYNTHETIC_SYSTEM, stub],
            add_generation_prompt=False,
            tools=tools,
            chat_template_kwargs=kwargs,
        )
        if key is not None:
            self._remember_prefix(key, text)
        return text

    def _remember_prefix(self, key: bytes, text: str) -> None:
        size = len(key) + len(text)
        if size > _PREFIX_CACHE_BYTES // 4:
            return  # one huge tools list must not flush everything else
        with self._prefix_lock:
            if key in self._prefix_cache:
                return  # another thread rendered it meanwhile (rendering is pure)
            while self._prefix_cache and (
                len(self._prefix_cache) >= _PREFIX_CACHE_SIZE
                or self._prefix_cache_bytes + size > _PREFIX_CACHE_BYTES
            ):
                old_key = next(iter(self._prefix_cache))
                old_text = self._prefix_cache.pop(old_key)
                self._prefix_cache_bytes -= len(old_key) + len(old_text)
            self._prefix_cache[key] = text
            self._prefix_cache_bytes += size

    def junction_ids(
        self, checkpoint: Sequence[int], template_kwargs: TemplateKwargs | None = None
    ) -> list[int]:
        """Tokens the template puts between the last sampled token and the next message.

        After a natural stop that is the turn suffix; after a length cut-off the turn was
        never closed, so the end-of-turn token is inserted too (it was not sampled). Nothing
        for a family whose next message opens with its own stop token (`junction_prefix`).
        """
        if self.boundary_stop_ids:
            return []
        suffix = self.turn_suffix_for(template_kwargs)
        if checkpoint and checkpoint[-1] == self.end_of_turn_id:
            return suffix
        return [self.end_of_turn_id, *suffix]

    @property
    def turn_openers(self) -> frozenset[int] | None:
        """Where a turn starts on a template that closes none (`compare_token_sequences`):
        at a boundary stop token or at the assistant header's first token (GLM's
        `<|assistant|>`); None when turns end with the end-of-turn token."""
        if not self.boundary_stop_ids:
            return None
        header = self.tokenizer.encode(self.tokenizer.assistant_header)
        return self.boundary_stop_ids | frozenset(header[:1])

    def junction_prefix(self, checkpoint: Sequence[int]) -> Sequence[int]:
        """The part of `checkpoint` the next prompt starts with: all of it, or all but a last
        stop token that also opens messages (GLM 4.7's `<|user|>` / `<|observation|>`).

        The appended messages render their own opener, which may be the other one (the model
        stopped at `<|observation|>` after a tool call the agent answered with a user
        message), so the sampled token is dropped either way, as the rollout framework does
        (`max_trim_tokens` 1 lets the next checkpoint differ there).
        """
        if checkpoint and checkpoint[-1] in self.boundary_stop_ids:
            return checkpoint[:-1]
        return checkpoint

    def check_extends(self, previous: Sequence[int], new: Sequence[int], session_id: str) -> None:
        """The previous checkpoint must be a prefix of the new one (up to max_trim_tokens)."""
        check_len = len(previous) - self.max_trim_tokens
        if check_len <= 0:
            return
        head_new = new[:check_len]
        head_prev = previous if check_len == len(previous) else previous[:check_len]
        if _same_ids(head_new, head_prev):
            return
        first = next(
            (i for i, (a, b) in enumerate(zip(head_new, head_prev, strict=False)) if a != b),
            min(len(new), check_len),
        )
        raise TitoMismatch(
            f"session {session_id}: TITO prefix mismatch: the stored {len(previous)} tokens "
            f"(checking the first {check_len}, allowing {self.max_trim_tokens} trailing) are "
            f"not a prefix of the new {len(new)} prompt+completion tokens; first difference "
            f"at index {first}"
        )

    @property
    def framework_comparator(self) -> FrameworkComparator:
        """How `mismatches` compares, as the framework's `create_comparator` configures it.

        Without a family: the template's assistant header (`ChatTokenizer.assistant_header`;
        none known, every text difference is non-assistant), every special token a boundary
        but those inside the header after its first (Kimi's `<|im_middle|>`, as the
        framework's Kimi families leave it out), and the template's turn suffix plus the
        boundary stop tokens trimmed from both tails (the framework's Qwen3, MiniMax and
        GLM 4.7 families trim exactly those).
        """
        if self._comparator is None:
            header = self.tokenizer.assistant_header
            specials = self.tokenizer.special_token_ids
            inside = frozenset(self.tokenizer.encode(header)[1:]) & specials if header else None
            self._comparator = FrameworkComparator(
                assistant_start=header or None,
                special_ids=specials - (inside or frozenset()),
                trim_ids=frozenset(self.turn_suffix_ids) | self.boundary_stop_ids,
            )
        return self._comparator

    def mismatches(
        self,
        messages: Sequence[Message],
        tools: object,
        accumulated: Sequence[int],
        template_kwargs: TemplateKwargs | None = None,
    ) -> list[dict[str, Any]]:
        """`tito_session_mismatch`: the accumulated ids against a fresh render of the whole
        history, as the rollout framework's comparator reports it (session/tito_compare.py)."""
        return self.mismatch_report(messages, tools, accumulated, template_kwargs)[0]

    def mismatch_report(
        self,
        messages: Sequence[Message],
        tools: object,
        accumulated: Sequence[int],
        template_kwargs: TemplateKwargs | None = None,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(`tito_session_mismatch`, `tito_session_mismatch_detail`) from one render.

        The first is the framework's report (`mismatches`). The detail is sessiongate's finer
        view of the same ids (`compare_token_sequences`): it drops from the render only what
        was never sampled (the turn suffix, and the end-of-turn token after a length
        cut-off), compares segments by ids (equal text with other ids is an entry with
        `text_equal` true), and counts the empty runs between special tokens as segments.
        """
        kwargs = self._effective(template_kwargs)
        expected = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=False,
            tools=_tools_or_none(tools),
            chat_template_kwargs=kwargs,
        )
        actual = _as_list(accumulated)
        report = compare_like_framework(self.tokenizer, self.framework_comparator, expected, actual)
        return report, self._detail(expected, actual, kwargs)

    def _detail(
        self, expected: list[int], accumulated: list[int], kwargs: TemplateKwargs
    ) -> list[dict[str, Any]]:
        if self.boundary_stop_ids:
            # The template renders no stop token at the end of the history; the record ends
            # with the sampled one (or none after a cut-off): trimmed from both tails.
            return compare_token_sequences(
                self.tokenizer,
                _trim_trailing(expected, self.boundary_stop_ids),
                _trim_trailing(accumulated, self.boundary_stop_ids),
                self.end_of_turn_id,
                turn_openers=self.turn_openers,
            )
        # The last turn ends where sampling stopped: the template's suffix after the
        # end-of-turn token was never sampled, and after a length cut-off neither was the
        # end-of-turn token itself.
        tail = self.turn_suffix_for(kwargs)
        if accumulated and accumulated[-1] != self.end_of_turn_id:
            tail = [self.end_of_turn_id, *tail]
        if tail and expected[-len(tail) :] == tail and accumulated[-len(tail) :] != tail:
            expected = expected[: -len(tail)]
        return compare_token_sequences(self.tokenizer, expected, accumulated, self.end_of_turn_id)


_COMPARATOR_TOKEN = "a turn boundary of this model family's comparator"


def _resolve(tokenizer: ChatTokenizer, spec: ComparatorSpec) -> FrameworkComparator:
    """`spec`'s token texts as ids of `tokenizer`; ValueError for one it lacks."""
    if spec.boundaries is not None:
        specials = frozenset(_token_ids(tokenizer, spec.boundaries, _COMPARATOR_TOKEN))
    else:
        specials = tokenizer.special_token_ids - frozenset(
            _token_ids(tokenizer, spec.not_boundaries, _COMPARATOR_TOKEN)
        )
    trim: set[int] = set()
    for text in spec.trailing:
        ids = tokenizer.encode(text)
        if len(ids) != 1:
            # The framework asserts a single newline token for its families too.
            raise ValueError(f"the tokenizer encodes {text!r} as {len(ids)} tokens, not one")
        trim.add(ids[0])
    return FrameworkComparator(spec.assistant_start, specials, frozenset(trim))


def _token_ids(
    tokenizer: ChatTokenizer, tokens: Sequence[str], what: str = "a stop token of this model"
) -> list[int]:
    ids = []
    for token in tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no {token!r} token, {what}")
        ids.append(token_id)
    return ids


def _trim_trailing(ids: list[int], trailing: frozenset[int]) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] in trailing:
        end -= 1
    return ids[:end]


def _same_ids(left: Sequence[int], right: Sequence[int]) -> bool:
    """`list(left) == list(right)`: two arrays of one typecode compare at memcmp speed
    (a session's checkpoints and prompts are int64 arrays as long as the context)."""
    if type(left) is array and type(right) is array and left.typecode == right.typecode:
        return left == right
    return _as_list(left) == _as_list(right)


def _as_list(ids: Sequence[int]) -> list[int]:
    # What list(ids) holds, without copying a list or boxing an array's items one at a time
    # through its iterator: checkpoints are arrays and run to the context length.
    if type(ids) is list:
        return ids
    if type(ids) is array:
        return ids.tolist()
    return list(ids)


def _tools_or_none(tools: object) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise BadRequest("field 'tools' must be a list")
    return tools


def _assistant_stub(message: Message) -> Message:
    # Keep tool calls: some templates render tool results differently after a call.
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": message.get("tool_calls") or None,
    }


def compare_token_sequences(
    tokenizer: ChatTokenizer,
    expected: list[int],
    actual: list[int],
    end_of_turn_id: int,
    *,
    turn_openers: frozenset[int] | None = None,
) -> list[dict[str, Any]]:
    """Classify how `actual` differs from `expected`, segment by segment.

    Types: `special_token_count`, `special_token_type` (structure differs), then per text
    segment between special tokens `assistant_text` (inside an assistant turn: sampled text
    that a re-render would tokenize differently) or `non_assistant_text`. A turn starts after
    an end-of-turn token, or, given `turn_openers` (templates that close no turn), at the
    last of those tokens.
    """
    if expected == actual:
        return []
    specials = tokenizer.special_token_ids
    exp_special = [t for t in expected if t in specials]
    act_special = [t for t in actual if t in specials]
    if len(exp_special) != len(act_special):
        return [
            {
                "type": "special_token_count",
                "expected": len(exp_special),
                "actual": len(act_special),
            }
        ]
    for position, (exp_tok, act_tok) in enumerate(zip(exp_special, act_special, strict=True)):
        if exp_tok != act_tok:
            return [
                {
                    "type": "special_token_type",
                    "special_index": position,
                    "expected_token": tokenizer.id_to_token(exp_tok),
                    "actual_token": tokenizer.id_to_token(act_tok),
                }
            ]
    found: list[dict[str, Any]] = []
    header = tokenizer.assistant_header
    exp_segments = _segments(expected, specials)
    act_segments = _segments(actual, specials)
    for index, ((exp_at, exp_seg), (act_at, act_seg)) in enumerate(
        zip(exp_segments, act_segments, strict=True)
    ):
        if exp_seg == act_seg:
            continue
        expected_text = tokenizer.decode(exp_seg)
        actual_text = tokenizer.decode(act_seg)
        if header:
            # Both sides, as the framework's comparator does: a segment is assistant text only
            # if each sequence has it inside an assistant turn.
            in_assistant = _in_assistant_turn(
                tokenizer, expected, exp_at + len(exp_seg), end_of_turn_id, header, turn_openers
            ) and _in_assistant_turn(
                tokenizer, actual, act_at + len(act_seg), end_of_turn_id, header, turn_openers
            )
        else:  # no header derivable from the template: the ChatML role name
            in_assistant = expected_text.startswith("assistant")
        found.append(
            {
                "type": "assistant_text" if in_assistant else "non_assistant_text",
                "segment": index,
                "expected_text": expected_text,
                "actual_text": actual_text,
                "text_equal": expected_text == actual_text,
            }
        )
    return found


def _in_assistant_turn(
    tokenizer: ChatTokenizer,
    ids: list[int],
    end: int,
    end_of_turn_id: int,
    header: str,
    turn_openers: frozenset[int] | None = None,
) -> bool:
    """Whether the turn holding `ids[:end]` opens with the assistant header.

    The turn starts after the last end-of-turn token before `end`; its text is decoded with
    the special tokens, so headers made of special tokens (Kimi's `<|im_assistant|>`,
    MiniMax's `]~b]ai`) and segments after an intra-turn special token (Kimi's
    `<|im_middle|>`) are recognised, not only a ChatML segment starting with "assistant".
    """
    start = end - 1
    if turn_openers:
        while start >= 0 and ids[start] not in turn_openers:
            start -= 1
        return start >= 0 and tokenizer.decode(ids[start:end]).lstrip().startswith(header)
    while start >= 0 and ids[start] != end_of_turn_id:
        start -= 1
    return tokenizer.decode(ids[start + 1 : end]).lstrip().startswith(header)


def _segments(ids: list[int], specials: frozenset[int]) -> list[tuple[int, list[int]]]:
    """The runs of non-special ids between special tokens, each with its start index."""
    segments: list[tuple[int, list[int]]] = [(0, [])]
    for at, token in enumerate(ids):
        if token in specials:
            segments.append((at + 1, []))
        else:
            segments[-1][1].append(token)
    return segments
