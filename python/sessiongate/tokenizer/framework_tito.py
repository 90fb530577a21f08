"""The rollout framework's TITO package (`miles-tito-tokenizers`), imported only here and only
when a model family needs it: its fixed chat templates and DeepSeek's prompt encoders.

The package is the framework's own TITO layer, published by its authors: one fixed Jinja
template per family whose stock template is not append-only, and DeepSeek V3.2 / V4's
pure-Python prompt encoders (the families ship no Jinja template; SGLang renders them with
the same encoders). Reading the files from the package, rather than keeping copies, means a
family renders with the framework's template of the installed version.

The package pulls `transformers` and `tiktoken` (measured on this project's CI machine:
site-packages 105 MB -> 319 MB over the base install, ~0.5 s to import, most of it
transformers), so it is the `families` extra, not a dependency, and nothing imports it until
a family asks.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from types import ModuleType

from sessiongate.tokenizer.template import TokenizerError

__all__ = ["EXTRA", "encoder_module", "template_file"]

# What to install, named in every error that needs the package.
EXTRA = "pip install 'sessiongate[families]'"
_PACKAGE = "miles_tito_tokenizers"


def _import(module: str, why: str) -> ModuleType:
    # The package imports transformers, which warns on stderr that PyTorch is absent; a
    # gateway never needs PyTorch, so that line is noise in its start-up output.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return importlib.import_module(f"{_PACKAGE}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == _PACKAGE:
            raise TokenizerError(
                f"{why} needs the rollout framework's TITO package miles-tito-tokenizers: {EXTRA}"
            ) from None
        raise


def template_file(name: str, family: str) -> str:
    """The path of the package's fixed template `name` for `family` (TokenizerError when the
    package is missing or lacks it)."""
    module = _import("tokenizer", f"the {family} family's fixed chat template ({name})")
    path = Path(module.TEMPLATE_DIR) / name
    if not path.is_file():
        raise TokenizerError(
            f"the installed miles-tito-tokenizers has no template {name} for the {family} "
            "family; give one with --chat-template-path"
        )
    return str(path)


def encoder_module(name: str) -> ModuleType:
    """The package's encoder module `name` (`deepseek_v32`, `deepseek_v4`)."""
    return _import(f"encoders.{name}", f"the {name} prompt encoder")
