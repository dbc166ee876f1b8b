"""Unit tests for tokenization/prompts.py and tokenizer_proc/process.py: the prompt-length
bound, the validation of every GenerateRequest the tokenizer receives, and the per-message
error handling (no sockets)."""

from __future__ import annotations

import json
import math
import random
import unicodedata

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from checkpoints.tiny import CORPUS
from tokenization.hf_tokenizer import HFTokenizer
from tokenization.prompts import Tokenizer, chars_per_token_bound
from tokenizer_proc.process import SCHEDULER, Worker
from wire.codec import decode
from wire.messages import (AbortRequest, ChatMessage, FlushCacheRequest, GenerateRequest,
                           LogprobRequest, ReleaseRequest, TextBatch, TokenizedRequest)
from wire.sampling import SamplingParams

CONTEXT = 64


def vocab_size(path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_path(request, tiny_model):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def tokenizer(tiny_path) -> Tokenizer:
    return Tokenizer(str(tiny_path), vocab_size(tiny_path), CONTEXT)


def gen(rid="r", text=None, input_ids=None, messages=None, **kw) -> GenerateRequest:
    sampling = kw.pop("sampling", None) or SamplingParams(max_new_tokens=0)
    return GenerateRequest(rid=rid, text=text, input_ids=input_ids, sampling=sampling,
                           messages=messages, **kw)


def dense_token(tok) -> str:
    """The text of the token standing for the most characters that encodes, repeated k
    times, as exactly k tokens: the densest text there is."""
    best = ""
    for i in range(len(tok)):
        s = tok.decode([i])
        if len(s) > len(best) and all(
                len(tok.encode(s * k, add_special_tokens=False)) == k for k in (1, 2, 7)):
            best = s
    return best


# ---- the bound ---------------------------------------------------------------------------------

def test_bound_of_the_tiny_tokenizers(tokenizer):
    """Byte-level BPE: the longest vocabulary string (in bytes), times 4 under NFC (what
    transformers' Qwen2Tokenizer adds), as Llama's and Qwen2's real tokenizers are built."""
    spec = json.loads(tokenizer.tok.backend_tokenizer.to_str())
    longest = max(len(p) for p in [*spec["model"]["vocab"],
                                   *(a["content"] for a in spec["added_tokens"])])
    shrink = {None: 1, "NFC": 4}[(spec["normalizer"] or {}).get("type")]
    assert chars_per_token_bound(tokenizer.tok) == shrink * longest
    assert tokenizer.max_text_chars == shrink * longest * CONTEXT


def test_bound_holds_on_dense_and_random_text(tokenizer):
    tok, bound = tokenizer.tok, chars_per_token_bound(tokenizer.tok)
    rng = random.Random(0)
    alphabet = CORPUS + "".join(chr(c) for c in rng.sample(range(0x20, 0x30000), 300)
                                if not 0xD800 <= c < 0xE000)         # no surrogates on the wire
    texts = [dense_token(tok) * 50, "<|im_start|><|im_end|>" * 40, " " * 3000, "a" * 3000]
    for _ in range(300):
        start = rng.randrange(len(CORPUS))
        texts.append(CORPUS[start:start + rng.randrange(1, 600)])
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 200))))
    for t in texts:
        assert len(tok.encode(t)) >= len(t) / bound, t[:80]


