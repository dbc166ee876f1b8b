"""Detokenizer process: one TokenBatch in, one TextBatch out, per scheduler step.

Per rid it keeps a DecodeStream from the rid's first output (which carries DecodeParams)
until its terminal output. When a stop string matches, the request is finished here: the
API gets the terminal output at once and the scheduler gets a ReleaseRequest; until the
scheduler's own terminal output for that rid arrives, its outputs are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq

from detokenizer_proc.incremental import DecodeStream
from wire.addresses import Addresses
from wire.messages import (FinishReason, Logprobs, ReleaseRequest, TextBatch, TextOutput,
                           TokenBatch, TokenOutput)
from wire.proc import run_child
from wire.server_args import ServerArgs
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RidState:
    stream: DecodeStream
    completion_tokens: int = 0
    released: bool = False      # finished here by a stop string; awaiting the scheduler's end


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RidState] = {}

    def process(self, batch: TokenBatch) -> tuple[TextBatch, list[str]]:
        """Returns the text outputs and the rids to release in the scheduler."""
        outs: list[TextOutput] = []
        release: list[str] = []
        for o in batch.outputs:
            st = self.states.get(o.rid)
            if st is None:
                if o.decode is None:
                    log.error("output for unknown rid %s without decode params", o.rid)
                    continue
                d = o.decode
                st = self.states[o.rid] = RidState(DecodeStream(
                    self.tokenizer, skip_special_tokens=d.skip_special_tokens,
                    spaces_between_special_tokens=d.spaces_between_special_tokens,
                    stop=d.stop, no_stop_trim=d.no_stop_trim))
            if st.released:
                if o.finish is not None:
                    del self.states[o.rid]
                continue
            out = self._step(st, o)
            if out.finish is not None:
                if o.finish is None:        # finished by a stop string: the scheduler runs on
                    st.released = True
                    release.append(o.rid)
                else:
                    del self.states[o.rid]
            outs.append(out)
        return TextBatch(outs, batch.load), release

    def _step(self, st: RidState, o: TokenOutput) -> TextOutput:
        delta = st.stream.push(o.new_ids, finished=o.finish is not None)
        used = o.new_ids[:delta.num_ids]
        st.completion_tokens += len(used)
        finish = o.finish
        if delta.stop_matched is not None:
            finish = FinishReason("stop", matched_str=delta.stop_matched)
        return TextOutput(rid=o.rid, text=delta.text, new_ids=used, finish=finish,
                          prompt_tokens=o.prompt_tokens,
                          completion_tokens=st.completion_tokens,
                          cached_tokens=o.cached_tokens, queue_time=o.queue_time,
                          logprobs=self._with_texts(o.logprobs, len(used)),
                          input_logprobs=self._with_texts(o.input_logprobs, None))

    def _with_texts(self, lp: Logprobs | None, keep: int | None) -> Logprobs | None:
        """Trim to the ids actually used and add each token's own text (SGLang decodes
        every id alone, so a piece of a multi-byte character shows as U+FFFD)."""
        if lp is None:
            return None
        if keep is not None and keep < len(lp.token_ids):
            lp = Logprobs(lp.token_ids[:keep], lp.logprobs[:keep], lp.top_ids[:keep],
                          lp.top_logprobs[:keep])
        decode = self.tokenizer.decode
        lp.texts = [decode([t]) for t in lp.token_ids]
        lp.top_texts = [[decode([t]) for t in ids] for ids in lp.top_ids]
        return lp


def main(args: ServerArgs, addrs: Addresses, conn: Connection) -> None:
    def body(ready) -> None:
        from transformers import AutoTokenizer
        detok = Detokenizer(AutoTokenizer.from_pretrained(args.resolved_tokenizer_path))
        ctx = zmq.Context()
        inbox = Inbox(ctx, addrs.detokenizer)
        to_api = Outbox(ctx, addrs.api)
        to_scheduler = Outbox(ctx, addrs.scheduler)
        ready()
        while True:
            for batch in inbox.recv(timeout_ms=None):
                if not isinstance(batch, TokenBatch):
                    log.error("unexpected message %s", type(batch).__name__)
                    continue
                text, release = detok.process(batch)
                to_api.send(text)       # even when empty: it carries the scheduler's load
                if release:
                    to_scheduler.send(ReleaseRequest(release))
    run_child("detokenizer", args.log_level, conn, body)
