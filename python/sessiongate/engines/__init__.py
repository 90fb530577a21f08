"""Engines (inference servers such as SGLang) registered at run time: the registry of the
engine set, its probe, and the management routes the rollout framework's router client
calls (both of its dialects). docs/api.md, "Engine management"."""
