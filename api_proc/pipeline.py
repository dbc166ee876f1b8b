"""One request pipeline for every generation route (native /generate and the OpenAI routes).

Routes parse their bodies into prompts and sampling parameters and render the answers;
everything between is here, once:
- `expand`: one GenerateRequest per prompt per sample, prompt-major; with a seed, sample j
  draws with seed + j (reproducible, yet the n samples differ); and, for each prompt with
  n > 1, a prefill-only warm-up request (max_new_tokens 0) so the samples share the
  prompt's KV through the prefix cache instead of computing it n times.
- `Pipeline.start`: run the warm-ups, submit the requests (their latencies count from
  before the warm-up), unless the client leaves first.
- `settle`: wait for outputs of every request concurrently, or end early when the client
  leaves (499, the rest aborted) or a request is rejected (its HTTP error).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from api_proc.boundary import BadRequest, error_response
from api_proc.state import Dispatcher, RequestState
from wire.messages import MAX_PRIORITY, ChatMessage, GenerateRequest, LogprobRequest, replace
from wire.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt, in exactly one of its three forms."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    template_json: str | None = None        # with messages: GenerateRequest.template_json
    image_data: list[str] | None = None     # its images, in placeholder order

    def request(self, rid: str, sampling: SamplingParams, **kw) -> GenerateRequest:
        return GenerateRequest(rid=rid, text=self.text, input_ids=self.input_ids,
                               messages=self.messages, sampling=sampling,
                               template_json=self.template_json,
                               image_data=self.image_data, **kw)


def sample_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n single-sample copies; with a seed, sample j gets seed + j."""
    one = replace(params, n=1)
    if one.sampling_seed is None or n == 1:
        return [one] * n
    return [replace(one, sampling_seed=(one.sampling_seed + j) % 2**64) for j in range(n)]


def expand(prompts: list[Prompt], params: list[SamplingParams], rids: list[str], *,
           stream: bool, logprob: LogprobRequest | None, fit_context: bool = False,
           priority: int = 0, lora: list[str | None] | None = None
           ) -> tuple[list[GenerateRequest], list[GenerateRequest]]:
    """(requests, warm-ups): rids has one entry per sample, prompt-major. lora: each
    prompt's LoRA adapter (None: all on the base model); a warm-up runs under its prompt's
    adapter, whose prefix cache entries are the samples' (scheduler_proc/request.py)."""
    reqs, warmups = [], []
    for prompt, p, adapter in zip(prompts, params, lora or [None] * len(prompts)):
        if p.n > 1:
            warmups.append(prompt.request(uuid.uuid4().hex,      # no grammar: no tokens
                                          replace(p, n=1, max_new_tokens=0, min_new_tokens=0,
                                                  json_schema=None, regex=None, ebnf=None),
                                          priority=priority, lora=adapter))
        for one in sample_params(p, p.n):
            reqs.append(prompt.request(rids[len(reqs)], one, stream=stream, logprob=logprob,
                                       fit_context=fit_context, priority=priority,
                                       lora=adapter))
    return reqs, warmups


def priority_of(body: dict) -> int:
    """A body's `priority` (SGLang's and vLLM's field): null or an integer; ValueError
    otherwise. It orders the queue only with --enable-priority-scheduling."""
    value = body.get("priority")
    if value is None:
        return 0
    if type(value) is not int or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
                         f"got {value!r}.")
    return value


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnect(request: Request, work) -> bool:
    """Run `work` unless the client disconnects first. True if it completed (its exception,
    if any, propagates); False if the client left and `work` was cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        # A cancelled gather() is finished with a CancelledError set as its exception, which
        # asyncio logs as "never retrieved" unless someone looks: we do, once it is done.
        task.add_done_callback(_retrieve)
        return False
    task.result()
    return True


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _raise(message: str, status: int) -> None:
    raise BadRequest(message, status)


async def settle(request: Request, dispatcher: Dispatcher, states: list[RequestState], waits,
                 error=error_response) -> Response | None:
    """Await `waits` (one per state, drained concurrently) unless the client leaves.
    Returns the response that ends the request early (499 when the client left, the
    first item's HTTP error when one was rejected; the rest are aborted), or None to go on."""
    if not await unless_disconnect(request, asyncio.gather(*waits)):
        dispatcher.abort_unfinished(states)
        return Response(status_code=499)
    failed = next((s for s in states if s.error is not None), None)
    if failed is not None:
        dispatcher.abort_unfinished(states)
        return error(failed.error.message, failed.error.status_code)
    return None


class Pipeline:
    def __init__(self, dispatcher: Dispatcher, share_prompts: bool = True):
        self.dispatcher = dispatcher
        self.share_prompts = share_prompts      # the radix cache is on: warm-ups pay off

    async def start(self, request: Request, reqs: list[GenerateRequest],
                    warmups: list[GenerateRequest], route: str) -> list[RequestState]:
        """Warm up, then submit. Raises BadRequest (or SubmitError) to answer at once.
        `route` names the requests in metrics and logs (the warm-ups are not counted)."""
        if self.dispatcher.lost:
            raise BadRequest(f"Server unhealthy: {self.dispatcher.lost}", 503)
        started = await self._warm_up(request, warmups)
        states = self.dispatcher.submit(reqs, route)
        if started is not None:
            for st in states:
                st.timing.created_at = started
        return states

    async def _warm_up(self, request: Request, warmups: list[GenerateRequest]) -> float | None:
        """Prefill the prompts of n > 1 requests once. Returns when the warm-up started (the
        samples' latencies count from there), or None if there was nothing to do."""
        if not (warmups and self.share_prompts):
            return None
        states = self.dispatcher.submit(warmups)
        started = min(s.timing.created_at for s in states)
        early = await settle(request, self.dispatcher, states,
                             [s.wait_finished() for s in states], error=_raise)
        if early is not None:                   # the client left
            raise BadRequest("The client went away.", 499)
        return started
