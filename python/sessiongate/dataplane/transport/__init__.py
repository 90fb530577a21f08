"""The IPC frame channel: frame types, framed connections, and the TCP/handshake layer."""
