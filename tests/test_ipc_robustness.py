"""End to end: the internal sockets trust nobody, and a killed launcher leaves nothing behind.

Garbage frames and forged (well-formed, wrong) messages pushed onto each ipc socket must
leave the server serving: /health 200, every process alive, a normal /generate right, and
the KV pool back at its idle invariant. A SIGKILLed launcher takes every child with it and
its ipc directory is removed by them.

To know a process has read what we pushed, every push ends with a frame carrying an unknown
tag of its own: the receiver logs "unknown message tag N" (wire/sockets.py) after reading
all the earlier frames of that connection, which arrive in order. The normal /generate that
follows goes through the process again, so whatever handling came after the read is done.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from pathlib import Path

import httpx
import msgpack
import psutil
import pytest
import zmq

from tests.server import Server, serving, wait_idle, wait_until
from wire.codec import encode
from wire.messages import (AbortRequest, ChatMessage, ControlReply, DecodeParams,
                           FinishReason, FlushCacheRequest, GenerateRequest, LogprobRequest,
                           Logprobs, ReleaseRequest, SchedulerLoad, TextBatch, TextOutput,
                           TokenBatch, TokenizedRequest, TokenOutput)
from wire.sampling import SamplingParams

pytestmark = pytest.mark.e2e

CONTEXT = 512          # the tiny checkpoints' max_position_embeddings
VOCAB = 754            # their vocab_size
SOCKETS = ("api", "tokenizer", "scheduler", "detokenizer")
CHILDREN = ("tokenizer", "scheduler", "detokenizer")
_markers = itertools.count(900_001)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ipc")
    with serving(tiny_model("llama"), tmpdir=tmp) as s:
        (ipc_dir,) = tmp.glob("zserve-*/")
        s.ipc_dir = ipc_dir
        assert set(SOCKETS) <= {p.name for p in ipc_dir.iterdir()}
        # A first real request: the API's load snapshot then has a sequence number above
        # the 0 that forged loads below carry, so they cannot replace it.
        s.generate_ok(text="warm up", sampling_params={"max_new_tokens": 2})
        yield s


def push(server, socket: str, frames: list[bytes]) -> None:
    """PUSH frames onto one ipc socket, then wait until its owner has read them all."""
    tag = next(_markers)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(f"ipc://{server.ipc_dir / socket}")
        for frame in [*frames, msgpack.packb([tag, []])]:
            sock.send(frame)
        sock.close(linger=30_000)
    finally:
        ctx.term()                   # returns once everything was handed to the peer
    wait_until(lambda: f"unknown message tag {tag}" in server.logs(), 60,
               f"the {socket} process to read the pushed frames")


def assert_serving(server) -> None:
    for p in [psutil.Process(server.proc.pid), *(server.child(n) for n in CHILDREN)]:
        assert p.is_running() and p.status() != psutil.STATUS_ZOMBIE, p
    assert server.client.get("/health").status_code == 200
    out = server.generate_ok(text="The quick brown fox",
                             sampling_params={"max_new_tokens": 7, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 7 and len(out["output_ids"]) == 7
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    wait_idle(server)
    assert "Traceback" not in server.logs()


# ---- garbage ---------------------------------------------------------------------------------

def truncated(msg) -> bytes:
    frame = encode(msg)
    return frame[:len(frame) // 2]


GARBAGE = [
    b"",
    b"\x00",
    b"\xc1",                                          # a byte msgpack never uses
    os.urandom(64),
    os.urandom(8 << 20),                              # huge
    b"\x91" * 100_000 + b"\xc0",                      # 100k nested arrays
    b"\xdd\xff\xff\xff\xff",                          # an array "of 4 billion", then nothing
    b"\xd4\x01\x00",                                  # an ext type
    msgpack.packb({"tag": 1}),
    msgpack.packb([1]),                               # a tag without its fields
    msgpack.packb([99, []]),                          # an unknown tag
    msgpack.packb([-1, []]),
    msgpack.packb(["1", []]),
    msgpack.packb([1, 1, 2]),                         # wrong arity
    msgpack.packb([1, "r", None, None, [1] * 18, False, None, None, False]),   # wrong types
    msgpack.packb([5, [["r", [1.5], None, 0, 0, None, None, None, None]], []]),
    msgpack.packb([6, [["r", b"bytes", [], None, 0, 0, 0, None, None, None]], None]),
    truncated(GenerateRequest("r", "hello", None, SamplingParams())),
    truncated(TokenBatch([TokenOutput("r", [1, 2], None, 1, 0, None)], SchedulerLoad())),
    truncated(TextBatch([TextOutput("r", "x", [1], None)])),
]


@pytest.mark.parametrize("socket", SOCKETS)
def test_garbage_frames_leave_the_server_serving(server, socket):
    push(server, socket, GARBAGE)
    assert_serving(server)


# ---- forged messages -------------------------------------------------------------------------

def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 4, **kw})


def gen(rid, text=None, input_ids=None, **kw) -> GenerateRequest:
    return GenerateRequest(rid=rid, text=text, input_ids=input_ids,
                           sampling=kw.pop("sampling", sp()), **kw)


def tout(rid, ids, finish=None, decode=None, **kw) -> TokenOutput:
    return TokenOutput(rid=rid, new_ids=ids, finish=finish, prompt_tokens=2, cached_tokens=0,
                       queue_time=0.0, decode=decode, **kw)


LENGTH = FinishReason("length", length=1)
FORGED = {
    "tokenizer": [
        gen("f-sampling-1", "hi", sampling=sp(top_p=1.5)),
        gen("f-sampling-2", "hi", sampling=sp(temperature=math.nan)),
        gen("f-sampling-3", "hi", sampling=sp(temperature=-1.0, top_k=0)),
        gen("f-sampling-4", "hi", sampling=sp(repetition_penalty=0.0)),
        gen("f-sampling-5", "hi", sampling=sp(min_new_tokens=10**9)),
        gen("f-sampling-6", "hi", sampling=sp(max_new_tokens=2**62)),
        gen("f-sampling-7", "hi", sampling=sp(stop=["x" * 10_000] * 100)),
        gen("f-sampling-8", "hi", sampling=sp(stop_token_ids=[10**9])),
        gen("f-sampling-9", "hi", sampling=sp(logit_bias={"x": 1.0, "99999999": 2.0})),
        gen("f-ids-1", input_ids=[5, 10**6]),
        gen("f-ids-2", input_ids=[-1]),
        gen("f-ids-3", input_ids=[2**64 - 1]),
        gen("f-ids-4", input_ids=[]),
        gen("f-ids-5", input_ids=[7] * 100_000),
        gen("f-forms-1"),
        gen("f-forms-2", "hi", input_ids=[5]),
        gen("f-forms-3", messages=[]),
        gen("f-logprob-1", "hi", logprob=LogprobRequest(top_logprobs_num=10**6)),
        gen("f-logprob-2", "hi", logprob=LogprobRequest(start_len=-10)),
        gen("f-long", "x" * 5_000_000),                              # refused unread
        gen("f-chat", messages=[ChatMessage("user", "hello")], fit_context=True),   # valid
        gen("f-valid", "hello", sampling=sp(max_new_tokens=3)),      # valid: outputs dropped
        AbortRequest("f-unknown"),
        FlushCacheRequest("f-flush"),
        ReleaseRequest(["f-unknown"]),                               # not for the tokenizer
        TokenBatch([], SchedulerLoad()),
    ],
    "scheduler": [
        ReleaseRequest(["f-unknown-1", "f-unknown-2"]),
        ReleaseRequest([]),
        AbortRequest("f-unknown"),
        AbortRequest("f-unknown", abort_all=True),
        GenerateRequest("f-wrong-socket", "hi", None, sp()),
        TextBatch([TextOutput("f-x", "x", [1], None)]),
    ],
    "detokenizer": [
        TokenBatch([tout("f-no-decode", [5])], SchedulerLoad()),
        TokenBatch([tout("f-no-decode-2", [10**9], LENGTH)], SchedulerLoad()),
        TokenBatch([tout("f-oov", [5, VOCAB + 10], decode=DecodeParams())], SchedulerLoad()),
        TokenBatch([tout("f-oov-2", [-5], LENGTH, decode=DecodeParams())], SchedulerLoad()),
        TokenBatch([tout("f-oov-3", [2**64 - 1], decode=DecodeParams())], SchedulerLoad()),
        TokenBatch([tout("f-stops", [5], decode=DecodeParams(stop=["y" * 10_000] * 50))],
                   SchedulerLoad()),
        TokenBatch([tout("f-lp", [5], LENGTH, decode=DecodeParams(),
                         logprobs=Logprobs([5], [-0.5], [[1, 10**7]], [[-1.0]]))],
                   SchedulerLoad()),
        TokenBatch([tout("f-ok", [5, 6], LENGTH, decode=DecodeParams(stop=["a"]))],
                   SchedulerLoad()),
        ReleaseRequest(["f-unknown"]),                               # not for the detokenizer
    ],
    "api": [
        TextBatch([TextOutput("f-unknown", "x", [1], None),
                   TextOutput("f-unknown-2", "", [], FinishReason("abort", message="x",
                                                                  status_code=400))]),
        TextBatch([]),
        ControlReply("f-unknown", True, "", [SchedulerLoad()]),
        TokenBatch([tout("f-x", [5])], SchedulerLoad()),
        GenerateRequest("f-wrong-socket", "hi", None, sp()),
    ],
}


@pytest.mark.parametrize("socket", SOCKETS)
def test_forged_messages_leave_the_server_serving(server, socket):
    push(server, socket, [encode(m) for m in FORGED[socket]])
    assert_serving(server)


def test_forged_outputs_for_a_running_request_end_only_that_request(server):
    """A forged output with an out-of-vocab id for a request the scheduler is running: the
    detokenizer ends that request and releases it in the scheduler; others go on."""
    before = server.server_info()["generated_tokens_total"]
    push(server, "scheduler", [encode(TokenizedRequest(
        "f-running", [5, 6, 7], sp(max_new_tokens=CONTEXT - 8, ignore_eos=True)))])

    def running_or_done():
        info = server.server_info()
        return (info["running_requests"] == 1
                or info["generated_tokens_total"] >= before + CONTEXT - 8)
    wait_until(running_or_done, 60, "it to run")
    push(server, "detokenizer", [encode(TokenBatch([tout("f-running", [VOCAB])],
                                                   SchedulerLoad()))])
    assert_serving(server)


def test_forged_tokenized_requests_to_the_scheduler(server):
    """The scheduler validates what the tokenizer would have refused (defect 9: an id of
    10**6 used to crash it). Last in this module: it needs the scheduler's own checks."""
    forged = [
        TokenizedRequest("f-t-1", [5, 10**6], sp()),
        TokenizedRequest("f-t-2", [-1], sp()),
        TokenizedRequest("f-t-3", [2**64 - 1], sp()),
        TokenizedRequest("f-t-4", [], sp()),
        TokenizedRequest("f-t-5", [7] * (CONTEXT + 10), sp()),
        TokenizedRequest("f-t-6", [5], sp(max_new_tokens=2**62)),
        TokenizedRequest("f-t-7", [5], sp(top_p=1.5)),
        TokenizedRequest("f-t-8", [5], sp(temperature=math.nan)),
        TokenizedRequest("f-t-9", [5], sp(stop_token_ids=[10**9], min_new_tokens=2)),
        TokenizedRequest("f-t-10", [5], sp(), logprob=LogprobRequest(top_logprobs_num=10**6)),
        TokenizedRequest("f-t-11", [5], sp(logit_bias={"10000000": 1.0})),
    ]
    push(server, "scheduler", [encode(m) for m in forged])
    assert_serving(server)


