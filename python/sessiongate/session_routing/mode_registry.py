"""Find routing modes (built-in and entry-point plugins), check them, and configure one.

Every error here is a `RoutingConfigError` raised at startup, worded as what to do next, so
a misconfigured gateway refuses to start instead of stamping the wrong thing for hours.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined, to_jsonable_python

from sessiongate.config.fields import flag_of
from sessiongate.config.sessions import SessionRoutingConfig
from sessiongate.session_routing.base import SessionRoutingMode
from sessiongate.session_routing.modes import BUILTIN_MODES

ENTRY_POINT_GROUP = "sessiongate.session_routing"
OPTION_FLAG = flag_of(SessionRoutingConfig, "options")
MODE_FLAG = flag_of(SessionRoutingConfig, "mode")


class RoutingConfigError(ValueError):
    """Session routing is misconfigured (mode, options, or a broken plugin)."""


@dataclass(frozen=True, slots=True)
class OptionInfo:
    name: str
    type: str
    default: Any  # JSON-able; None when required
    required: bool
    description: str


@dataclass(frozen=True, slots=True)
class ModeInfo:
    name: str
    description: str
    mutates_body: bool
    source: str  # "built-in" or "<distribution> <version> (<module:attr>)"
    options: tuple[OptionInfo, ...]
    error: str | None = None  # set for a plugin that cannot be loaded or breaks the contract


# -- discovery ---------------------------------------------------------------------------


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _ep_origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    return f"{where} ({ep.value})"


def _plugin_entry_points() -> dict[str, list[EntryPoint]]:
    """Third-party entry points by mode name (several when distributions collide).

    Entry points that merely re-register a built-in class (e.g. sessiongate's own
    pyproject) are dropped: built-ins are always available from code.
    """
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        builtin = BUILTIN_MODES.get(ep.name)
        if builtin is not None and ep.value.replace(" ", "") == _qualified(builtin):
            continue
        bucket = found.setdefault(ep.name, [])
        if all(other.value != ep.value for other in bucket):
            bucket.append(ep)
    return found


def available_mode_names() -> list[str]:
    return sorted(set(BUILTIN_MODES) | set(_plugin_entry_points()))


def _resolve(name: str, eps: list[EntryPoint]) -> type[SessionRoutingMode]:
    if name in BUILTIN_MODES:
        origins = ", ".join(_ep_origin(ep) for ep in eps)
        raise RoutingConfigError(
            f"routing plugin entry point {name!r} from {origins} shadows the built-in mode of "
            f"the same name; rename the plugin's entry point in group {ENTRY_POINT_GROUP!r}"
        )
    if len(eps) > 1:
        origins = " and ".join(_ep_origin(ep) for ep in eps)
        raise RoutingConfigError(
            f"session routing mode {name!r} is provided by {origins}; uninstall one of them"
        )
    ep = eps[0]
    label = f"routing plugin entry point '{ep.name} = {ep.value}' from {_ep_origin(ep)}"
    try:
        obj = ep.load()
    except Exception as exc:  # any import-time failure of third-party code
        raise RoutingConfigError(
            f"{label} failed to load: {type(exc).__name__}: {exc}; "
            "fix or uninstall that plugin, or choose another mode"
        ) from exc
    try:
        return check_mode_class(obj, expected_name=name)
    except RoutingConfigError as exc:
        raise RoutingConfigError(f"{label} is not a valid routing mode: {exc}") from None


def check_mode_class(obj: object, *, expected_name: str | None = None) -> type[SessionRoutingMode]:
    """Refuse a mode class that breaks the contract in base.py; return it typed."""
    if not (isinstance(obj, type) and issubclass(obj, SessionRoutingMode)):
        raise RoutingConfigError(
            f"{obj!r} must be a subclass of sessiongate.session_routing.SessionRoutingMode"
        )
    where = _qualified(obj)
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise RoutingConfigError(f"{where} does not implement {missing}")
    if not isinstance(obj.name, str) or not obj.name:
        raise RoutingConfigError(f"{where} must set a non-empty class attribute `name`")
    if expected_name is not None and obj.name != expected_name:
        raise RoutingConfigError(
            f"{where}.name is {obj.name!r} but it is registered as {expected_name!r}; "
            "make the entry point name and the class's `name` agree"
        )
    if not isinstance(obj.mutates_body, bool):
        raise RoutingConfigError(f"{where}.mutates_body must be a bool")
    overrides = obj.transform_body is not SessionRoutingMode.transform_body
    if obj.mutates_body and not overrides:
        raise RoutingConfigError(
            f"{where} declares mutates_body = True but does not override transform_body; "
            "set mutates_body = False"
        )
    if overrides and not obj.mutates_body:
        raise RoutingConfigError(
            f"{where} overrides transform_body but declares mutates_body = False, so the "
            "gateway would never call it; set mutates_body = True"
        )
    options = obj.Options
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise RoutingConfigError(f"{where}.Options must be a pydantic BaseModel subclass")
    config = options.model_config
    if config.get("extra") != "forbid" or not config.get("frozen", False):
        raise RoutingConfigError(
            f"{where}.Options must set model_config = ConfigDict(extra='forbid', frozen=True) "
            "(derive it from sessiongate.session_routing.RoutingOptions)"
        )
    return obj


def mode_class(name: str) -> type[SessionRoutingMode]:
    """The class behind a mode name; RoutingConfigError when unknown or broken."""
    plugins = _plugin_entry_points()
    eps = plugins.get(name)
    if eps:
        return _resolve(name, eps)
    builtin = BUILTIN_MODES.get(name)
    if builtin is not None:
        return builtin
    names = sorted(set(BUILTIN_MODES) | set(plugins))
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise RoutingConfigError(
        f"unknown session routing mode {name!r}{hint}; available modes: {', '.join(names)} "
        "(run `sessiongate plugins` for their options)"
    )


# -- options -----------------------------------------------------------------------------


def parse_options(raw: Sequence[str]) -> dict[str, str]:
    """`key=value` strings to a dict; keys and values are stripped, values may be empty."""
    if isinstance(raw, str):  # a lone string would be iterated per character
        raw = [raw]
    parsed: dict[str, str] = {}
    for item in raw:
        if not item.strip():
            raise RoutingConfigError(f"empty {OPTION_FLAG}; expected key=value")
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise RoutingConfigError(
                f"malformed {OPTION_FLAG} {item!r}: expected key=value (e.g. timeout_seconds=600)"
            )
        if not key:
            raise RoutingConfigError(
                f"malformed {OPTION_FLAG} {item!r}: the key before '=' is empty"
            )
        if key in parsed:
            raise RoutingConfigError(
                f"{OPTION_FLAG} {key!r} is given twice ({key}={parsed[key]!r} and "
                f"{key}={value.strip()!r}); keep one"
            )
        parsed[key] = value.strip()
    return parsed


def _valid_keys(options: type[BaseModel]) -> list[str]:
    keys: list[str] = []
    for fname, finfo in options.model_fields.items():
        keys.append(fname)
        if isinstance(finfo.alias, str) and finfo.alias != fname:
            keys.append(finfo.alias)
    return keys


def _readable(exc: ValidationError, mode: str) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err["loc"])
        if loc:
            parts.append(f"{loc}={err['input']!r}: {msg}")
        else:
            parts.append(msg)
    return f"invalid options for session routing mode {mode!r}: " + "; ".join(parts)


def build_options(cls: type[SessionRoutingMode], values: dict[str, Any]) -> BaseModel:
    """Validate option values (strings from the CLI, or typed values) into `cls.Options`."""
    valid = _valid_keys(cls.Options)
    unknown = [k for k in values if k not in valid]
    if unknown:
        takes = f"valid options: {', '.join(valid)}" if valid else "this mode takes no options"
        raise RoutingConfigError(
            f"unknown option {unknown[0]!r} for session routing mode {cls.name!r}; {takes}"
        )
    try:
        return cls.Options.model_validate(values)
    except ValidationError as exc:
        raise RoutingConfigError(_readable(exc, cls.name)) from None


def load_mode(name: str | None, options: Sequence[str] = ()) -> SessionRoutingMode | None:
    """Build the configured mode from `--session-routing` and `--session-routing-opt`s.

    None (or a blank name) without options means "no session routing".
    """
    options = list(options) if not isinstance(options, str) else [options]
    if name is None or not name.strip():
        if options:
            raise RoutingConfigError(
                f"{OPTION_FLAG} given without {MODE_FLAG}; choose a mode (one of: "
                f"{', '.join(available_mode_names())}) or drop the options"
            )
        return None
    cls = mode_class(name.strip())
    opts = build_options(cls, parse_options(options))
    try:
        return cls(opts)  # type: ignore[arg-type]  # checked to be cls.Options
    except Exception as exc:
        raise RoutingConfigError(
            f"session routing mode {cls.name!r} failed to start: {type(exc).__name__}: {exc}"
        ) from exc


# -- listing -----------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        inner = _type_name(args[0]) if args else "str"
        return f"list[{inner}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return repr(annotation).replace("typing.", "")


def _constraints(metadata: list[Any]) -> str:
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    out = []
    for item in metadata:
        for attr, op in ops.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{op} {value}")
    return " ".join(out)


def describe_options(options: type[BaseModel]) -> tuple[OptionInfo, ...]:
    infos = []
    for fname, finfo in options.model_fields.items():
        required = finfo.is_required()
        default = None
        if not required:
            raw = finfo.get_default(call_default_factory=True)
            default = None if raw is PydanticUndefined else to_jsonable_python(raw, fallback=str)
        type_name = _type_name(finfo.annotation)
        limits = _constraints(finfo.metadata)
        infos.append(
            OptionInfo(
                name=finfo.alias if isinstance(finfo.alias, str) else fname,
                type=f"{type_name} {limits}" if limits else type_name,
                default=default,
                required=required,
                description=finfo.description or "",
            )
        )
    return tuple(infos)


def _describe(cls: type[SessionRoutingMode], source: str) -> ModeInfo:
    return ModeInfo(
        name=cls.name,
        description=cls.description,
        mutates_body=cls.mutates_body,
        source=source,
        options=describe_options(cls.Options),
    )


def list_modes() -> list[ModeInfo]:
    """Every mode with its options and defaults; broken plugins are listed with `error`."""
    infos = [_describe(cls, "built-in") for cls in BUILTIN_MODES.values()]
    for name, eps in sorted(_plugin_entry_points().items()):
        source = "; ".join(_ep_origin(ep) for ep in eps)
        try:
            infos.append(_describe(_resolve(name, eps), source))
        except RoutingConfigError as exc:
            infos.append(ModeInfo(name, "", False, source, (), error=str(exc)))
    return infos
