"""Unit tests for the wire contract: wire/codec.py, wire/messages.py, wire/schema.py,
wire/sampling.py, and the typed inboxes of wire/sockets.py.

Every message type round-trips to an equal message; anything that is not a valid frame, or
not a message for the inbox that decodes it, raises DecodeError and nothing else (DESIGN.md
section 1: never a crash)."""

from __future__ import annotations

import random
import typing

import msgpack
import msgspec
import numpy as np
import pytest
import zmq

from wire import codec
from wire import messages as m
from wire.codec import TAGS, DecodeError, decode, encode
from wire.sampling import SamplingParams
from wire.schema import WireStruct, field
from wire.sockets import Inbox, Outbox

FULL_SAMPLING = SamplingParams(
    max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
    frequency_penalty=-1.5, presence_penalty=2.0, repetition_penalty=1.2, min_new_tokens=3,
    stop=["\n", "END", "停止", "🛑"], stop_token_ids=[2, 0, 128001], ignore_eos=True,
    skip_special_tokens=False, spaces_between_special_tokens=False, no_stop_trim=True, n=3,
    sampling_seed=2**63 - 1, logit_bias={"11": 5.0, "0": -1.5},
    json_schema='{"type":"object","properties":{"停止":{"enum":["🛑"]}}}')

UNICODE = "héllo 你好 😀🎉 👍🏽 \x00 tab\t newline\n 𝄞"

LOAD = m.SchedulerLoad(running=3, queued=4, kv_total=1000, kv_free=500, kv_evictable=25,
                       prompt_tokens_total=12345, generated_tokens_total=2**40)


def _token_output(**kw) -> m.TokenOutput:
    base = dict(rid="r", new_ids=[5], finish=None, prompt_tokens=3, cached_tokens=0,
                queue_time=None, decode=None)
    base.update(kw)
    return m.TokenOutput(**base)