def test_text_over_the_bound_is_refused_without_tokenizing(tokenizer, monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("tokenized a text the bound refuses")
    monkeypatch.setattr(tokenizer.tok, "encode", boom)
    text = "x" * (int(tokenizer.max_text_chars) + 1)
    with pytest.raises(ValueError) as e:
        tokenizer.tokenize(gen(text=text))
    assert str(e.value) == (f"The input (more than {CONTEXT} tokens) is longer than the "
                            f"model's context length ({CONTEXT} tokens).")
    messages = [ChatMessage("user", text[:len(text) // 2]), ChatMessage("user", text)]
    with pytest.raises(ValueError, match=f"more than {CONTEXT} tokens"):
        tokenizer.tokenize(gen(messages=messages))


def test_densest_prompt_just_under_the_context_is_accepted(tokenizer):
    """The bound never refuses a prompt that fits: the densest text of CONTEXT - 1 tokens
    (with <s>) passes, one token more gets the exact count."""
    tok = tokenizer.tok
    dense = dense_token(tok)
    fits = dense * (CONTEXT - 2)
    assert len(tok.encode(fits)) == CONTEXT - 1
    out = tokenizer.tokenize(gen(text=fits))
    assert len(out.input_ids) == CONTEXT - 1
    with pytest.raises(ValueError, match=f"The input \\({CONTEXT} tokens\\) is longer"):
        tokenizer.tokenize(gen(text=fits + dense))
    # Same through the chat template: the rendered prompt is what is bounded.
    rendered_extra = len(tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": ""}], add_generation_prompt=True),
        add_special_tokens=False))
    content = dense * (CONTEXT - 1 - rendered_extra)
    ids = tokenizer.tokenize(gen(messages=[ChatMessage("user", content)])).input_ids
    assert len(ids) == CONTEXT - 1


def test_chat_ids_equal_apply_chat_template(tokenizer, tiny_path):
    """The ids of a chat request are transformers' apply_chat_template(tokenize=True)."""
    from transformers import AutoTokenizer
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "你好, 世界 😀!")]
    want = AutoTokenizer.from_pretrained(str(tiny_path)).apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert tokenizer.tokenize(gen(messages=messages)).input_ids == list(want)


def _fast(raw: RawTokenizer) -> HFTokenizer:
    return HFTokenizer(raw)


def _bpe(normalizer=None, pre=None, **model_kw) -> HFTokenizer:
    raw = RawTokenizer(models.BPE(**model_kw))
    if normalizer is not None:
        raw.normalizer = normalizer
    raw.pre_tokenizer = pre if pre is not None else pre_tokenizers.ByteLevel(
        add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return _fast(raw)


def test_nfc_normalizer_widens_the_bound_enough():
    """NFC turns up to 4 code points into one character: decomposed Greek and Hangul jamo
    are the worst case, and the bound still holds."""
    plain, nfc = _bpe(), _bpe(normalizers.NFC())
    assert chars_per_token_bound(nfc) == 4 * chars_per_token_bound(plain)
    bound = chars_per_token_bound(nfc)
    for t in [unicodedata.normalize("NFD", "\u1f82") * 500,       # alpha + 3 marks
              unicodedata.normalize("NFD", "\ud55c\uae00") * 500,  # Hangul L V T jamo
              "e\u0301" * 500]:
        assert len(nfc.encode(t)) >= len(t) / bound


@pytest.mark.parametrize("make", [
    lambda: _bpe(normalizers.Strip()),                                  # drops whitespace
    lambda: _bpe(normalizers.StripAccents()),                           # drops marks
    lambda: _bpe(pre=pre_tokenizers.Whitespace()),                      # drops whitespace
    lambda: _fast(RawTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))),
    lambda: _fast(RawTokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>",
                                          fuse_unk=True))),
])
def test_no_bound_where_text_can_vanish(make):
    assert chars_per_token_bound(make()) is None


def test_no_bound_means_every_text_is_tokenized(tiny_path):
    t = Tokenizer(str(tiny_path), vocab_size(tiny_path), CONTEXT)
    t.max_text_chars = None
    with pytest.raises(ValueError, match=r"The input \(\d+ tokens\) is longer"):
        t.tokenize(gen(text="hello " * 1000))


def test_sentencepiece_style_bound_holds():
    """Llama-2 style: '▁' for spaces, byte fallback, no byte-level pre-tokenizer."""
    raw = RawTokenizer(models.BPE(byte_fallback=True, unk_token=None))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    raw.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=300, special_tokens=[f"<0x{b:02X}>" for b in range(256)],
        show_progress=False))
    tok = _fast(raw)
    bound = chars_per_token_bound(tok)
    assert bound is not None
    rng = random.Random(1)
    for _ in range(200):
        start = rng.randrange(len(CORPUS))
        t = CORPUS[start:start + rng.randrange(1, 500)]
        assert len(tok.encode(t)) >= len(t) / bound


# ---- validation of what arrives on the socket ----------------------------------------------

def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 4, **kw})


FORGED = [
    (gen(), "Exactly one of text, input_ids or messages"),
    (gen(text="a", input_ids=[5]), "Exactly one of text, input_ids or messages"),
    (gen(text="a", messages=[ChatMessage("user", "a")]), "Exactly one"),
    (gen(messages=[]), "messages must not be empty"),
    (gen(text="a", sampling=sp(top_p=1.5)), "top_p must be in (0, 1], got 1.5."),
    (gen(text="a", sampling=sp(top_p=math.nan)), "top_p"),
    (gen(text="a", sampling=sp(temperature=-1.0)), "temperature"),
    (gen(text="a", sampling=sp(temperature=math.inf)), "temperature"),
    (gen(text="a", sampling=sp(top_k=0, temperature=1.0)), "top_k"),
    (gen(text="a", sampling=sp(repetition_penalty=0.0)), "repetition_penalty"),
    (gen(text="a", sampling=sp(min_new_tokens=9)), "min_new_tokens"),
    (gen(text="a", sampling=sp(max_new_tokens=-1)), "max_new_tokens"),
    (gen(text="a", sampling=sp(n=0)), "n must be at least 1"),
    (gen(text="a", sampling=sp(stop=["x"] * 33)), "stop may have at most 32"),
    (gen(text="a", sampling=sp(stop=["x" * 257])), "stop strings must be 1 to 256"),
    (gen(text="a", sampling=sp(stop=[""])), "stop strings must be 1 to 256"),
    (gen(text="a", sampling=sp(stop_token_ids=[10**6])), "stop_token_ids contains 1000000"),
    (gen(text="a", sampling=sp(stop_token_ids=list(range(5000)))), "stop_token_ids has 5000"),
    (gen(text="a", sampling=sp(logit_bias={"99999": 1.0})), "logit_bias"),
    (gen(text="a", sampling=sp(logit_bias={"x": 1.0})), "invalid literal"),
    (gen(text="a", sampling=sp(logit_bias={"1": math.nan})), "logit_bias values"),
    (gen(text="a", logprob=LogprobRequest(top_logprobs_num=21)), "top_logprobs_num"),
    (gen(text="a", logprob=LogprobRequest(top_logprobs_num=-1)), "top_logprobs_num"),
    (gen(text="a", logprob=LogprobRequest(start_len=-2)), "logprob_start_len"),
    (gen(input_ids=[5, 10**6]), "Token id 1000000 in input_ids is outside"),
    (gen(input_ids=[-1]), "Token id -1 in input_ids is outside"),
    (gen(input_ids=[10**6] * 10**5), "The input (100000 tokens) is longer"),
    (gen(input_ids=[]), "The input is empty."),
    (gen(text="a", sampling=sp(max_new_tokens=2**62)), "Requested token count exceeds"),
]


