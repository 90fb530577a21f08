"""A lean keep-alive HTTP/1.1 client shared by the upstream pool and the load driver."""

from sessiongate.http.client import ConnectFailed, HttpClient, HttpError, ProtocolFailure, Response

__all__ = ["ConnectFailed", "HttpClient", "HttpError", "ProtocolFailure", "Response"]
