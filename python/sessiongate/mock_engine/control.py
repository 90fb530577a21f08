"""SGLang 0.5.23's generation control routes on the mock: `/pause_generation`,
`/continue_generation`, `/ready`, `/health_generate` and `/update_weights_from_disk`.

What they do to requests is in `EngineState` (the gate new requests wait at, the halted
clock in-flight requests stop on) and the step scheduler (retract); this module reads the
bodies as SGLang's pydantic models do (io_struct.py `PauseGenerationReqInput`,
`ContinueGenerationReqInput`, `UpdateWeightFromDiskReqInput`) and answers as http_server.py
does. Sources: http_server.py (the routes, `ready`, `health_generate`, HEALTH_CHECK_TIMEOUT),
tokenizer_manager.py (`pause_generation`, `continue_generation`, `generate_request`'s wait
on is_pause_cond, `update_weights_from_disk`, `_update_model_path_info`, `is_ready`),
scheduler.py (`pause_generation`, `flush_cache`), scheduler_components/weight_updater.py
(`update_weights_from_disk`, `flush_cache_after_weight_update`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sessiongate.mock_engine.body_slices import json_response
from sessiongate.mock_engine.chat_request import validation_error
from sessiongate.mock_engine.scheduler import StepScheduler
from sessiongate.mock_engine.state import PAUSE_MODES, EngineState, PauseMode, first_set

PAUSED_OK = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED_OK = {"message": "Generation continued successfully.", "status": "ok"}
# weight_updater.py `update_weights_from_disk` and `flush_cache_after_weight_update`.
WEIGHTS_UPDATED = "Succeeded to update model weights."
CACHE_NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still "
    "running or queued. Retract or finish them, then call /flush_cache."
)
# How often a pause or an update looks again for requests still running (SGLang's abort
# pause polls its lock every second; the mock answers sooner, with the same outcome).
IDLE_POLL_S = 0.005

# pydantic's type names and messages for the field types the bodies have.
_KINDS: dict[type, tuple[str, str]] = {
    bool: ("bool_type", "Input should be a valid boolean"),
    str: ("string_type", "Input should be a valid string"),
}


async def control_body(request: Request) -> dict[str, Any] | Response:
    """The JSON object of a control route's body, or SGLang's 400 for a missing or non-object
    body (FastAPI requires a `Body()` parameter even when every field has a default;
    http_server.py's RequestValidationError handler turns the 422 into a 400)."""
    raw = await request.body()
    if not raw.strip():
        error = {"type": "missing", "loc": ("body",), "msg": "Field required"}
        return validation_error([error]).response()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = ValueError
    if body is ValueError:
        error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
        return validation_error([error]).response()
    if not isinstance(body, dict):
        error = {"type": "model_type", "loc": ("body",), "msg": "Input should be an object"}
        return validation_error([error]).response()
    return body


def field_errors(
    body: dict[str, Any], fields: dict[str, type], required: tuple[str, ...] = ()
) -> Response | None:
    """SGLang's 400 when a field is missing or of the wrong type (strict: a bool is no
    string, a string no bool; null only where the field is Optional, i.e. not required
    and not a bool)."""
    errors: list[dict[str, Any]] = []
    for name, kind in fields.items():
        if name not in body:
            if name in required:
                errors.append({"type": "missing", "loc": ("body", name), "msg": "Field required"})
            continue
        value = body[name]
        optional = kind is str and name not in required
        if (value is None and optional) or type(value) is kind:
            continue
        code, msg = _KINDS[kind]
        errors.append({"type": code, "loc": ("body", name), "msg": msg})
    return validation_error(errors).response() if errors else None


@dataclass(eq=False)
class ControlRoutes:
    """The handlers; one per app, over the engine's state and step scheduler."""

    state: EngineState
    scheduler: StepScheduler | None

    async def pause_generation(self, request: Request) -> Response:
        """tokenizer_manager.py `pause_generation`: new requests wait until the continue;
        mode abort aborts what runs and answers once nothing does; retract / in_place stop
        the scheduler, whose requests stay (retract: back in the waiting queue)."""
        body = await control_body(request)
        if isinstance(body, Response):
            return body
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            msg = "Input should be 'abort', 'retract' or 'in_place'"
            error = {"type": "literal_error", "loc": ("body", "mode"), "msg": msg}
            return validation_error([error]).response()
        state = self.state
        pause_mode: PauseMode = mode
        state.pause(pause_mode)
        if pause_mode == "abort":
            await self._until_idle(abort=True)
        elif pause_mode == "retract" and self.scheduler is not None:
            self.scheduler.retract()
        return json_response(PAUSED_OK)

    async def continue_generation(self, request: Request) -> Response:
        """tokenizer_manager.py `continue_generation`: fine when not paused, too."""
        body = await control_body(request)
        if isinstance(body, Response):
            return body
        refused = field_errors(body, {"torch_empty_cache": bool})
        if refused is not None:
            return refused
        self.state.resume()
        return json_response(CONTINUED_OK)

    async def ready(self, request: Request) -> Response:
        """http_server.py `ready`: tokenizer_manager.py `is_ready` = not paused and healthy
        (a shutting-down server is not); the body is empty either way."""
        state = self.state
        ready = not state.paused and not state.closing.is_set()
        return Response(status_code=200 if ready else 503)

    async def health_generate(self, request: Request) -> Response:
        """http_server.py `health_generate`: a one-token generation, which waits at the gate
        like any request (a paused engine, an update draining); 503 when nothing came back
        within HEALTH_CHECK_TIMEOUT or the server shuts down. SGLang answers after at least
        one second (it polls every second); the mock answers as soon as it knows."""
        state = self.state
        timeout = state.config.health_check_timeout
        opened = await first_set(state.closing, state.gate, timeout=timeout)
        return Response(status_code=200 if opened is state.gate else 503)

    async def update_weights_from_disk(self, request: Request) -> Response:
        """tokenizer_manager.py `update_weights_from_disk`: abort first if asked; not paused,
        wait for the running requests while new ones wait (the model_update_lock's writer
        side); paused, update at once. 200 on success, 400 on failure, both
        {"success", "message", "num_paused_requests"} (the scheduler reports 0)."""
        body = await control_body(request)
        if isinstance(body, Response):
            return body
        fields = {
            "model_path": str,
            "load_format": str,
            "abort_all_requests": bool,
            "weight_version": str,
            "flush_cache": bool,
        }
        refused = field_errors(body, fields, required=("model_path",))
        if refused is not None:
            return refused
        state = self.state
        if body.get("abort_all_requests") is True:
            state.abort_all()
        if state.paused:
            success, message = self._load(body)
        else:
            state.drain(+1)
            try:
                await self._until_idle(abort=False)
                success, message = self._load(body)
            finally:
                state.drain(-1)
        reply = {"success": success, "message": message, "num_paused_requests": 0}
        return json_response(reply, 200 if success else 400)

    def _load(self, body: dict[str, Any]) -> tuple[bool, str]:
        """The update itself: load (fails for "" and --reject-model-path), flush the prefix
        cache unless requests still run (an in_place pause keeps them; a retract pause moved
        them to the waiting queue, which a paused flush ignores), then move model_path,
        served_model_name and, when given, the weight version."""
        state = self.state
        path: str = body["model_path"]
        if not path or path in state.config.reject_model_paths:
            # The model runner's own message is not in the unpacked wheel; the mock's.
            return False, f"Failed to update weights: cannot load model_path {path!r}."
        if body.get("flush_cache", True):
            if state.running and not state.retracted:
                return False, CACHE_NOT_FLUSHED
            state.prefix_cache.flush()
        message = WEIGHTS_UPDATED
        state.model_path = path
        state.weight_updates += 1
        version = body.get("weight_version")
        if version is not None:
            state.weight_version = version
            message += f" Weight version updated to {version}."
        return True, message

    async def _until_idle(self, *, abort: bool) -> None:
        """Until no request runs (or the server shuts down), aborting them all again on
        every look when `abort` (a request that was past the gate but not yet running when
        the pause came is aborted too, as SGLang's repeated abort_all does)."""
        state = self.state
        while state.running and not state.closing.is_set():
            if abort:
                state.abort_all()
            await asyncio.sleep(IDLE_POLL_S)
