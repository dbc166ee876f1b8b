"""Tokenizer worker: turns GenerateRequests into TokenizedRequests for the scheduler.

Validation that needs token counts lives here (context length, vocabulary range). The
tokenizer also re-checks everything else a GenerateRequest carries (sampling ranges, logprob
ranges, exactly one prompt form): its socket is a trust boundary like any other, and nothing
reaches the scheduler unchecked. A rejected request goes straight back to the API as a
terminal output with status 400, the same path as any other output; an unexpected failure
while handling one request (a bug here) ends that request with a 500 and a logged
traceback, never the process. Aborts pass through to the scheduler in order.

A json_schema, regex or ebnf constraint is checked here to compile, so a bad grammar is a
400 before the request is queued; the scheduler then compiles it over the vocabulary. The
check runs in this worker's grammar checker, a child process (grammars/checker.py: a grammar
that crashes llguidance kills only the child, and is a 400), while the worker goes on with
other requests: a request waits for its grammar's verdict in `parked` (verdicts are cached,
so a grammar seen before costs nothing), then is tokenized and sent on as any other.

With --tokenizer-worker-num N there are N such processes, each with its own inbox; the
API's one PUSH socket hands them messages in turn. Order then holds per worker only: an
abort can overtake its request through another worker (the scheduler keeps such an abort
until its request arrives: scheduler.py, early aborts), and a batch's items can reach the
scheduler in any order (the API puts outputs back in input order).

Prompts become ids in tokenization/prompts.py (Tokenizer), which the API's /tokenize routes
share; this module is the process around it.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import zmq

from grammars.checker import Checker
from tokenization.prompts import NeedsCheck, RequestError, Tokenizer
from wire.addresses import Addresses, worker_title
from wire.codec import TOKENIZER_INBOX, encode
from wire.messages import (AbortRequest, FinishReason, FlushCacheRequest, GenerateRequest,
                           LoraRequest,
                           TextBatch, TextOutput)
from wire.proc import run_child
from wire.server_args import ServerConfig
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 1000   # of an exception's text quoted back to a client


# ---- the loop body ----------------------------------------------------------------------------

SCHEDULER = -1      # a destination: the scheduler; an int >= 0 is that API process


def _client_text(text: str) -> str:
    """An error text that is safe to send (encodable, bounded)."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def error_frame(rid: str, message: str, status_code: int) -> bytes:
    finish = FinishReason("abort", message=_client_text(message), status_code=status_code)
    return encode(TextBatch([TextOutput(rid, "", [], finish)]))


class Worker:
    """What the tokenizer process does with each inbox message, without sockets.

    `handle(msg)` returns (destination, frame) or None (dropped, or parked until its grammar's
    verdict: `collect()` returns what parked requests become) and never raises; the
    destination is SCHEDULER or the index of the API process that owns the request.
    Counters: `rejected` (requests answered with a 400), `failed` (answered with a 500:
    a bug here), `dropped` (messages that are not for the tokenizer, or that name an API
    process that does not exist).
    """

    def __init__(self, tokenizer: Tokenizer, api_servers: int = 1,
                 checker: Checker | None = None):
        self.tokenizer = tokenizer
        self.api_servers = api_servers
        self.checker = checker if checker is not None else Checker()
        # check number -> the grammar and the requests waiting for its verdict
        self.parked: dict[int, tuple[str, str, list[GenerateRequest]]] = {}
        self.rejected = self.failed = self.dropped = 0

    def collect(self) -> list[tuple[int, bytes]]:
        """What the parked requests whose grammar now has a verdict become (never blocks)."""
        out = []
        for seq, verdict in self.checker.collect():
            kind, text, reqs = self.parked.pop(seq)
            self.tokenizer.verdicts.put(kind, text, verdict)
            for req in reqs:
                routed = self.handle(req)
                if routed is not None:
                    out.append(routed)
        return out

    def _park(self, req: GenerateRequest, kind: str, text: str) -> None:
        same = next((p for p in self.parked.values() if p[0] == kind and p[1] == text), None)
        if same is not None:
            same[2].append(req)             # the same grammar is being checked already
        else:
            self.parked[self.checker.submit(kind, text)] = (kind, text, [req])

    def handle(self, msg) -> tuple[int, bytes] | None:
        try:
            if isinstance(msg, (AbortRequest, FlushCacheRequest, LoraRequest)):
                return SCHEDULER, encode(msg)   # control messages pass through, in order
            if isinstance(msg, GenerateRequest) and 0 <= msg.api < self.api_servers:
                return self._generate(msg)
        except Exception:
            log.exception("failed on a %s", type(msg).__name__)
        self.dropped += 1
        log.error("dropped a %s (%d dropped so far)", type(msg).__name__, self.dropped)
        return None

    def _generate(self, msg: GenerateRequest) -> tuple[int, bytes]:
        try:
            return SCHEDULER, encode(self.tokenizer.tokenize(msg))
        except NeedsCheck as e:
            self._park(msg, e.kind, e.text)
            return None
        except RequestError as e:
            self.rejected += 1
            log.info("rejected request %s (%d so far): %s", msg.rid, self.rejected, e)
            return msg.api, error_frame(msg.rid, str(e), 400)
        except Exception as e:
            self.failed += 1
            log.exception("internal error on request %s (%d so far)", msg.rid, self.failed)
            return msg.api, error_frame(msg.rid, f"Internal error in the tokenizer "
                                             f"({type(e).__name__}).", 500)


def make_worker(config: ServerConfig) -> Worker:
    """The worker as the process builds it."""
    return Worker(Tokenizer.of(config), config.args.api_server_count)


def wait(inbox: Inbox, checker: Checker) -> list:
    """The inbox's messages, blocking until there are some, or until the grammar checker has
    a verdict (or its current check runs out of time) while checks are pending."""
    fd = checker.fileno()
    if fd is None:
        return inbox.recv(timeout_ms=None)
    poller = zmq.Poller()
    poller.register(inbox.sock, zmq.POLLIN)
    poller.register(fd, zmq.POLLIN)
    poller.poll(max(1, int(checker.wait_s() * 1000) + 1))
    return inbox.recv(timeout_ms=0)


def main(config: ServerConfig, addrs: Addresses, index: int, conn: Connection) -> None:
    """Tokenizer worker `index` of --tokenizer-worker-num: binds its own inbox; every worker
    pushes to the same scheduler and API inboxes (PULL sockets fair-queue their peers)."""
    name = worker_title("tokenizer", index)

    def body(ready) -> None:
        worker = make_worker(config)
        ctx = zmq.Context()
        inbox = Inbox(ctx, addrs.tokenizer[index], TOKENIZER_INBOX)
        outboxes = {SCHEDULER: Outbox(ctx, addrs.scheduler),
                    **{k: Outbox(ctx, a) for k, a in enumerate(addrs.api)}}
        ready()
        while True:
            for routed in [worker.handle(m) for m in wait(inbox, worker.checker)] + \
                    worker.collect():
                if routed is not None:
                    outboxes[routed[0]].send_frame(routed[1])
    run_child(name, config.args.log_level, conn, body, ipc_dir=addrs.ipc_dir)
