"""Start the rollout framework's v1 session server, unmodified, for `framework_peer.py`.

Runs under the framework's own interpreter (FRAMEWORK_PYTHON), never sessiongate's: it
imports only the framework's checkout and the standard library, and calls the entry point
the framework's rollout starts as a subprocess (`run_session_server` in
`miles/rollout/session/server.py`) with the arguments that server reads.

    FRAMEWORK_PYTHON -m miles_session_server --src CHECKOUT --tokenizer DIR \
        --port PORT --backend URL
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="a radixark/miles source checkout")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True, help="the engine's base URL")
    parser.add_argument("--tito-model", default="default")
    parser.add_argument("--no-r3", action="store_true", help="do not ask for routed experts")
    options = parser.parse_args()
    sys.path.insert(0, options.src)
    from miles.rollout.session.server import run_session_server
    from miles.utils.chat_template_utils import resolve_fixed_chat_template

    # A named family's fixed template and variables, as the framework's argument parsing
    # sets them (miles/utils/arguments.py) before it starts the server.
    template, variables = (None, {})
    if options.tito_model != "default":
        template, variables = resolve_fixed_chat_template(options.tito_model)
    # The attributes the v1 server reads from the framework's parsed arguments
    # (sessions.py, core.py, linear_trajectory.py); everything else keeps its default.
    args = argparse.Namespace(
        hf_checkpoint=options.tokenizer,
        tito_model=options.tito_model,
        chat_template_path=template,
        apply_chat_template_kwargs=variables,
        session_server_ip="127.0.0.1",
        session_server_port=options.port,
        use_rollout_routing_replay=not options.no_r3,
    )
    run_session_server(args, options.backend)


if __name__ == "__main__":
    main()
