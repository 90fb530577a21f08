"""Type checks of the chat-turn fields the gateway reads itself (docs/api.md, "Errors").

The upstream validates everything it reads; these are the members whose value changes what
the gateway does before the upstream sees the body (stream or not, the prompt's tools, the
usage chunk of a relayed stream). A wrong type must be a 400 naming the field, never a
truthiness guess (`"stream": "yes"` is not a stream) or a failure deeper in.
`messages` is checked by `messages.validate_messages`, `chat_template_kwargs` by
`TitoEngine.resolve_chat_template_kwargs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sessiongate.errors import BadRequest
from sessiongate.json_safety import json_type


def check_turn_fields(body: Mapping[str, Any]) -> None:
    """BadRequest unless `stream`, `tools` and `stream_options` have their documented types
    (each may also be absent or null)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"field 'stream' must be a boolean, not {json_type(stream)}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest(f"field 'tools' must be a list of objects, not {json_type(tools)}")
        for index, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise BadRequest(f"tools[{index}] must be an object, not {json_type(tool)}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest(f"field 'stream_options' must be an object, not {json_type(options)}")
        include_usage = options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise BadRequest(
                "field 'stream_options.include_usage' must be a boolean, not "
                f"{json_type(include_usage)}"
            )
