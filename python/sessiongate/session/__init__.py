"""The session core: sessions, TITO prompt construction, turn records.

Import submodules directly (`sessiongate.session.core`); this package stays import-light so
front ends can use its errors without loading the tokenizer.
"""