# One list per message type: defaults, None vs set optionals, nested types, empty lists.
SAMPLES: dict[type, list] = {
    m.GenerateRequest: [
        m.GenerateRequest(rid="a", text="hi", input_ids=None, sampling=SamplingParams()),
        m.GenerateRequest(rid=UNICODE, text=UNICODE, input_ids=None, sampling=FULL_SAMPLING,
                          stream=True),
        m.GenerateRequest(rid="b", text=None, input_ids=[1, 2, 3], sampling=SamplingParams(),
                          api=2),
        m.GenerateRequest(rid="", text="", input_ids=[], sampling=SamplingParams(
            sampling_seed=-(2**63), logit_bias={})),
    ],
    m.AbortRequest: [
        m.AbortRequest(rid="x"),
        m.AbortRequest(rid="", abort_all=True, message="bye ✋"),
    ],
    m.TokenizedRequest: [
        m.TokenizedRequest(rid="t", input_ids=[0, 1, 2**31], sampling=FULL_SAMPLING,
                           stream=True),
        m.TokenizedRequest(rid="t2", input_ids=[], sampling=SamplingParams(), api=1),
    ],
    m.ReleaseRequest: [
        m.ReleaseRequest(rids=[]),
        m.ReleaseRequest(rids=["a", UNICODE, ""]),
    ],
    m.TokenBatch: [
        m.TokenBatch(outputs=[], load=m.SchedulerLoad()),
        m.TokenBatch(outputs=[
            _token_output(),
            _token_output(rid="len", new_ids=[], finish=m.FinishReason("length", length=7),
                          queue_time=0.25, decode=m.DecodeParams()),
            _token_output(rid="eos", finish=m.FinishReason("stop", matched_token=2),
                          cached_tokens=2, queue_time=0.0,
                          decode=m.DecodeParams(skip_special_tokens=False,
                                                spaces_between_special_tokens=False,
                                                stop=["a", UNICODE], no_stop_trim=True)),
            _token_output(rid="str", finish=m.FinishReason("stop", matched_str="###")),
            _token_output(rid="ab", finish=m.FinishReason("abort", message=UNICODE,
                                                          status_code=400)),
            _token_output(rid="ab2", finish=m.FinishReason("abort", message="gone")),
        ], load=LOAD),
    ],
    m.TextBatch: [
        m.TextBatch(outputs=[]),
        m.TextBatch(outputs=[
            m.TextOutput(rid="a", text="", new_ids=[], finish=None),
            m.TextOutput(rid="b", text=UNICODE, new_ids=[1, 2], finish=m.FinishReason(
                "stop", matched_str="\n"), prompt_tokens=4, completion_tokens=9,
                cached_tokens=2, queue_time=1.5),
            m.TextOutput(rid="c", text="x", new_ids=[3], finish=m.FinishReason(
                "abort", message="too long", status_code=400)),
        ], load=LOAD),
        m.TextBatch(outputs=[], load=m.SchedulerLoad()),
    ],
    m.FlushCacheRequest: [m.FlushCacheRequest(req_id="f1"),
                          m.FlushCacheRequest(req_id="f2", api=3)],
    m.LoraRequest: [m.LoraRequest(req_id="l1", op="load", name="sql", path="/a/b"),
                    m.LoraRequest(req_id="l2", op="unload", name=UNICODE, api=2)],
    m.ControlReply: [
        m.ControlReply(req_id="f1", ok=True, message="Cache flushed.", loads=[LOAD]),
        m.ControlReply(req_id="", ok=False, message=UNICODE, loads=[m.SchedulerLoad(),
                       m.SchedulerLoad(replica=1, requests_total=9)], api=1),
    ],
    m.PeerAbort: [m.PeerAbort(req_id="p", from_api=1, rid=UNICODE, prefix=True, message="x")],
    m.PeerAbortReply: [m.PeerAbortReply(req_id="p", count=0)],
    m.ApiControl: [m.ApiControl(kind="lost", message="The scheduler died."),
                   m.ApiControl(kind="drain")],
    m.TPInit: [m.TPInit(pool_size=32768, table_rows=64, table_cols=512)],
    m.StepPlan: [
        m.StepPlan(ids=[1, 2, 3], positions=[0, 1, 2], out_slots=[7, 8, 9], decode_rows=[],
                   decode_lens=[], prefills=[[0, 0, 3]],
                   table_writes=[m.TableWrite(row=0, start=0, slots=[7, 8, 9])],
                   score_ranges=[[0, 2]], sample_rows=[2]),
        m.StepPlan(ids=[], positions=[], out_slots=[], decode_rows=[], decode_lens=[],
                   prefills=[], table_writes=[], score_ranges=[], sample_rows=[], stop=True),
    ],
    m.NodeHello: [m.NodeHello(node_rank=1, nnodes=2, tp_size=4, dtype="float32",
                              context_length=2048, model="LlamaForCausalLM 135M", version="x")],
    m.NodeReply: [m.NodeReply(ok=False, message=UNICODE)],
    m.NodeBye: [m.NodeBye(reason=""), m.NodeBye(reason="the scheduler died", exit_code=1)],
    m.ReplicaStatus: [m.ReplicaStatus(load=LOAD, received=12),
                      m.ReplicaStatus(load=m.SchedulerLoad(replica=3, queued_tokens=80,
                                                           running_tokens=1000), received=0)],
}

ALL_SAMPLES = [msg for msgs in SAMPLES.values() for msg in msgs]
VALID_FRAMES = [encode(msg) for msg in ALL_SAMPLES]


def _frame(tag, fields) -> bytes:
    return msgpack.packb([tag, *fields], use_bin_type=True)


def _fields(msg) -> list:
    """The plain field values of a message, as the codec puts them on the wire (after the
    tag)."""
    tag, *fields = msgpack.unpackb(encode(msg), raw=False)
    assert tag == TAGS[type(msg)]
    return fields


def _decode_error(frame: bytes) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode(frame)
    assert type(info.value) is DecodeError
    return info.value


# ---- round trips -------------------------------------------------------------------------

def test_samples_cover_every_tagged_message():
    assert set(SAMPLES) == set(TAGS)


def test_tags_are_pinned_and_unique():
    # Tags are part of the protocol: append, never renumber.
    assert {cls.__name__: tag for cls, tag in TAGS.items()} == {
        "GenerateRequest": 1, "AbortRequest": 2, "TokenizedRequest": 3, "ReleaseRequest": 4,
        "TokenBatch": 5, "TextBatch": 6, "FlushCacheRequest": 7, "ControlReply": 8,
        "ReplicaStatus": 9, "PeerAbort": 10, "PeerAbortReply": 11, "ApiControl": 12,
        "TPInit": 13, "StepPlan": 14, "NodeHello": 15, "NodeReply": 16, "NodeBye": 17,
        "LoraRequest": 18}