# ---- a SIGKILLed launcher ----------------------------------------------------------------------

def alive(procs) -> list[psutil.Process]:
    """Those not exited (a zombie counts as exited: whoever adopted it may not reap it)."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def in_group(pgid: int) -> list[psutil.Process]:
    """Every process of the server's process group (it runs in its own session)."""
    group = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                group.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return group


def test_sigkilled_launcher_takes_children_and_ipc_dir_along(tiny_model, tmp_path):
    s = Server(tiny_model("llama"), tmpdir=tmp_path)
    try:
        (ipc_dir,) = tmp_path.glob("zserve-*/")
        children = [s.child(n) for n in CHILDREN]
        # The scheduler busy with a long request, the others blocked in their polls.
        body = {"text": "x", "stream": True,
                "sampling_params": {"max_new_tokens": CONTEXT - 8, "ignore_eos": True}}
        t = threading.Thread(target=_stream_until_cut, args=(s.url, body), daemon=True)
        t.start()
        wait_until(lambda: s.server_info()["running_requests"] == 1 or not t.is_alive(), 60,
                   "the request to run")
        s.proc.kill()
        s.proc.wait()
        wait_until(lambda: not alive([*children, *s.children, *in_group(s.proc.pid)]), 10,
                   "every process of the server to exit")
        wait_until(lambda: not Path(ipc_dir).exists(), 10, "the ipc directory to go")
        assert "the launcher is gone" in s.logs()
        t.join(10)
    finally:
        s.kill()


def _stream_until_cut(url: str, body: dict) -> None:
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            for _ in r.iter_bytes():
                pass
    except httpx.HTTPError:
        pass