@pytest.mark.parametrize("req,fragment", FORGED, ids=[f for _, f in FORGED])
def test_forged_requests_get_a_400(tokenizer, req, fragment):
    worker = Worker(tokenizer)
    dest, frame = worker.handle(req)
    assert dest == 0                 # the one API process
    batch = decode(frame)
    assert isinstance(batch, TextBatch) and batch.load is None
    (out,) = batch.outputs
    assert out.rid == req.rid and out.finish.type == "abort"
    assert out.finish.status_code == 400
    assert fragment in out.finish.message, out.finish.message
    assert worker.rejected == 1 and worker.failed == 0


def test_valid_request_reaches_the_scheduler_with_fit_context(tokenizer):
    worker = Worker(tokenizer)
    req = gen(text="hello", sampling=sp(max_new_tokens=10**6), fit_context=True,
              logprob=LogprobRequest(top_logprobs_num=20, start_len=0), stream=True)
    dest, frame = worker.handle(req)
    assert dest == SCHEDULER
    out = decode(frame)
    assert isinstance(out, TokenizedRequest)
    assert out.fit_context is True and out.stream is True
    assert out.logprob == LogprobRequest(top_logprobs_num=20, start_len=0)
    assert len(out.input_ids) + out.sampling.max_new_tokens == CONTEXT - 1


def test_control_messages_pass_through_and_others_are_dropped(tokenizer):
    worker = Worker(tokenizer)
    for msg in (AbortRequest("x"), AbortRequest("", abort_all=True), FlushCacheRequest("f")):
        dest, frame = worker.handle(msg)
        assert dest == SCHEDULER and decode(frame) == msg
    assert worker.handle(ReleaseRequest(["x"])) is None
    assert worker.handle(TextBatch([])) is None
    assert worker.dropped == 2


def test_a_bug_ends_only_that_request_with_a_500(tokenizer, monkeypatch, caplog):
    worker = Worker(tokenizer)

    def broken(_req):
        raise KeyError("oops")
    monkeypatch.setattr(tokenizer, "tokenize", broken)
    dest, frame = worker.handle(gen(rid="bad", text="a"))
    (out,) = decode(frame).outputs
    assert dest == 0 and out.rid == "bad" and out.finish.status_code == 500
    assert "Internal error in the tokenizer (KeyError)" in out.finish.message
    assert worker.failed == 1
    assert "Traceback" in caplog.text and "oops" in caplog.text
    monkeypatch.undo()
    assert worker.handle(gen(rid="good", text="a"))[0] == SCHEDULER


def test_a_reject_goes_to_the_api_process_that_owns_the_request(tokenizer):
    worker = Worker(tokenizer, api_servers=3)
    dest, frame = worker.handle(gen(rid="r", input_ids=[], api=2))
    assert dest == 2 and decode(frame).outputs[0].rid == "r"
    dest, frame = worker.handle(gen(rid="ok", text="a", api=1))
    assert dest == SCHEDULER and decode(frame).api == 1      # carried on for the outputs
    assert worker.handle(gen(rid="forged", text="a", api=3)) is None     # no such process
    assert worker.handle(gen(rid="forged", text="a", api=-1)) is None
    assert worker.dropped == 2


def test_a_tokenizer_library_error_is_the_input_s_fault(tokenizer, monkeypatch):
    def choke(*_a, **_k):
        raise Exception("weird input")
    monkeypatch.setattr(tokenizer.tok, "encode", choke)
    dest, frame = Worker(tokenizer).handle(gen(text="a"))
    (out,) = decode(frame).outputs
    assert out.finish.status_code == 400
    assert "The tokenizer failed on this input: Exception: weird input" in out.finish.message


def test_error_messages_are_always_sendable(tokenizer, monkeypatch):
    def choke(*_a, **_k):
        raise ValueError("\ud800" + "x" * 5000)      # a lone surrogate, and long
    monkeypatch.setattr(tokenizer.tok, "encode", choke)
    dest, frame = Worker(tokenizer).handle(gen(text="a"))
    (out,) = decode(frame).outputs
    assert out.finish.status_code == 400 and len(out.finish.message) < 1100