@pytest.mark.parametrize("msg", ALL_SAMPLES, ids=lambda msg: type(msg).__name__)
def test_round_trip_is_equal(msg):
    frame = encode(msg)
    assert isinstance(frame, bytes)
    tag, *fields = msgpack.unpackb(frame, raw=False)     # [tag, field values...]
    assert tag == TAGS[type(msg)]
    assert len(fields) == len(msg.__struct_fields__)
    out = decode(frame)
    assert type(out) is type(msg)
    assert out == msg
    assert encode(out) == frame


def test_round_trip_keeps_nested_types_and_optionals():
    batch = decode(encode(SAMPLES[m.TokenBatch][1]))
    first, length, eos, stop_str, abort, abort2 = batch.outputs
    assert first.finish is None and first.decode is None and first.queue_time is None
    assert type(length.finish) is m.FinishReason and length.finish.length == 7
    assert length.finish.matched_token is None and length.finish.status_code is None
    assert type(length.decode) is m.DecodeParams and length.decode == m.DecodeParams()
    assert eos.finish.matched_token == 2 and eos.finish.matched_str is None
    assert eos.decode.stop == ["a", UNICODE] and eos.decode.no_stop_trim is True
    assert type(eos.queue_time) is float and eos.queue_time == 0.0
    assert stop_str.finish.matched_str == "###"
    assert abort.finish.status_code == 400 and abort.finish.message == UNICODE
    assert abort2.finish.status_code is None
    assert type(batch.load) is m.SchedulerLoad and batch.load == LOAD

    req = decode(encode(SAMPLES[m.GenerateRequest][1]))
    assert type(req.sampling) is SamplingParams and req.sampling == FULL_SAMPLING
    assert req.input_ids is None and req.text == UNICODE
    assert req.sampling.logit_bias == {"11": 5.0, "0": -1.5}
    assert req.sampling.sampling_seed == 2**63 - 1

    text = decode(encode(SAMPLES[m.TextBatch][0]))
    assert text.load is None and text.outputs == []


def test_decoded_lists_are_fresh_objects():
    msg = m.ReleaseRequest(rids=["a"])
    out = decode(encode(msg))
    out.rids.append("b")
    assert msg.rids == ["a"]


def test_int_is_accepted_for_a_float_field_and_becomes_float():
    fields = _fields(SAMPLES[m.TextBatch][1])
    fields[0][1][7] = 3                     # TextOutput.queue_time: float | None
    sampling = _fields(SAMPLES[m.GenerateRequest][0])
    sampling[3][1] = 0                      # SamplingParams.temperature
    sampling[3][17] = {"5": 2}              # logit_bias values: float
    out = decode(_frame(TAGS[m.TextBatch], fields))
    assert type(out.outputs[1].queue_time) is float and out.outputs[1].queue_time == 3.0
    req = decode(_frame(TAGS[m.GenerateRequest], sampling))
    assert type(req.sampling.temperature) is float and req.sampling.temperature == 0.0
    assert type(req.sampling.logit_bias["5"]) is float and req.sampling.logit_bias == {"5": 2.0}
    assert req.sampling.is_greedy


@pytest.mark.parametrize("not_a_message", [
    {"rid": "a"}, ["a"], None, 5, "GenerateRequest", b"\x93\x01",
    SamplingParams(), m.FinishReason("length", length=1), m.SchedulerLoad(),
    m.DecodeParams(), m.TextOutput(rid="a", text="", new_ids=[], finish=None),
])
def test_encode_refuses_a_non_message(not_a_message):
    with pytest.raises(TypeError, match="not a wire message"):
        encode(not_a_message)


def test_encode_refuses_a_subclass_of_a_message():
    class Sneaky(m.AbortRequest):
        pass

    with pytest.raises(TypeError):
        encode(Sneaky(rid="a"))


# ---- decode errors -----------------------------------------------------------------------

@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x92", b"\x92\x01", b"\xd9\x05ab", b"\xa2\xff\xfe",
    msgpack.packb([1, ["a"]]) + b"\x00",          # trailing data
    _frame(2, [b"\xff\xfe", False, "m"]),          # bin where str expected
], ids=["empty", "reserved-byte", "short-array", "truncated", "truncated-str", "bad-utf8",
        "trailing", "bin-for-str"])
def test_bad_bytes_raise_decode_error(frame):
    _decode_error(frame)


_ABORT = _fields(m.AbortRequest("a"))


