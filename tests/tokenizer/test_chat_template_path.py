"""--chat-template-path FILE: a Jinja template file instead of the tokenizer's own."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from sessiongate.cli import build_parser
from sessiongate.config.gateway import GatewayConfig
from sessiongate.server.serve import serve_config, serve_core_config
from sessiongate.session.core_config import worker_config
from sessiongate.session.factory import build_core
from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR, TokenizerError, load_tokenizer
from support.tool_templates import MINIMAX_STYLE

USER = [{"role": "user", "content": "hi"}]


def template_file(tmp_path: Path, text: str = MINIMAX_STYLE) -> Path:
    path = tmp_path / "chat_template.custom.jinja"
    path.write_text(text, encoding="utf-8")
    return path


def serve_args(*argv: str) -> GatewayConfig:
    return serve_config(
        build_parser().parse_args(["serve", "--backend", "http://127.0.0.1:9", *argv])
    )


def test_the_file_replaces_the_tokenizers_template(tmp_path: Path) -> None:
    tok = load_tokenizer(None, chat_template_path=template_file(tmp_path))
    assert tok.chat_template == MINIMAX_STYLE
    assert tok.render(USER, add_generation_prompt=True).endswith("<|im_start|>ai\n")
    assert load_tokenizer(None).chat_template != MINIMAX_STYLE  # the shared built-in is kept


def test_a_directory_without_a_template_loads_with_the_file(tmp_path: Path) -> None:
    directory = tmp_path / "no-template"
    directory.mkdir()
    shutil.copy(BUILTIN_TOKENIZER_DIR / "tokenizer.json", directory / "tokenizer.json")
    config = {"eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(directory)
    tok = load_tokenizer(directory, chat_template_path=template_file(tmp_path))
    assert tok.chat_template == MINIMAX_STYLE


def test_sessions_render_with_the_file(tmp_path: Path) -> None:
    args = serve_args("--chat-template-path", str(template_file(tmp_path)))
    core = build_core(serve_core_config(args))
    assert core.tito.tokenizer.chat_template == MINIMAX_STYLE
    forwarded = worker_config(args, ["http://127.0.0.1:9"], local_workers=1)
    path = forwarded.sessions.chat_template_path
    assert path is not None and os.path.isabs(path)
    forwarded = path
    assert Path(forwarded).read_text(encoding="utf-8") == MINIMAX_STYLE


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "chat template file not found"),
        (b"\xff\xfe not utf-8", "is not readable"),
        (b"  \n", "is empty"),
        (b"{% for m in messages %}", "does not compile"),
    ],
)
def test_a_bad_file_is_a_startup_error(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit, match=rf"--chat-template-path: .*{message}"):
        serve_core_config(serve_args("--chat-template-path", str(path)))


def test_a_directory_is_not_a_template_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="chat template file not found"):
        serve_core_config(serve_args("--chat-template-path", str(tmp_path)))
