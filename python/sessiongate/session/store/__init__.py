"""Durable records (`--records-dir`): each worker appends its sessions' state and turn records
to one file per session, recovers them when it restarts, and keeps at most `--records-memory`
of record bytes in RAM (older ones are read back from their files). docs/architecture.md,
"The records store"."""