@pytest.mark.parametrize("obj", [
    5, "x", None, {}, {"1": []}, [], [1], [2], ["2", *_ABORT], [2.0, *_ABORT],
    [True, *_ABORT], [None, *_ABORT], [[2], *_ABORT], [2, _ABORT],  # the last: [tag, [fields]]
    {"type": 2, "rid": "a", "abort_all": False, "message": "m"},
])
def test_frame_that_is_not_tag_and_fields(obj):
    _decode_error(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("tag", [0, max(TAGS.values()) + 1, 99, -1, 2**63])
def test_unknown_tag(tag):
    err = _decode_error(_frame(tag, _fields(m.AbortRequest("a"))))
    assert "unknown message tag" in str(err)


@pytest.mark.parametrize("msg", ALL_SAMPLES[::2], ids=lambda msg: type(msg).__name__)
def test_wrong_number_of_fields(msg):
    fields = _fields(msg)
    tag = TAGS[type(msg)]
    _decode_error(_frame(tag, fields[:-1]))
    _decode_error(_frame(tag, fields + [None]))
    _decode_error(_frame(tag, []))


def test_fields_must_be_an_array_not_a_map():
    _decode_error(msgpack.packb([TAGS[m.AbortRequest], {"rid": "a", "abort_all": False,
                                                        "message": "m"}]))
    gen = _fields(SAMPLES[m.GenerateRequest][0])
    gen[3] = dict(zip(SamplingParams.__struct_fields__, gen[3]))     # a nested struct as a map
    _decode_error(_frame(TAGS[m.GenerateRequest], gen))


def test_wrong_scalar_types():
    tok = _fields(SAMPLES[m.TokenizedRequest][0])      # [rid, input_ids, sampling, stream]
    tag = TAGS[m.TokenizedRequest]
    cases = {
        "str for int": (1, ["1", 2]),
        "True for int": (1, [True, 2]),
        "float for int": (1, [1.0, 2]),
        "int for str": (0, 5),
        "None for str": (0, None),
        "int for bool": (3, 1),
        "None for bool": (3, None),
        "str for list": (1, "abc"),
        "int for list": (1, 7),
        "map for list": (1, {"0": 1}),
        "None for list": (1, None),
        "list for nested dataclass": (2, []),
        "str for nested dataclass": (2, "sampling"),
    }
    for name, (index, value) in cases.items():
        bad = list(tok)
        bad[index] = value
        err = _decode_error(_frame(tag, bad))
        assert "TokenizedRequest" in str(err), name


def test_wrong_types_inside_nested_sampling_params():
    tag = TAGS[m.TokenizedRequest]
    for index, value in [(0, True), (0, 1.5), (0, "7"), (1, "0.5"), (1, True), (1, None),
                         (3, 2.0), (9, "stop"), (9, [1]), (10, [True]), (11, 0),
                         (16, 1.0), (16, True), (17, []), (17, {"1": "x"}), (17, {"1": True})]:
        fields = _fields(SAMPLES[m.TokenizedRequest][1])
        fields[2][index] = value
        err = _decode_error(_frame(tag, fields))
        assert "sampling" in str(err), (index, value)


def test_true_and_float_are_rejected_for_optional_ints():
    load_fields = _fields(SAMPLES[m.TokenBatch][1])
    tag = TAGS[m.TokenBatch]
    for value in (True, False, 1.0, "1"):
        bad = [list(load_fields[0]), list(load_fields[1])]
        out = list(bad[0][1])                       # the "len" TokenOutput
        finish = list(out[2])
        finish[1] = value                           # FinishReason.length: int | None
        out[2] = finish
        bad[0][1] = out
        _decode_error(_frame(tag, bad))
    for value in (True, 1.0):
        bad = list(load_fields)
        bad[1] = list(bad[1])
        bad[1][0] = value                           # SchedulerLoad.running: int
        _decode_error(_frame(tag, bad))


def test_bool_is_not_accepted_for_float():
    fields = _fields(SAMPLES[m.TextBatch][1])
    fields[0][1][7] = True                          # queue_time: float | None
    _decode_error(_frame(TAGS[m.TextBatch], fields))


def test_dict_with_non_str_keys():
    fields = _fields(SAMPLES[m.GenerateRequest][0])
    fields[3][17] = {1: 2.0}                        # int key
    _decode_error(_frame(TAGS[m.GenerateRequest], fields))
    fields[3][17] = {b"1": 2.0}                     # bin key: the codec's own check rejects
    _decode_error(_frame(TAGS[m.GenerateRequest], fields))
    fields[3][17] = [["1", 2.0]]                    # array where a map is expected
    _decode_error(_frame(TAGS[m.GenerateRequest], fields))


def test_nested_dataclass_with_wrong_arity():
    gen = _fields(SAMPLES[m.GenerateRequest][0])
    for sampling in (gen[3][:-1], gen[3] + [None], []):
        bad = list(gen)
        bad[3] = sampling
        _decode_error(_frame(TAGS[m.GenerateRequest], bad))

    batch = _fields(SAMPLES[m.TokenBatch][1])
    for path in ("finish", "decode", "load", "output"):
        bad = msgpack.unpackb(msgpack.packb(batch), raw=False)     # deep copy
        if path == "finish":
            bad[0][1][2] = bad[0][1][2][:3]
        elif path == "decode":
            bad[0][1][6] = bad[0][1][6] + [False]
        elif path == "load":
            bad[1] = bad[1][:-1]
        else:
            bad[0][0] = bad[0][0][:-1]
        _decode_error(_frame(TAGS[m.TokenBatch], bad))


def test_decode_error_names_the_path():
    fields = _fields(SAMPLES[m.TokenBatch][1])
    fields[0][1][1] = [1, "x"]                      # outputs[1].new_ids[1]
    err = _decode_error(_frame(TAGS[m.TokenBatch], fields))
    assert "TokenBatch.outputs[1].new_ids[1]" in str(err)


def test_decode_error_is_a_value_error():
    assert issubclass(DecodeError, ValueError)


# ---- fuzz --------------------------------------------------------------------------------

def _decode_or_decode_error(frame: bytes) -> None:
    try:
        msg = decode(frame)
    except DecodeError:
        return
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"decode({frame!r}) raised {type(e).__name__}: {e}")
    assert type(msg) in TAGS
    assert decode(encode(msg)) == msg or _has_nan(msg)


