"""The Python half of the front door; the compiled half is `rust/front/`.

`asgi` (the gateway's ASGI app: auth, limits, the route to the core), `routes` (which op a
method and path are, twinned in `rust/front/route.rs`), `http_protocol` and `http_server`
(the uvicorn protocol and server the Python front and the mock engine run), `compiled` (the
compiled front's Python side: start it, hand requests over) and `dispatched` (answer the
requests it dispatches to Python), `openapi` and `schemas` (the documented surface).
"""
