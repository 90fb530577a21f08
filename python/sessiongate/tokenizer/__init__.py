"""Chat tokenizer layer: load a tokenizer + chat template and render conversations to ids.

``load_tokenizer(None)`` gives the small built-in ChatML tokenizer (no network needed);
``load_tokenizer(path)`` loads a local Hugging Face tokenizer directory. See docs/tokenizer.md.
"""

from sessiongate.tokenizer.chat_tokenizer import (
    BUILTIN_TOKENIZER_DIR,
    BUILTIN_TOKENIZER_NAME,
    RESERVED_TEMPLATE_VARIABLES,
    ChatTokenizer,
    check_template_kwargs,
    load_tokenizer,
    read_chat_template_file,
)
from sessiongate.tokenizer.template import TokenizerError

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
