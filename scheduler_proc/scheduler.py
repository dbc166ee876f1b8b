"""The scheduler core: admits requests, picks each step's segments, runs the model, and
emits one TokenBatch per step. It is given a model runner (runner.py: the model and its KV
buffers) and a KVManager (kv_manager.py: the slot pool, the request table and the prefix
cache), and knows no sockets: process.py feeds it the messages it receives (`step`) and
sends what it emits (the `send` and `reply` callables).

A step is a mixed batch: every running request that has finished its prompt decodes one
token, and up to --chunked-prefill-size prompt tokens are prefilled alongside, so a long
prompt delays running decodes by at most one chunk per step.

Memory is overcommitted the way SGLang does it: admission reserves only an estimate of each
running request's remaining tokens (`new_token_ratio` of them). When a step cannot get the
slots it needs, the most recently admitted requests are retracted to the front of the queue
(their KV goes into the prefix cache, their outputs so far are kept) and the estimate is
raised. Invariant: every accepted request gets exactly one terminal output.

Trust: anyone who can reach the scheduler's socket can forge a TokenizedRequest, so each is
checked against what the scheduler knows (`check`: vocabulary, context length, KV pool,
SamplingParams.verify, logprob ranges). A failing one is dropped, counted (rejected_total),
logged and answered with a terminal abort, status 400. A request with an empty rid or a rid
already in flight is dropped, counted and logged without an answer: that rid's output
stream belongs to the request already running. Aborts, releases and flushes with unknown or
odd values are no-ops.

Faults are isolated per request: a request whose sampling fails (runner.sample_isolated)
is ended with an abort, status 500; a model forward that raises ends that step's requests
the same way. A request ended by a fault offers the prefix cache only the positions
computed before the failed step. Anything else that raises (the bookkeeping itself: KV
pool, radix tree, request table) leaves the state unknown and ends the process, as does a
CUDA error other than out-of-memory (runner.leaves_device_unknown).

Constrained decoding (grammar.py): a request with a json_schema, regex or ebnf first waits
in `compiling`, holding no KV, while the `grammars` compiler builds its matcher on a thread
pool (cached by the grammar's text); it joins the queue once the matcher is ready, or ends
with a 400 if the grammar does not compile (or its checker refuses it). Aborts and releases
reach it there like anywhere else. While nothing else can run the loop blocks on the compiles (GRAMMAR_WAIT at a time),
never spinning. After each sampled token the request's matcher consumes it; a grammar that
is complete ends the request with finish reason stop (matched: that token), also when the
same token reaches max_new_tokens; a token the matcher cannot take because llguidance ran
past one of its limits ends the request with a 400 naming it. A retracted request keeps its output ids, so its matcher
stays valid (Matcher.sync checks).

Overload (--max-queued-requests N): of the requests that arrived with a step's messages,
those still waiting after the step's admission while more than N wait are ended with an
abort, status 503, newest first (with priorities, worst-ranked first). Requests retracted
to the queue are never dropped.

Priority (--enable-priority-scheduling): the queue is kept in `rank` order, higher
`priority` first (lower with --schedule-low-priority-values-first), then arrival; admission
takes its head as always. When memory runs out the worst-ranked running request is
retracted rather than the newest, and a waiting request that cannot be admitted (no room,
or --max-running-requests reached) retracts running ones whose priority is more than
--priority-scheduling-preemption-threshold worse (`preempt`), if that lets it in; such a
retraction does not raise the memory estimate. A waiting request whose priority is better
than every running one's gets the step that admits it to itself (`first_step_alone`: its
first chunk without the running rows, which wait one step), so its first token comes one
step after the step in flight, as on an idle server. Nothing ages a waiting request: a steady
stream of higher priorities starves lower ones, bounded only by --request-timeout (off by
default). Without the flag the field is ignored: arrival order, newest retracted first.

Vector requests (embeddings and scores: wire/messages.py VectorRequest) are prefill-only,
like the n > 1 warm-ups: batched with everything else, they read their answer off their
prompt's steps (runner.py) and end once the prompt is computed, the answer on their
terminal output. Their KV goes to the prefix cache like any finished request's (evictable:
nothing stays held). Mean and cls pooling take no cached prefix, since they read position 0
onwards (Req.max_prefix_match). With --is-embedding only embeddings are accepted; any other
request is refused with a 400.

LoRA adapters (--enable-lora; adapters.py holds them by name, models/lora.py computes them):
a request naming an adapter that is not loaded, or is being unloaded, is refused with a 404.
Admission keeps at most --max-loras-per-batch distinct adapters among the running requests
(the queue's head waits for one to end, as for memory); each step's segments are ordered by
adapter within the decode part and within the prefill part, so each adapter's rows are at
most two runs. An unload answers once the requests that named the adapter have ended.

Test only: the environment variable ZSERVE_TEST_STALL_AFTER_STEPS=N makes the scheduler
sleep forever inside its (N+1)-th model step, to test the watchdog (process.py). Never set
it outside tests.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Callable

from grammars.llg import client_message
from scheduler_proc.grammar import GrammarError
from scheduler_proc.adapters import Adapters
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.request import Req
from scheduler_proc.runner import Segment, leaves_device_unknown
from scheduler_proc.speculative import Speculator, accepted_run
from wire.messages import (MAX_PRIORITY, MAX_TOP_LOGPROBS, AbortRequest, ControlReply, DecodeParams,
                           FinishReason, FlushCacheRequest, LoraRequest, ReleaseRequest,
                           SchedulerLoad, TokenBatch, TokenizedRequest, TokenOutput, replace)
from wire.server_args import ServerArgs

log = logging.getLogger(__name__)

EARLY_ABORT_TTL = 30.0      # seconds to remember an abort that overtook its request
MAX_EARLY_ABORTS = 100_000  # remembered at most (oldest forgotten first): forged aborts
INIT_NEW_TOKEN_RATIO = 0.7  # share of a request's remaining max_new_tokens reserved for it
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600   # per step
HELD_OUTPUT_INTERVAL = 50   # tokens a non-streaming request's output may wait (see emit)
GRAMMAR_WAIT = 0.05         # seconds the idle loop blocks on grammar compiles at a time
STALL_ENV = "ZSERVE_TEST_STALL_AFTER_STEPS"
LOG_RID_CHARS = 80          # a forged rid can be megabytes long: log only its start

# Until wire/messages.py's SchedulerLoad has a rejected_total field, it is only logged.


class Scheduler:
    def __init__(self, args: ServerArgs, runner, kv: KVManager,
                 send: Callable[[TokenBatch], None], reply: Callable[[ControlReply], None],
                 replica: int = 0, grammars=None):
        """`runner` is a ModelRunner (or a test's stand-in with the same attributes: device,
        context_len, config, forward); `kv` allocates the KV slots of the runner's buffers
        and has a table row for each of args.max_running_requests; `send` takes each
        step's TokenBatch, `reply` each ControlReply. `replica`: which data-parallel
        replica this is (--dp-size), named in every load it reports. `grammars`: a
        grammar.GrammarCompiler (or a test's stand-in with compile and matcher); without
        one, constrained requests are refused with a 400."""
        self.args = args
        self.replica = replica
        self.counts_tokens = args.dp_size > 1 and args.load_balance_method == "shortest_queue"
        self.runner = runner
        self.kv = kv
        self.send, self.reply = send, reply
        self.eos_ids = set(runner.config.eos_token_ids)
        self.vocab_size = runner.config.vocab_size
        self.grammars = grammars
        device = getattr(runner.device, "type", runner.device)
        draft = None
        if args.speculative_algorithm == "STANDALONE":
            from scheduler_proc.draft_model import DraftModel
            draft = DraftModel(args.speculative_draft_model_path, runner.model,
                               runner.dtype, runner.device, kv.pool.size,
                               kv.req_to_token.table, runner.context_len)
        self.spec = Speculator.of(args, str(device), draft)     # None without speculation
        # LoRA adapters by name (adapters.py); None without --enable-lora.
        self.adapters = Adapters(args, runner) if args.enable_lora else None
        self.compiling: list[Req] = []            # waiting for their grammar, in arrival order
        self.waiting: deque[Req] = deque()        # arrival order, or rank order (priority)
        self.by_priority = args.enable_priority_scheduling
        self.running: list[Req] = []              # in admission order
        self.in_flight: dict[str, Req] = {}       # rid -> its Req, waiting or running
        self.arrivals: list[Req] = []             # accepted from this step's messages
        self.outputs: list[TokenOutput] = []      # sent with the next TokenBatch
        self.early_aborts: dict[str, float] = {}  # rid -> when its abort arrived (in order)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.seq = 0
        self.steps = 0                            # model steps run
        self.stall_after = int(os.environ[STALL_ENV]) if os.environ.get(STALL_ENV) else None
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.retracted_total = 0
        self.preempted_total = 0                  # of those, retracted for a higher priority
        self.rejected_total = 0
        self.requests_total = 0                   # accepted (queued) since start
        self.cached_tokens_total = 0
        self.received_total = 0                   # TokenizedRequests handled, any outcome

    # ---- the step -----------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.compiling)

    def step(self, msgs: list) -> None:
        """Handle the messages received since the last step, run one model step if there is
        work, and send the step's outputs."""
        for msg in msgs:
            self.handle(msg)
        self.collect_grammars()
        segments = self.schedule()
        self.limit_queue()
        if segments:
            self.run(segments)
        elif self.compiling:
            self.wait_grammars(GRAMMAR_WAIT)
        if self.outputs:
            self.send(TokenBatch(outputs=self.outputs, load=self.load()))
            self.outputs = []

    def run(self, segments: list[Segment]) -> None:
        self.steps += 1
        if self.stall_after is not None and self.steps > self.stall_after:
            log.warning("%s=%d: stalling inside step %d (test only)", STALL_ENV,
                        self.stall_after, self.steps)
            while True:
                time.sleep(3600)
        try:
            next_ids = self.runner.forward(segments, self.kv.req_to_token.table)
        except Exception as e:
            if leaves_device_unknown(e):
                raise
            self.fail_step(segments, e)
            return
        self.finish_step(segments, next_ids)

    # ---- inbox --------------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedRequest):
            self.received_total += 1
            self.add(msg)
        elif isinstance(msg, AbortRequest):
            self.abort(msg)
        elif isinstance(msg, ReleaseRequest):
            for rid in dict.fromkeys(msg.rids):
                if (req := self.in_flight.get(rid)) is not None:
                    self.finish(req, FinishReason(type="abort",
                                                  message="Released by the detokenizer."))
        elif isinstance(msg, FlushCacheRequest):
            self.flush_cache(msg.req_id, msg.api)
        elif isinstance(msg, LoraRequest):
            self.lora_control(msg)
        else:
            log.error("unexpected message %s", type(msg).__name__)

    def add(self, msg: TokenizedRequest) -> None:
        if not msg.rid or msg.rid in self.in_flight:
            self.rejected_total += 1
            log.warning("dropped a request with %s rid %r (%d rejected so far)",
                        "a duplicate" if msg.rid else "an empty", msg.rid[:LOG_RID_CHARS],
                        self.rejected_total)
            return
        problem = self.check(msg)
        if problem is not None:
            self.reject(msg, problem)
            return
        if msg.lora is not None and (problem := self.adapters.problem(msg.lora)) is not None:
            self.reject(msg, problem, status=404)
            return
        if msg.fit_context:
            self.fit_pool(msg)
        images = getattr(self.runner, "images", None)
        req = Req(msg, self.runner.device, images.image_token_id if images else None)
        if images is not None and images.mrope:
            images.place(req)
        self._expire_early_aborts()
        if self.early_aborts.pop(req.rid, None) is not None:
            self.finish(req, FinishReason(type="abort", message="Aborted by the client."))
        elif req.max_total_tokens > self.kv.pool.size:
            # Even alone, with every cached prefix evicted, it could not finish.
            self.finish(req, FinishReason(
                type="abort", status_code=400,
                message=f"The request needs {req.max_total_tokens} KV slots (prompt + "
                        f"max_new_tokens) but the pool has {self.kv.pool.size}."))
        else:
            self.in_flight[req.rid] = req
            if msg.lora is not None:
                req.use_adapter(self.adapters.acquire(msg.lora))
            self.arrivals.append(req)
            self.requests_total += 1
            if req.sampling.grammar is not None:
                req.grammar_future = self.grammars.compile(req.sampling.grammar)
                self.compiling.append(req)
            else:
                self.enqueue(req)

    def check(self, msg: TokenizedRequest) -> str | None:
        """Why msg cannot run here (a client-facing message), or None. Repeats what the
        API and the tokenizer check, against what only the scheduler knows for sure."""
        ids, s, lp = msg.input_ids, msg.sampling, msg.logprob
        vocab, context = self.vocab_size, self.runner.context_len
        if not ids:
            return "The input is empty."
        if not -MAX_PRIORITY <= msg.priority <= MAX_PRIORITY:
            return f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]."
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            return f"Token id {bad} in input_ids is outside the vocabulary [0, {vocab})."
        if len(ids) >= context:
            return (f"The input ({len(ids)} tokens) is longer than the model's context "
                    f"length ({context} tokens).")
        try:
            s.verify(vocab)
        except ValueError as e:
            return str(e)
        if len(ids) + s.max_new_tokens >= context:
            return (f"Requested token count exceeds the model's maximum context length of "
                    f"{context} tokens: {len(ids)} input tokens plus max_new_tokens "
                    f"{s.max_new_tokens}.")
        if lp is not None and not 0 <= lp.top_logprobs_num <= MAX_TOP_LOGPROBS:
            return (f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got "
                    f"{lp.top_logprobs_num}.")
        if lp is not None and lp.start_len < -1:
            return f"logprob_start_len must be at least -1, got {lp.start_len}."
        if s.grammar is not None and self.grammars is None:
            return "Constrained decoding (json_schema, regex, ebnf) is not available here."
        if msg.lora is not None and self.adapters is None:
            return "This server serves no LoRA adapters (start it with --enable-lora)."
        if (v := msg.vector) is not None:
            if (problem := v.problem(vocab)) is not None:
                return problem
            if s.max_new_tokens != 0:
                return "An embedding or score request is prefill-only (max_new_tokens 0)."
            if msg.images:
                return "Embeddings and scores of prompts with images are not supported."
        if self.args.is_embedding and (msg.vector is None or msg.vector.pooling == "labels"):
            return ("This server serves embeddings only (--is-embedding): use "
                    "/v1/embeddings.")
        if msg.images:
            images = getattr(self.runner, "images", None)
            if images is None:
                return "This model does not take images."
            return images.check(ids, msg.images)
        return None

    def reject(self, msg: TokenizedRequest, message: str, status: int = 400) -> None:
        """End a request that failed `check` before it became a Req: its one terminal
        output, with status 400 (404: an adapter it names is not loaded)."""
        self.rejected_total += 1
        log.warning("rejected request %r (%d rejected so far): %s",
                    msg.rid[:LOG_RID_CHARS], self.rejected_total, message)
        self.outputs.append(TokenOutput(
            rid=msg.rid, new_ids=[], prompt_tokens=len(msg.input_ids), cached_tokens=0,
            finish=FinishReason(type="abort", message=message, status_code=status),
            queue_time=None, decode=DecodeParams(api=msg.api)))

    def fit_pool(self, msg: TokenizedRequest) -> None:
        """max_new_tokens was a default (chat without max_tokens): lower it, and
        min_new_tokens with it, to what the KV pool can hold next to the prompt. A prompt
        that cannot fit alone is left for `add` to refuse."""
        s, n, pool = msg.sampling, len(msg.input_ids), self.kv.pool.size
        room = pool - n + 1              # max_total_tokens = n + max_new_tokens - 1
        if s.max_new_tokens > room >= 1:
            msg.sampling = replace(s, max_new_tokens=room,
                                   min_new_tokens=min(s.min_new_tokens, room))

    def limit_queue(self) -> None:
        """--max-queued-requests: see the module docstring. Requests waiting for their
        grammar count as waiting."""
        arrivals, self.arrivals = self.arrivals, []
        limit = self.args.max_queued_requests
        queued = len(self.waiting) + len(self.compiling)
        # Newest first; with priorities the worst-ranked first.
        for req in (sorted(arrivals, key=self.rank, reverse=True) if self.by_priority
                    else reversed(arrivals)):
            if limit is None or queued <= limit:
                break
            if req.finish is None and req.row is None:    # not admitted, not ended
                self.finish(req, FinishReason(
                    type="abort", status_code=503,
                    message=f"The request queue is full ({limit} requests waiting); try "
                            f"again later."))
                queued -= 1
        for req in arrivals:
            if req.grammar_future is None:        # still compiling: admitted once it is done
                self.admit(req)

    def abort(self, msg: AbortRequest) -> None:
        if msg.abort_all:
            found = list(self.in_flight.values())
        else:
            found = [r] if (r := self.in_flight.get(msg.rid)) is not None else []
        for req in found:
            self.finish(req, FinishReason(type="abort", message=msg.message))
        if not found and not msg.abort_all:
            self.early_aborts.pop(msg.rid, None)      # re-inserted last: kept in time order
            self.early_aborts[msg.rid] = time.monotonic()
            self._expire_early_aborts()

    def _expire_early_aborts(self) -> None:
        now = time.monotonic()
        while self.early_aborts:
            rid, t = next(iter(self.early_aborts.items()))
            if now - t <= EARLY_ABORT_TTL and len(self.early_aborts) <= MAX_EARLY_ABORTS:
                return
            del self.early_aborts[rid]

    # ---- grammars -----------------------------------------------------------------------

    def collect_grammars(self) -> None:
        """Requests whose grammar compile is done join the queue with their own matcher, or
        end with a 400 naming the problem (a fault in the compiler itself: 500)."""
        for req in [r for r in self.compiling if r.grammar_future.done()]:
            self.compiling.remove(req)
            fut, req.grammar_future = req.grammar_future, None
            try:
                req.grammar = self.grammars.matcher(fut)
            except GrammarError as e:
                self.rejected_total += 1
                log.info("rejected request %r: %s", req.rid[:LOG_RID_CHARS], e)
                self.finish(req, FinishReason(type="abort", status_code=400, message=str(e)))
                continue
            except Exception as e:                # noqa: BLE001 - this request's fault only
                log.error("compiling the grammar of %r failed", req.rid[:LOG_RID_CHARS],
                          exc_info=e)
                self.finish(req, FinishReason(
                    type="abort", status_code=500,
                    message=f"Internal error while compiling this request's grammar: "
                            f"{type(e).__name__}: {e}"))
                continue
            self.enqueue(req)
            if not any(req is r for r in self.arrivals):
                self.admit(req)                   # an arrival: once limit_queue passed it

    def wait_grammars(self, timeout: float) -> None:
        """Block until some compile is done or `timeout` seconds pass (the idle loop's wait
        while only compiles are pending: process.py then polls its inbox and steps)."""
        wait_futures([r.grammar_future for r in self.compiling], timeout=timeout,
                     return_when=FIRST_COMPLETED)

    def advance_grammar(self, req: Req, token: int) -> FinishReason | None:
        """Feed a constrained request's matcher its new token (already in output_ids); the
        reason it ends now, if it does."""
        if req.grammar is None:
            return None
        if not req.grammar.consume(token):
            if req.grammar.limit_error:           # its mask ran past a limit: the grammar's
                log.info("the grammar of %r hit a limit after %d tokens: %s",
                         req.rid[:LOG_RID_CHARS], len(req.output_ids) - 1,
                         req.grammar.limit_error)
                return FinishReason(type="abort", status_code=400, message=(
                    f"The grammar ran past a limit of the grammar engine after "
                    f"{len(req.output_ids) - 1} tokens: "
                    f"{client_message(req.grammar.limit_error)}"))
            log.error("the grammar of %r rejected sampled token %d: %s",   # never expected
                      req.rid[:LOG_RID_CHARS], token, req.grammar.error)
            return FinishReason(type="abort", status_code=500,
                                message=f"Internal error: the grammar rejected sampled token "
                                        f"{token}.")
        if req.grammar.stopped:
            return FinishReason(type="stop", matched_token=token)
        return None

    # ---- scheduling ---------------------------------------------------------------------

    def _reservation(self, r: Req) -> int:
        """What `reserved` counts for running request r."""
        return r.seq_len - r.num_computed + math.ceil(
            (r.sampling.max_new_tokens - len(r.output_ids)) * self.new_token_ratio)

    def reserved(self) -> int:
        """Slots the running requests are expected to still need (estimated)."""
        return sum(self._reservation(r) for r in self.running)

    def admit_cost(self, req: Req) -> int:
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        return req.seq_len + math.ceil(remaining * self.new_token_ratio)

    def admissible(self, req: Req, running: list[Req] | None = None,
                   room: int | None = None) -> bool:
        """Can req join `running` (default: the running batch) now: a row free, its
        admit_cost within `room` (default: the free slots less the running requests'
        reservations; any cost when nothing runs), its adapter within
        --max-loras-per-batch."""
        running = self.running if running is None else running
        if running and room is None:
            room = self.kv.available - self.reserved()
        return (len(running) < self.args.max_running_requests
                and (not running or self.admit_cost(req) <= room)
                and (self.adapters is None or self.adapters.fits(running, req)))

    def schedule(self) -> list[Segment]:
        self.make_room()
        if self.by_priority:
            self.preempt()
        budget = self.args.chunked_prefill_size
        segments: list[Segment] = []
        alone = self.by_priority and self.first_step_alone()
        for req in self.running if not alone else ():
            todo = req.seq_len - req.num_computed
            n = todo if todo == 1 else min(todo, budget)
            if n == 0 or n > self.kv.available:
                continue
            budget -= n if todo > 1 else 0
            segments.append(self._segment(req, n, todo))
        while self.waiting and budget > 0 and self.admissible(self.waiting[0]):
            req = self.waiting.popleft()
            self.kv.admit(req)
            self.running.append(req)
            if req.cached_tokens is None:
                req.cached_tokens = req.prefix_len
                self.prompt_tokens_total += len(req.input_ids)
                self.cached_tokens_total += req.prefix_len
            todo = req.seq_len - req.num_computed
            n = min(todo, budget)
            budget -= n
            segments.append(self._segment(req, n, todo))
            if alone:
                break
        now = time.monotonic()
        for seg in segments:
            if seg.req.queue_time is None:
                seg.req.queue_time = now - seg.req.arrived_at
        if segments:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                       self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        # Decode rows first (see attention.py); within each part, a LoRA adapter's rows
        # together (models/lora.py: runs).
        segments.sort(key=lambda s: (s.length != 1,
                                     0 if s.req.adapter is None else s.req.adapter.slot))
        if self.spec is not None:
            self.add_drafts(segments)
        return segments

    def add_drafts(self, segments: list[Segment]) -> None:
        """Give decoding requests draft tokens to verify this step (speculative.py), as
        many as their measured acceptance pays for at this step's size, within the slots
        left: a draft never costs another request its place. Drafts end at a stop token
        (nothing after it is kept) and at what the grammar allows."""
        rows = sum(seg.length for seg in segments)
        tokens = float(sum(seg.sample for seg in segments))
        spare = self.kv.pool.num_free         # free slots only: a draft evicts no cache
        for seg in segments:
            req = seg.req
            if seg.length != 1 or not seg.sample or spare <= 0:
                continue
            cap = min(spare, req.sampling.max_new_tokens - len(req.output_ids) - 1)
            k = self.spec.draft_len(req, rows, tokens, cap)
            if k == 0:
                continue
            self.kv.extend(req, k)          # a draft model writes its K/V there
            try:
                draft = self.spec.propose(req, k)
            except Exception as e:          # the request's drafts, not the step
                if leaves_device_unknown(e):
                    raise
                log.error("proposing drafts for request %s failed", req.rid, exc_info=e)
                self.spec.reset(req)
                draft = []
            stops = req.sampling.stop_ids(self.eos_ids)
            for i, token in enumerate(draft):
                if token in stops:
                    draft = draft[:i + 1]
                    break
            if draft and req.grammar is not None:
                draft = draft[:req.grammar.valid_prefix(draft)]
            if len(draft) < k:
                self.truncate(req, seg.start + 1 + len(draft))
            if draft:
                seg.length += len(draft)
                seg.draft = draft
                spare -= len(draft)
                rows += len(draft)
                tokens += self.spec.expected(req, len(draft))

    def truncate(self, req: Req, n: int) -> None:
        """Give back req's positions n and after (drafts cut or rejected)."""
        self.kv.truncate(req, n)
        self.spec.truncated(req, n)

    def _segment(self, req: Req, n: int, todo: int) -> Segment:
        """Give req slots for its next n positions. The segment samples when it reaches the
        newest token, unless the request is prefill-only (max_new_tokens 0)."""
        self.kv.extend(req, n)
        return Segment(req, req.num_computed - n, n,
                       sample=n == todo and req.sampling.max_new_tokens > 0)

    def step_need(self) -> int:
        """Slots this step needs at least: one per decoding request, plus the next chunk of
        the oldest request still in its prompt (so a prefill can never starve)."""
        todos = [r.seq_len - r.num_computed for r in self.running]
        prefill = next((t for t in todos if t > 1), 0)
        return todos.count(1) + min(prefill, self.args.chunked_prefill_size)

    def make_room(self) -> None:
        """Retract the newest (with priorities: the worst-ranked) running requests until this
        step's minimum fits."""
        while len(self.running) > 1 and self.kv.available < self.step_need():
            self.retract(max(self.running, key=self.rank) if self.by_priority
                         else self.running[-1])

    # ---- priority ---------------------------------------------------------------------

    def rank(self, req: Req) -> tuple[int, float]:
        """Priority order, smallest first: the better priority, then the earlier arrival."""
        p = req.priority if self.args.schedule_low_priority_values_first else -req.priority
        return p, req.arrived_at

    def enqueue(self, req: Req, front: bool = False) -> None:
        """Into the waiting queue: at the back (front: a retracted request), or with
        priorities at its rank (after those ranked the same or better)."""
        if not self.by_priority:
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        self.waiting.insert(bisect.bisect_right(self.waiting, self.rank(req), key=self.rank),
                            req)

    def first_step_alone(self) -> bool:
        """Does the queue's head get this step to itself: its priority better than every
        running request's, and admissible now? Its first chunk then runs without the
        running requests' rows (they wait one step), so its first token comes as soon as
        on an idle server but for the step in flight (TTFT under load)."""
        head = self.waiting[0] if self.waiting else None
        if head is None or not self.running or head.cached_tokens is not None:
            return False                        # (a retracted request: not its first step)
        best_running = min(self.rank(r)[0] for r in self.running)
        return self.rank(head)[0] < best_running and self.admissible(head)

    def preempt(self) -> None:
        """The queue's head, if it cannot be admitted now (no room, or the running batch is
        full), retracts the worst-ranked running requests whose priority is more than
        --priority-scheduling-preemption-threshold worse than its own (SGLang's rule), as
        many as it takes, and only if that many would let it in."""
        if not (self.waiting and self.running):
            return
        head, threshold = self.waiting[0], self.args.priority_scheduling_preemption_threshold
        if self.admissible(head):
            return
        room = self.kv.available - self.reserved()
        cost = self.admit_cost(head)
        victims: list[Req] = []
        for victim in sorted(self.running, key=self.rank, reverse=True):
            if self.rank(victim)[0] - self.rank(head)[0] <= threshold:
                return                          # nobody else may go: it cannot get in
            victims.append(victim)
            room += len(victim.slots) + self._reservation(victim)
            if cost <= room and self.admissible(
                    head, [r for r in self.running if r not in victims], room):
                break
        else:
            return
        for victim in victims:
            self.retract(victim, why=f"for {head.rid} (priority {head.priority})",
                         raise_ratio=False)
            self.preempted_total += 1

    def retract(self, req: Req, why: str = "to free KV memory",
                raise_ratio: bool = True) -> None:
        """Back to the queue, its KV to the prefix cache, its outputs kept. raise_ratio:
        reserve more for the running requests from now on (memory ran out; not when a
        higher priority made the room)."""
        self.kv.release(req)
        if self.spec is not None:
            self.spec.reset(req)
        if not req.announced:
            req.reset_input_logprobs()
        if req.grammar is not None:
            req.grammar.sync(req.output_ids)      # a no-op: the output ids are kept
        self.running.remove(req)
        self.enqueue(req, front=True)
        self.retracted_total += 1
        if raise_ratio:
            self.new_token_ratio = 1.0
        log.info("retracted %s (%d tokens) %s", req.rid, req.seq_len, why)

    # ---- results ------------------------------------------------------------------------

    def finish_step(self, segments: list[Segment], next_ids: list[int | Exception]) -> None:
        for seg in segments:        # prefill-only requests end once their prompt is cached
            req = seg.req
            if req.sampling.max_new_tokens == 0 and req.num_computed == req.seq_len:
                self.finish(req, FinishReason(type="length", length=0))
        for seg, out in zip([s for s in segments if s.sample], next_ids):
            req = seg.req
            if isinstance(out, Exception):        # logged by the runner
                self.finish(req, FinishReason(
                    type="abort", status_code=500,
                    message=f"Internal error while sampling this request: "
                            f"{type(out).__name__}: {out}"), valid=seg.start)
                continue
            if req.first_token_at is None:
                req.first_token_at = time.monotonic()
            new_ids: list[int] = []
            reason = None
            for token in out if isinstance(out, list) else [out]:
                req.output_ids.append(token)
                new_ids.append(token)
                reason = self.advance_grammar(req, token) or self.check_finished(req, token)
                if reason is not None:
                    break
            self.generated_tokens_total += len(new_ids)
            if seg.draft:
                # Positions start.. held the last token and the drafts; those past the
                # accepted ones are given back before anything caches this request's KV.
                self.truncate(req, seg.start + len(new_ids))
                self.spec.record(req, len(seg.draft), accepted_run(seg.draft, new_ids))
                if req.pending_logprobs is not None:
                    req.pending_logprobs = req.pending_logprobs.head(len(new_ids))
            if reason is not None:
                self.finish(req, reason, new_ids=new_ids)
            else:
                self.emit(req, new_ids, None)

    def fail_step(self, segments: list[Segment], error: Exception) -> None:
        """The model forward raised: end every request of the step with an error. The KV of
        the step's positions may be half written, so it is freed, never cached."""
        log.error("the model forward failed; ending the step's %d requests (%s)",
                  len(segments), ", ".join(s.req.rid[:LOG_RID_CHARS] for s in segments),
                  exc_info=error)
        message = (f"Internal error in the model forward: {type(error).__name__}: "
                   f"{error}")
        for seg in segments:
            self.finish(seg.req, FinishReason(type="abort", status_code=500, message=message),
                        valid=seg.start)

    def check_finished(self, req: Req, token: int) -> FinishReason | None:
        s = req.sampling
        if len(req.output_ids) >= s.max_new_tokens:
            return FinishReason(type="length", length=s.max_new_tokens)
        if len(req.output_ids) > s.min_new_tokens:
            if (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
                return FinishReason(type="stop", matched_token=token)
        return None

    def finish(self, req: Req, reason: FinishReason, new_ids: list[int] | None = None,
               valid: int | None = None) -> None:
        """End a request wherever it is and free what it holds. `valid`: see
        KVManager.release (positions whose KV may be cached)."""
        if req.row is not None:
            self.kv.release(req, valid)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.compiling:
            self.compiling.remove(req)            # its compile goes on for the cache
        if self.in_flight.get(req.rid) is req:
            del self.in_flight[req.rid]
            if req.adapter is not None:
                self.adapters.release(req.adapter)
        if self.spec is not None:
            self.spec.finished(req)
        req.finish = reason
        self.emit(req, new_ids or [], reason)

    def emit(self, req: Req, new_ids: list[int], finish: FinishReason | None) -> None:
        """Queue req's output for this step's TokenBatch. A request whose tokens nobody
        watches (Req.output_can_wait) sends its first token at once (first-token latency),
        then every HELD_OUTPUT_INTERVAL tokens and at its end, as SGLang does for
        non-streaming requests: with one request on two cores, waking the detokenizer
        and the API for every token cost ~10% of decode speed."""
        if req.held_ids:
            new_ids, req.held_ids = req.held_ids + new_ids, []
        if finish is None and req.announced and req.output_can_wait \
                and len(new_ids) < HELD_OUTPUT_INTERVAL:
            req.held_ids = new_ids
            return
        first = not req.announced
        prefill_time, decode_time = req.phase_times() if finish is not None else (None, None)
        self.outputs.append(TokenOutput(
            rid=req.rid, new_ids=new_ids, finish=finish, prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens or 0, queue_time=req.queue_time,
            decode=None if req.decode_sent else req.decode_params(),
            logprobs=req.pending_logprobs if new_ids else None,
            input_logprobs=req.input_logprobs if first and req.wants_input_logprobs else None,
            prefill_time=prefill_time, decode_time=decode_time,
            vector=req.vector_bytes() if finish is not None and finish.type == "length"
            else None,
            spec=None if self.spec is None else self.spec.stats(req)))
        req.pending_logprobs = None
        req.announced = req.decode_sent = True

    def admit(self, req: Req) -> None:
        """Tell a streamed request's client it passed every check (it is queued to run): an
        output with no tokens, no finish and no queue_time yet (the API starts the stream's
        HTTP response on it; DESIGN.md: rejections are decided before it)."""
        if req.stream and not req.decode_sent and req.finish is None:
            self.outputs.append(TokenOutput(
                rid=req.rid, new_ids=[], finish=None, prompt_tokens=len(req.input_ids),
                cached_tokens=0, queue_time=None, decode=req.decode_params()))
            req.decode_sent = True

    # ---- introspection ------------------------------------------------------------------

    def flush_cache(self, req_id: str, api: int) -> None:
        if self.running or self.waiting or self.compiling:
            ok, message = False, "Cache not flushed because there are pending requests."
        else:
            self.kv.flush()
            if self.spec is not None:
                self.spec.flush()                 # what finished requests said, too
            ok, message = True, "Cache flushed."
        self.reply(ControlReply(req_id=req_id, ok=ok, message=message, loads=[self.load()],
                                api=api))

    def lora_control(self, msg: LoraRequest) -> None:
        """/load_lora_adapter and /unload_lora_adapter: answered once done (an unload waits
        for the requests using the adapter)."""
        def done(ok: bool, message: str) -> None:
            self.reply(ControlReply(req_id=msg.req_id, ok=ok, message=message,
                                    loads=[self.load()], api=msg.api))
        if self.adapters is None:
            done(False, "This server serves no LoRA adapters (start it with --enable-lora).")
        elif msg.op == "load":
            done(*self.adapters.load(msg.name, msg.path))
        elif msg.op == "unload":
            self.adapters.unload(msg.name, done)
        else:
            done(False, f"Unknown adapter operation {msg.op!r}.")

    def load(self) -> SchedulerLoad:
        pool = self.kv.pool
        self.seq += 1
        return SchedulerLoad(seq=self.seq, replica=self.replica, running=len(self.running),
                             queued=len(self.waiting) + len(self.compiling),
                             kv_total=pool.size, kv_free=pool.num_free,
                             kv_evictable=self.kv.evictable,
                             prompt_tokens_total=self.prompt_tokens_total,
                             generated_tokens_total=self.generated_tokens_total,
                             retracted_total=self.retracted_total,
                             preempted_total=self.preempted_total,
                             rejected_total=self.rejected_total,
                             requests_total=self.requests_total,
                             cached_tokens_total=self.cached_tokens_total,
                             lora_adapters=[] if self.adapters is None else self.adapters.names,
                             **self.token_counts(), **self.spec_counts())

    def spec_counts(self) -> dict:
        if self.spec is None:
            return {}
        return {"spec_draft_total": self.spec.drafted_total,
                "spec_accept_hist": list(self.spec.accept_lengths)}

    def token_counts(self) -> dict[str, int]:
        """The queued and running requests' tokens, for a data-parallel controller that
        balances by them (--load-balance-method shortest_queue); O(requests), so only
        counted there."""
        if not self.counts_tokens:
            return {}
        return {"queued_tokens": sum(r.seq_len for r in self.waiting)
                + sum(r.seq_len for r in self.compiling),
                "running_tokens": sum(r.seq_len for r in self.running)}
