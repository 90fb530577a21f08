"""The multi-process data plane: thin router, N session workers, framed IPC, supervisor.

Modules here are import-light: the router process must never load the session core, the
tokenizer or `tokenizers` (a test checks `sys.modules`).
"""
