"""The Starlette app: routes, lifespan (the dispatcher task), and health.

/health answers 503 from the moment the launcher reports a lost child.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api_proc.native import BadRequest, GenerateHandler, error_response, read_json
from api_proc.openai_api import OpenAIHandler
from api_proc.state import Dispatcher
from wire.server_args import ServerArgs

log = logging.getLogger(__name__)
VERSION = "0.1.0"


def build_app(args: ServerArgs, dispatcher: Dispatcher, scheduler_info: dict) -> Starlette:
    async def health(_: Request) -> Response:
        if dispatcher.lost:
            return JSONResponse({"status": "unhealthy", "message": dispatcher.lost}, 503)
        return JSONResponse({"status": "ok"})

    async def model_info(_: Request) -> Response:
        return JSONResponse({"model_path": args.model_path,
                             "tokenizer_path": args.resolved_tokenizer_path,
                             "is_generation": True})

    async def server_info(_: Request) -> Response:
        load = dispatcher.load
        return JSONResponse({
            **dataclasses.asdict(args), **scheduler_info, "version": VERSION,
            "requests_in_flight": len(dispatcher.states),
            "running_requests": load.running, "queued_requests": load.queued,
            "kv_pool": {"total": load.kv_total, "free": load.kv_free,
                        "evictable": load.kv_evictable},
            "prompt_tokens_total": load.prompt_tokens_total,
            "generated_tokens_total": load.generated_tokens_total,
            "retracted_total": load.retracted_total})

    async def abort_request(request: Request) -> Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise BadRequest("The request body must be a JSON object.")
            rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
            if not isinstance(rid, str) or not isinstance(abort_all, bool):
                raise BadRequest("rid must be a string and abort_all a boolean.")
            if not rid and not abort_all:
                raise BadRequest("Give a rid (prefix) or abort_all.")
        except BadRequest as e:
            return error_response(str(e), e.status)
        n = dispatcher.abort_prefix("" if abort_all else rid)
        return JSONResponse({"aborted": n})

    async def flush_cache(_: Request) -> Response:
        if dispatcher.lost:
            return error_response(f"Server unhealthy: {dispatcher.lost}", 503)
        try:
            reply = await dispatcher.flush_cache()
        except asyncio.TimeoutError:
            return error_response("The scheduler did not answer in time.", 503)
        return JSONResponse({"message": reply.message}, status_code=200 if reply.ok else 400)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(dispatcher.run())
        try:
            yield
        finally:
            task.cancel()

    routes = [
        Route("/generate", GenerateHandler(dispatcher, args.incremental_streaming_output,
                                           not args.disable_radix_cache).handle,
              methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        *OpenAIHandler(args, dispatcher).routes(),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
