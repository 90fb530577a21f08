"""Helpers the tests (and some benches) share: processes on loopback (`procs`), scripted
engines and proxies (`raw_engine`, `fault_proxy`), test templates and tokenizers
(`tool_templates`, `family_templates`), fuzz and schema machinery, and the helpers that
several test modules use. Nothing here is collected as a test."""
