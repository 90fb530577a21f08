"""Jinja2 environment for Hugging Face-style chat templates.

Chat templates published with models assume the environment that ``transformers`` builds:
a sandbox, ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that keeps non-ASCII text as is, and the globals ``raise_exception`` and
``strftime_now``. We rebuild that environment here (without importing ``transformers``) so
that real model templates render exactly as they would there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CompiledTemplate", "TokenizerError", "compile_template"]


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, or a chat template could not be rendered."""


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject conversations they cannot format (e.g. bad role order).
    raise TokenizerError(f"chat template rejected the conversation: {message}")


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes and forces ASCII; chat templates want the plain
    # json.dumps text, since it is model input, not HTML.
    return json.dumps(
        value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTagExtension(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render only its body.

    transformers uses the tag to compute assistant masks; some published templates contain it.
    We do not need the mask, but must not fail to parse those templates.
    """

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


# Every attribute a plain dict instance has (its type's and object's): any other name raises
# AttributeError on one, so jinja's sandbox falls back to the item.
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with a shortcut for `message.role` on a plain dict (the bulk of a chat
    template's lookups): the item, or undefined, as the sandbox would answer after raising
    and catching an AttributeError for it."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def _make_environment() -> jinja2.Environment:
    env = _ChatTemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationTagExtension],
        # Missing attributes must behave like transformers (undefined, falsy), not raise.
        undefined=jinja2.Undefined,
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Globals and filters whose result changes between two renders of the same variables (the
# clock, randomness). A template that names none of them renders a pure function of its
# variables, so callers may reuse a rendering (TitoEngine caches its prefix render).
_UNSTABLE_GLOBALS = frozenset({"strftime_now", "lipsum"})
_UNSTABLE_FILTERS = frozenset({"random"})


def _is_deterministic(env: jinja2.Environment, source: str) -> bool:
    tree = env.parse(source)
    if any(node.name in _UNSTABLE_GLOBALS for node in tree.find_all(nodes.Name)):
        return False
    return not any(node.name in _UNSTABLE_FILTERS for node in tree.find_all(nodes.Filter))


class CompiledTemplate:
    """A chat template compiled once; ``render`` is safe to call from several threads.

    jinja2 ``Template`` objects are immutable after compilation and each ``render`` call builds
    its own context, so sharing one instance across threads needs no lock.
    """

    def __init__(self, source: str, origin: str) -> None:
        self.source = source
        self.origin = origin
        env = _make_environment()
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"chat template from {origin} does not compile (line {exc.lineno}): {exc.message}"
            ) from exc
        # Whether equal variables always give equal text (no clock or randomness used).
        self.deterministic = _is_deterministic(env, source)

    def render(self, variables: Mapping[str, Any]) -> str:
        try:
            return self._template.render(**variables)
        except TokenizerError:
            raise
        except Exception as exc:  # any failure inside a template is a template problem
            # The client sees this: say what went wrong, not which Python class said it (a
            # message field of the wrong type, e.g. `true` where the template loops, is a
            # TypeError inside jinja2).
            what = "a value of the wrong type: " if isinstance(exc, TypeError) else ""
            raise TokenizerError(
                f"chat template from {self.origin} failed to render: {what}{exc or 'no detail'}"
            ) from exc


def compile_template(source: str, origin: str) -> CompiledTemplate:
    """Compile ``source`` (a chat template); ``origin`` names where it came from in errors."""
    if not isinstance(source, str) or not source.strip():
        raise TokenizerError(f"chat template from {origin} is empty or not a string")
    return CompiledTemplate(source, origin)
