"""The Starlette app: routes, lifespan (the dispatcher task), health, and the guard around
them all (api_proc/guard.py: keys, admin routes, origins).

/health answers 503 from the moment the launcher reports a lost child; /health_generate
runs a one-token generation through the whole pipeline (SGLang's route). Every error,
unknown routes and wrong methods included, is JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc import dashboard
from api_proc.anthropic import AnthropicHandler
from api_proc.boundary import BadRequest, BodyLimits, JSONResponse, error_response, read_json
from api_proc.chat import ChatCore
from api_proc.embeddings import EmbeddingsHandler
from api_proc.guard import Guard, own_origins, parse_origins
from api_proc.metrics import LOG_INTERVAL, metrics, throughput_line
from api_proc.native import GenerateHandler
from api_proc.ollama import OllamaHandler
from api_proc.openai_api import OpenAIHandler
from api_proc.responses import ResponsesHandler
from api_proc.state import Dispatcher
from api_proc.tokenize_routes import TokenizeHandler
from wire import VERSION
from wire.messages import (MAX_LORA_NAME, MAX_PRIORITY, GenerateRequest, SchedulerLoad,
                           VectorRequest, replace)
from wire.sampling import SamplingParams
from wire.server_args import ServerConfig

MAX_PATH_CHARS = 4096       # /load_lora_adapter's lora_path

log = logging.getLogger(__name__)
HEALTH_GENERATE_TIMEOUT = 20.0      # seconds for /health_generate's one-token generation


def build_app(config: ServerConfig, dispatcher: Dispatcher, scheduler_info: dict) -> Starlette:
    args = config.args

    async def health(_: Request) -> Response:
        if dispatcher.lost:
            return JSONResponse({"status": "unhealthy", "message": dispatcher.lost}, 503)
        return JSONResponse({"status": "ok"})

    async def model_info(_: Request) -> Response:
        return JSONResponse({"model_path": config.model_path,
                             "tokenizer_path": config.tokenizer_path,
                             "is_generation": not args.is_embedding,
                             "architecture": config.model.architecture,
                             "has_image_understanding": config.model.image_token_id is not None})

    secrets = ("api_key", "admin_api_key")
    public_args = {k: ("<set>" if k in secrets and v is not None else v)
                   for k, v in config.info().items()}

    async def server_info(_: Request) -> Response:
        load = dispatcher.load
        return JSONResponse({
            **public_args, **scheduler_info, "version": VERSION,
            "requests_in_flight": len(dispatcher.states),     # in this API process
            "api_requests_total": dispatcher.submitted,         # taken in by this one
            "running_requests": load.running, "queued_requests": load.queued,
            "kv_pool": {"total": load.kv_total, "free": load.kv_free,
                        "evictable": load.kv_evictable},
            "prompt_tokens_total": load.prompt_tokens_total,
            "generated_tokens_total": load.generated_tokens_total,
            "retracted_total": load.retracted_total,
            "preempted_total": load.preempted_total,
            "rejected_total": load.rejected_total,
            "requests_total": load.requests_total,
            "api_server": dispatcher.index,
            "replicas": [replica_info(x) for _, x in sorted(dispatcher.loads.items())],
            **({"lora_adapters": load.lora_adapters} if args.enable_lora else {}),
            **speculative_info(load)})

    def speculative_info(load: SchedulerLoad) -> dict:
        """Where the server speculates: its totals, and SGLang's internal_states entry."""
        if args.speculative_algorithm is None:
            return {}
        length = load.spec_accept_length
        return {"speculative": {"verify_steps": load.spec_verify_total,
                                "draft_tokens": load.spec_draft_total,
                                "accepted_tokens": load.spec_accepted_total,
                                "accept_length": length,
                                "accept_length_hist": load.spec_accept_hist},
                "internal_states": [{"avg_spec_accept_length": length}]}

    def replica_info(x: SchedulerLoad) -> dict:
        """One scheduler replica (--dp-size) as /server_info lists it."""
        return {"dp_rank": x.replica, "running_requests": x.running,
                "queued_requests": x.queued,
                "kv_pool": {"total": x.kv_total, "free": x.kv_free,
                            "evictable": x.kv_evictable},
                "requests_total": x.requests_total,
                "prompt_tokens_total": x.prompt_tokens_total,
                "generated_tokens_total": x.generated_tokens_total}

    async def metrics_route(_: Request) -> Response:
        """Prometheus text format (api_proc/metrics.py)."""
        body, content_type = metrics().render(dispatcher.loads, dispatcher.throughput.rates()[1])
        return Response(body, media_type=content_type)

    async def get_load(_: Request) -> Response:
        """SGLang's load report, one entry per scheduler replica: what sglang-router's
        load-aware policies (power_of_two) read. num_tokens: KV slots held by requests."""
        return JSONResponse([
            {"dp_rank": r, "num_reqs": x.running + x.queued, "num_waiting_reqs": x.queued,
             "num_tokens": x.kv_used}
            for r, x in sorted(dispatcher.loads.items())])

    async def abort_request(request: Request) -> Response:
        """By rid prefix, as SGLang; without admin rights (keys set, not the admin key) only
        the request with exactly this rid (a client's own)."""
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise BadRequest("The request body must be a JSON object.")
            rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
            if not isinstance(rid, str) or not isinstance(abort_all, bool):
                raise BadRequest("rid must be a string and abort_all a boolean.")
            if not rid and not abort_all:
                raise BadRequest("Give a rid (prefix) or abort_all.")
            if abort_all and not request.state.admin:
                raise BadRequest("abort_all needs the admin API key.", 403)
        except BadRequest as e:
            return error_response(str(e), e.status)
        # A client's requests may be in any API process (--api-server-count): all look.
        n = await dispatcher.abort_everywhere("" if abort_all else rid,
                                              prefix=request.state.admin)
        return JSONResponse({"aborted": n})

    async def flush_cache(request: Request) -> Response:
        try:
            await read_json(request, allow_empty=True)     # any JSON (SGLang takes none)
        except BadRequest as e:
            return error_response(str(e), e.status)
        if dispatcher.lost:
            return error_response(f"Server unhealthy: {dispatcher.lost}", 503)
        try:
            reply = await dispatcher.flush_cache()
        except asyncio.TimeoutError:
            return error_response("The scheduler did not answer in time.", 503)
        if not reply.ok:
            return error_response(reply.message, 400)
        return JSONResponse({"message": reply.message})

    async def lora_route(request: Request, op: str) -> Response:
        """/load_lora_adapter {lora_name, lora_path} and /unload_lora_adapter {lora_name}
        (SGLang's): 200 once done (an unload once the adapter's requests have ended)."""
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise BadRequest("The request body must be a JSON object.")
            name, path = body.get("lora_name"), body.get("lora_path", "")
            if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME:
                raise BadRequest(f"lora_name must be a non-empty string of at most "
                                 f"{MAX_LORA_NAME} characters.")
            if op == "load" and (not isinstance(path, str) or not path
                                 or len(path) > MAX_PATH_CHARS):
                raise BadRequest("lora_path must be the adapter's path on the server (a PEFT "
                                 "directory or a LoRA .gguf file).")
        except BadRequest as e:
            return error_response(str(e), e.status)
        if not args.enable_lora:
            return error_response("This server serves no LoRA adapters (start it with "
                                  "--enable-lora).", 400)
        if op == "load" and name == config.served_model_name:
            return error_response(f"`{name}` is the served model's name.", 400)
        if dispatcher.lost:
            return error_response(f"Server unhealthy: {dispatcher.lost}", 503)
        try:
            reply = await dispatcher.lora_control(op, name, path if op == "load" else "")
        except asyncio.TimeoutError:
            return error_response("The scheduler did not answer in time (an unload waits "
                                  "for the adapter's requests to end).", 503)
        if not reply.ok:
            return error_response(reply.message,
                                  404 if op == "unload" and "not loaded" in reply.message
                                  else 400)
        return JSONResponse({"success": True, "message": reply.message,
                             "loaded_adapters": dispatcher.lora_adapters})

    async def load_lora_adapter(request: Request) -> Response:
        return await lora_route(request, "load")

    async def unload_lora_adapter(request: Request) -> Response:
        return await lora_route(request, "unload")

    async def health_generate(_: Request) -> Response:
        """One greedy token for token id 0 through tokenizer, scheduler and detokenizer
        (under --is-embedding, the embedding of token id 0)."""
        if dispatcher.lost:
            return error_response(f"Server unhealthy: {dispatcher.lost}", 503)
        # The best priority: a probe queued behind a priority load would time out.
        best = -MAX_PRIORITY if args.schedule_low_priority_values_first else MAX_PRIORITY
        probe = GenerateRequest(rid=f"health-{uuid.uuid4().hex}", text=None, input_ids=[0],
                                sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
                                priority=best)
        if args.is_embedding:
            probe = replace(probe, sampling=SamplingParams(max_new_tokens=0),
                            vector=VectorRequest("last"))
        try:
            (state,) = dispatcher.submit([probe])
        except Exception as e:      # e.g. the queue is full
            return error_response(f"Server unhealthy: {e}", 503)
        try:
            out = await asyncio.wait_for(state.wait_finished(), HEALTH_GENERATE_TIMEOUT)
        except asyncio.TimeoutError:
            dispatcher.abort_unfinished([state])
            return error_response(f"No token within {HEALTH_GENERATE_TIMEOUT:g} s.", 503)
        if out.finish is not None and out.finish.status_code is not None:
            return error_response(f"Server unhealthy: {out.finish.message}", 503)
        return Response(status_code=200)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": {"message": exc.detail}}, status_code=exc.status_code,
                            headers=exc.headers)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        tasks = [asyncio.create_task(dispatcher.run())]
        if dispatcher.index == 0:           # every API process sees the same loads: one logs
            tasks.append(asyncio.create_task(log_throughput(dispatcher)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    tokenizer = TokenizeHandler(config)
    core = ChatCore(config, dispatcher, tokenizer.count)
    embeddings = EmbeddingsHandler(config, dispatcher)
    routes = [
        Route("/generate", GenerateHandler(dispatcher, args.incremental_streaming_output,
                                           not args.disable_radix_cache,
                                           args.send_timeout).handle,
              methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST"]),
        Route("/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        *OpenAIHandler(config, dispatcher, core).routes(),
        *AnthropicHandler(core, args.send_timeout).routes(),
        *ResponsesHandler(core, args.send_timeout).routes(),
        *OllamaHandler(core, embeddings, args.send_timeout).routes(),
        *embeddings.routes(),
        *dashboard.routes(),
        *tokenizer.routes(),
    ]
    origins = parse_origins(args.allowed_origins)
    middleware = [Middleware(Guard, api_key=args.api_key, admin_api_key=args.admin_api_key,
                             allowed_origins=origins, own=own_origins(args.host, args.port))]
    if origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=origins,
                                        allow_methods=["GET", "POST"], allow_headers=["*"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error})
    app.state.body_limits = BodyLimits(args.max_request_bytes, args.read_timeout)
    return app


async def log_throughput(dispatcher: Dispatcher) -> None:
    """A throughput line every LOG_INTERVAL seconds while the server has work; nothing (and
    no wake-up) while it is idle: the loop waits for a load that shows work."""
    while True:
        await dispatcher.busy.wait()
        await asyncio.sleep(LOG_INTERVAL)
        load = dispatcher.load
        log.info("%s", throughput_line(load, dispatcher.throughput.rates()))
        if not (load.running or load.queued):
            dispatcher.busy.clear()