def _has_nan(msg) -> bool:
    def walk(v):
        if isinstance(v, float):
            return v != v
        if isinstance(v, WireStruct):
            return any(walk(x) for x in msgspec.structs.astuple(v))
        if isinstance(v, list):
            return any(walk(x) for x in v)
        if isinstance(v, dict):
            return any(walk(x) for x in v.values())
        return False
    return walk(msg)


def test_fuzz_random_bytes():
    rng = random.Random(1234)
    for _ in range(2000):
        n = rng.randrange(0, 64)
        prefix = bytes([rng.choice([0x92, 0x93, 0x91, 0xdc, 0xde])]) if rng.random() < 0.5 else b""
        _decode_or_decode_error(prefix + rng.randbytes(n))


def test_fuzz_mutated_valid_frames():
    rng = random.Random(5678)
    for i in range(2000):
        frame = bytearray(VALID_FRAMES[i % len(VALID_FRAMES)])
        op = rng.randrange(4)
        if op == 0:                                   # flip a few bytes
            for _ in range(rng.randrange(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
        elif op == 1:                                 # truncate
            del frame[rng.randrange(len(frame)):]
        elif op == 2:                                 # insert random bytes
            at = rng.randrange(len(frame) + 1)
            frame[at:at] = rng.randbytes(rng.randrange(1, 6))
        else:                                         # delete a span
            at = rng.randrange(len(frame))
            del frame[at:at + rng.randrange(1, 6)]
        _decode_or_decode_error(bytes(frame))


def test_fuzz_well_formed_msgpack_with_wrong_shapes():
    """Structurally valid msgpack, random values swapped into valid field arrays."""
    rng = random.Random(91011)
    junk = [None, True, False, 0, -1, 2**63, 1.5, float("nan"), "", "s", b"b", [], [1],
            ["s"], {}, {"k": 1}, {"k": "v"}, [[]], [None] * 7, msgpack.ExtType(5, b"x")]

    def mutate(v, depth=0):
        if isinstance(v, list) and v and rng.random() < 0.7:
            v = list(v)
            i = rng.randrange(len(v))
            v[i] = mutate(v[i], depth + 1)
            return v
        return rng.choice(junk)

    for i in range(1000):
        msg = ALL_SAMPLES[i % len(ALL_SAMPLES)]
        fields = mutate(_fields(msg))
        frame = _frame(TAGS[type(msg)], fields if isinstance(fields, list) else [fields])
        _decode_or_decode_error(frame)


# ---- one decoder per inbox -------------------------------------------------------------------

# Who receives what (DESIGN.md section 1). Pinned here so that a change is a decision.
RECEIVERS = {
    codec.TOKENIZER_INBOX: {m.GenerateRequest, m.AbortRequest, m.FlushCacheRequest,
                            m.LoraRequest},
    codec.SCHEDULER_INBOX: {m.TokenizedRequest, m.AbortRequest, m.FlushCacheRequest,
                            m.LoraRequest, m.ReleaseRequest},
    codec.DETOKENIZER_INBOX: {m.TokenBatch},
    codec.API_INBOX: {m.TextBatch, m.ControlReply, m.PeerAbort, m.PeerAbortReply,
                      m.ApiControl},
    codec.NODE_LINK: {m.NodeHello, m.NodeReply, m.NodeBye},
    codec.TP_FOLLOWER: {m.TPInit, m.StepPlan},
    codec.DP_CONTROLLER_INBOX: {m.TokenizedRequest, m.AbortRequest, m.FlushCacheRequest,
                                m.LoraRequest, m.ReleaseRequest, m.ReplicaStatus,
                                m.ControlReply},
}


def test_inboxes_are_pinned_and_every_message_has_a_receiver():
    for inbox, receives in RECEIVERS.items():
        assert inbox.accepts == receives, inbox.name
    assert set().union(*RECEIVERS.values()) == set(TAGS) == codec.ANY_MESSAGE.accepts


@pytest.mark.parametrize("inbox", RECEIVERS, ids=lambda inbox: inbox.name)
@pytest.mark.parametrize("msg", ALL_SAMPLES, ids=lambda msg: type(msg).__name__)
def test_a_message_for_another_inbox_is_a_decode_error(inbox, msg):
    frame = encode(msg)
    if type(msg) in RECEIVERS[inbox]:
        assert decode(frame, inbox) == msg
        assert inbox.decode(frame) == msg
    else:
        with pytest.raises(DecodeError, match=f"a {type(msg).__name__} \\(tag "
                                              f"{TAGS[type(msg)]}\\) is not for the "
                                              f"{inbox.name} inbox"):
            inbox.decode(frame)


@pytest.mark.parametrize("inbox", RECEIVERS, ids=lambda inbox: inbox.name)
def test_every_inbox_reports_unknown_tags_and_garbage(inbox):
    assert "unknown message tag 900001" in str(_inbox_error(inbox, msgpack.packb([900001, []])))
    assert "not msgpack" in str(_inbox_error(inbox, b"\xc1"))
    assert "frame is not [tag, fields...]" in str(_inbox_error(inbox, msgpack.packb(["1"])))


def _inbox_error(inbox, frame) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        inbox.decode(frame)
    return info.value


def test_an_inbox_socket_yields_only_its_messages():
    ctx = zmq.Context()
    try:
        inbox = Inbox(ctx, "inproc://test-wire-inbox", codec.SCHEDULER_INBOX)
        outbox = Outbox(ctx, "inproc://test-wire-inbox")
        sent = [m.AbortRequest("a"), m.TextBatch([]), m.ReleaseRequest(["b"]),
                m.GenerateRequest("g", "hi", None, SamplingParams()), m.FlushCacheRequest("f")]
        for msg in sent:
            outbox.send(msg)
        outbox.send_frame(b"\xc1")
        got = []
        while len(got) + inbox.bad_frames < len(sent) + 1:
            got += inbox.recv(timeout_ms=5000)
        assert got == [sent[0], sent[2], sent[4]]
        assert inbox.bad_frames == 3
        inbox.sock.close()
        outbox.sock.close()
    finally:
        ctx.term()


def test_an_outbox_to_several_workers_hands_them_messages_in_turn():
    """--tokenizer-worker-num: the API's one PUSH connected to every worker's inbox is the
    load balancer (ZeroMQ round-robins a PUSH socket's messages over its peers)."""
    ctx = zmq.Context()
    try:
        addresses = [f"inproc://test-wire-worker-{i}" for i in range(3)]
        inboxes = [Inbox(ctx, a, codec.TOKENIZER_INBOX) for a in addresses]
        outbox = Outbox(ctx, addresses)
        for i in range(6):
            outbox.send(m.AbortRequest(f"r{i}"))
        got = [[] for _ in inboxes]
        for _ in range(100):                  # inproc delivers at once; this bounds a hang
            for inbox, msgs in zip(inboxes, got):
                msgs += inbox.recv(timeout_ms=50)
            if sum(map(len, got)) == 6:
                break
        assert sorted(len(msgs) for msgs in got) == [2, 2, 2]
        assert sorted(msg.rid for msgs in got for msg in msgs) == [f"r{i}" for i in range(6)]
        for sock in [outbox.sock, *(inbox.sock for inbox in inboxes)]:
            sock.close()
    finally:
        ctx.term()


# ---- field checks, field by field ------------------------------------------------------------

def _optional(tp) -> bool:
    return type(None) in typing.get_args(tp)


def _inner(tp):
    """X for `X | None`; tp otherwise."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if _optional(tp) and len(args) == 1 else tp


def _is_struct(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, WireStruct)


def _slots(tp, values, path=()):
    """(path, annotation) of every field of every struct on the wire in a sample's fields,
    nested ones included (the first element of a list of structs)."""
    for i, f in enumerate(msgspec.structs.fields(tp)):
        yield path + (i,), f.type
        inner, value = _inner(f.type), values[i]
        if _is_struct(inner) and isinstance(value, list):
            yield from _slots(inner, value, path + (i,))
        elif typing.get_origin(inner) is list and value and _is_struct(typing.get_args(inner)[0]):
            yield from _slots(typing.get_args(inner)[0], value[0], path + (i, 0))


def _with(msg, path, value) -> bytes:
    fields = msgpack.unpackb(msgpack.packb(_fields(msg)), raw=False)      # a deep copy
    target = fields
    for i in path[:-1]:
        target = target[i]
    target[path[-1]] = value
    return _frame(TAGS[type(msg)], fields)


def _every_slot():
    for msg in ALL_SAMPLES:
        for path, tp in _slots(type(msg), _fields(msg)):
            yield msg, path, tp


def test_the_field_walk_covers_every_wire_type():
    seen = {type(msg) for msg in ALL_SAMPLES}
    for msg, path, tp in _every_slot():
        inner = _inner(tp)
        if typing.get_origin(inner) is list:
            inner = typing.get_args(inner)[0]
        if _is_struct(inner):
            seen.add(inner)
    assert {m.FinishReason, m.DecodeParams, m.SchedulerLoad, m.TokenOutput, m.TextOutput,
            SamplingParams} <= seen


def test_none_is_accepted_only_where_the_annotation_is_optional():
    checked = 0
    for msg, path, tp in _every_slot():
        frame = _with(msg, path, None)
        if _optional(tp):
            decode(frame)
        else:
            _decode_error(frame)
        checked += 1
    assert checked > 150


def test_bool_is_never_an_int_or_a_float_and_a_float_never_an_int():
    for msg, path, tp in _every_slot():
        inner = _inner(tp)
        if inner in (int, float):
            _decode_error(_with(msg, path, True))
            _decode_error(_with(msg, path, False))
        if inner is int:
            _decode_error(_with(msg, path, 1.0))
            _decode_error(_with(msg, path, "1"))


def test_an_int_is_accepted_for_every_float_field_and_becomes_a_float():
    floats = 0
    for msg, path, tp in _every_slot():
        if _inner(tp) is float:
            out = decode(_with(msg, path, 3))
            value = out
            for i in path:
                value = value[i] if isinstance(value, list) else msgspec.structs.astuple(value)[i]
            assert type(value) is float and value == 3.0
            floats += 1
    assert floats >= 10


def test_a_short_array_does_not_fill_in_defaults():
    # Every field of AbortRequest but rid has a default: a missing field is still an error.
    assert "AbortRequest" in str(_decode_error(msgpack.packb([TAGS[m.AbortRequest], "a"])))
    gen = _fields(SAMPLES[m.GenerateRequest][0])
    err = _decode_error(_frame(TAGS[m.GenerateRequest], [*gen[:3], gen[3][:-1], *gen[4:]]))
    assert "GenerateRequest.sampling" in str(err)


def test_post_init_errors_are_decode_errors():
    class Checked(WireStruct, tag=99):
        value: int

        def __post_init__(self):
            if self.value < 0:
                raise ValueError("negative")
            if self.value == 0:
                raise KeyError("zero")

    inbox = codec.InboxDecoder("test", Checked)
    assert inbox.decode(msgpack.packb([99, 1])) == Checked(1)
    assert "negative" in str(_inbox_error(inbox, msgpack.packb([99, -1])))
    assert "KeyError" in str(_inbox_error(inbox, msgpack.packb([99, 0])))


# ---- building and copying messages ---------------------------------------------------------

def test_constructors_keep_their_defaults():
    assert m.AbortRequest("a") == m.AbortRequest(rid="a", abort_all=False,
                                                 message="Aborted by the client.")
    assert m.Logprobs([1], [None]).top_ids == []
    assert m.Logprobs().token_ids is not m.Logprobs().token_ids      # fresh mutable defaults
    assert SamplingParams().stop is not SamplingParams().stop
    assert SamplingParams(n=2, stop=["x"]).n == 2
    with pytest.raises(TypeError):
        m.AbortRequest()                                             # rid is required
    with pytest.raises(TypeError):
        m.AbortRequest("a", bogus=1)
    with pytest.raises(TypeError):
        m.AbortRequest("a", False, "m", 4)


def test_wire_types_refuse_bad_declarations():
    with pytest.raises(TypeError, match="cannot follow"):
        class _Order(WireStruct):
            a: int = 0
            b: int
    with pytest.raises(TypeError, match="default_factory"):
        class _Mutable(WireStruct):
            a: list[int] = [1]
    with pytest.raises(TypeError, match="renamed"):
        class _Renamed(WireStruct):
            a: int = field(default=0, name="b")

    class Fine(WireStruct):
        a: list[int] = []     
        b: dict[str, int] = field(default_factory=dict)
    assert Fine().a == [] and Fine().a is not Fine().a and Fine().b == {}


def test_replace_copies_with_changes():
    req = SAMPLES[m.GenerateRequest][1]
    out = m.replace(req, rid="other")
    assert type(out) is m.GenerateRequest and out.rid == "other" and out.text == req.text
    assert req.rid == UNICODE                                        # the original is untouched
    s = m.replace(FULL_SAMPLING, n=1, max_new_tokens=0)
    assert (s.n, s.max_new_tokens, s.stop) == (1, 0, FULL_SAMPLING.stop)
    with pytest.raises(TypeError):
        m.replace(req, bogus=1)


def test_encode_errors_the_api_turns_into_400s():
    with pytest.raises(OverflowError):
        encode(m.TokenizedRequest("r", [2**64], SamplingParams()))
    with pytest.raises(UnicodeEncodeError):
        encode(m.AbortRequest("\ud800"))
    with pytest.raises(TypeError):
        encode(m.AbortRequest(object()))


def test_encode_takes_subclasses_of_plain_values():
    out = m.TextOutput(rid="a", text="", new_ids=[], finish=None, queue_time=np.float64(0.5))
    (back,) = decode(encode(m.TextBatch([out]))).outputs
    assert type(back.queue_time) is float and back.queue_time == 0.5
    with pytest.raises(TypeError):
        encode(m.TokenizedRequest("r", [np.int64(1)], SamplingParams()))   # as msgpack did


# ---- FinishReason.to_json ----------------------------------------------------------------

def test_finish_reason_to_json_shapes():
    assert m.FinishReason("length", length=16).to_json() == {"type": "length", "length": 16}
    assert m.FinishReason("stop", matched_token=2).to_json() == {"type": "stop", "matched": 2}
    assert m.FinishReason("stop", matched_token=0).to_json() == {"type": "stop", "matched": 0}
    assert m.FinishReason("stop", matched_str="###").to_json() == {"type": "stop",
                                                                   "matched": "###"}
    # A stop string that matched wins over a token id, as in SGLang's FINISH_MATCHED_STR.
    assert m.FinishReason("stop", matched_token=5, matched_str="\n").to_json() == {
        "type": "stop", "matched": "\n"}
    assert m.FinishReason("abort", message="gone").to_json() == {"type": "abort",
                                                                 "message": "gone"}
    assert m.FinishReason("abort", message="too long", status_code=400).to_json() == {
        "type": "abort", "message": "too long", "status_code": 400}


def test_finish_reason_to_json_survives_the_wire():
    for reason in (m.FinishReason("length", length=3), m.FinishReason("stop", matched_str="é"),
                   m.FinishReason("abort", message="x", status_code=503)):
        batch = m.TextBatch(outputs=[m.TextOutput(rid="r", text="", new_ids=[],
                                                  finish=reason)])
        assert decode(encode(batch)).outputs[0].finish.to_json() == reason.to_json()
