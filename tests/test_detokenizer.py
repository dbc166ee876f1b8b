"""Unit tests for detokenizer_proc.incremental (DecodeStream) and the process's per-batch
logic (detokenizer_proc.process.Detokenizer: validation, per-output failures, release)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from detokenizer_proc.incremental import DecodeStream, Delta
from detokenizer_proc.process import Detokenizer
from tokenization.hf_tokenizer import HFTokenizer
from wire.messages import (DecodeParams, FinishReason, Logprobs, SchedulerLoad, TokenBatch,
                           TokenOutput)

FFFD = "\ufffd"

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! Stop here, then go on. " * 20
    + "你好，世界。今天天气很好。我们去公园散步吧。中文分词很有趣。" * 10
    + "😀🎉🚀👍🏽 emoji party 🙂 fun 🇯🇵 flags " * 10
)

SAMPLE_TEXTS = [
    "Hello world! The lazy dog.",
    "你好，世界。今天天气很好。",
    "emoji 😀🎉 then 👍🏽 and 🇯🇵 done",
    "mixed 中文 and English 🚀 text 公园",
    "rare chars: Ω ∑ ß é ñ 𝄞 龘",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char map (what tokenizers' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    """A small byte-level BPE trained on English, CJK and emoji, with </s> as eos."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["</s>"],
        show_progress=False,
    )
    raw.train_from_iterator([CORPUS], trainer=trainer)
    t = HFTokenizer(raw, {"eos_token": "</s>"})
    assert t.eos_token_id is not None
    return t


@pytest.fixture(scope="module")
def sp_tok() -> HFTokenizer:
    """A Llama-2 style tokenizer: "▁" for spaces, <0xNN> byte fallback, and a decoder that
    strips the leading space of the first token (so decoding depends on the window start)."""
    raw = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    raw.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["</s>", *byte_tokens],
        limit_alphabet=40,  # keep CJK / emoji out of the vocab: they use byte fallback
        show_progress=False,
    )
    raw.train_from_iterator([CORPUS], trainer=trainer)
    # The byte tokens had to be "special" to be put in the vocab; make them ordinary again.
    spec = json.loads(raw.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] == "</s>"]
    raw = Tokenizer.from_str(json.dumps(spec))
    t = HFTokenizer(raw, {"eos_token": "</s>"})
    assert t.all_special_ids == [t.eos_token_id]
    return t


@pytest.fixture(scope="module")
def byte_ids(tok):
    """text -> one id per UTF-8 byte (maximally splits multi-byte characters)."""
    b2u = _bytes_to_unicode()
    table = [tok.convert_tokens_to_ids(b2u[b]) for b in range(256)]
    assert None not in table

    def encode(text: str) -> list[int]:
        return [table[b] for b in text.encode("utf-8")]

    return encode


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(stream: DecodeStream, ids: list[int], chunks: list[int] | None = None) -> list[Delta]:
    """Push `ids` in chunks (default: one id at a time), then finish, unless a stop matched."""
    deltas = []
    pos = 0
    for size in chunks or [1] * len(ids):
        deltas.append(stream.push(ids[pos : pos + size], finished=False))
        pos += size
        if stream.finished:  # a stop string matched
            return deltas
    assert pos == len(ids)
    deltas.append(stream.push([], finished=True))
    return deltas


def joined(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while n:
        k = min(n, rng.randint(1, 5))
        sizes.append(k)
        n -= k
    return sizes


# --------------------------------------------------------------------------- decoding


def test_tokenizer_splits_multibyte_chars(tok):
    # Sanity check of the fixture: some ids decode to half a character on their own.
    ids = enc(tok, "".join(SAMPLE_TEXTS))
    assert any(FFFD in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("mode", ["single", "chunks", "final_push"])
def test_random_ids_match_full_decode(tok, skip, mode):
    rng = random.Random(1234 + skip)
    vocab = len(tok)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        expected = tok.decode(ids, skip_special_tokens=skip)
        s = DecodeStream(tok, skip_special_tokens=skip)
        if mode == "single":
            deltas = run(s, ids)
        elif mode == "chunks":
            deltas = run(s, ids, random_chunks(rng, len(ids)))
        else:  # everything in the finishing push
            deltas = [s.push(ids, finished=True)]
        assert joined(deltas) == expected
        assert s.text == expected
        assert all(d.stop_matched is None for d in deltas)
        assert sum(d.num_ids for d in deltas) == len(ids)


@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_valid_text_never_emits_fffd(tok, byte_ids, split):
    rng = random.Random(7)
    for text in SAMPLE_TEXTS + ["".join(SAMPLE_TEXTS)]:
        ids = enc(tok, text) if split == "bpe" else byte_ids(text)
        assert tok.decode(ids) == text
        for chunks in (None, random_chunks(rng, len(ids))):
            s = DecodeStream(tok)
            deltas = run(s, ids, chunks)
            assert joined(deltas) == text
            for d in deltas:
                assert FFFD not in d.text


def test_partial_char_held_until_completed(tok, byte_ids):
    ids = byte_ids("a中")  # 'a' + 3 bytes
    s = DecodeStream(tok)
    assert s.push(ids[:2], finished=False).text == "a"
    assert s.push(ids[2:3], finished=False).text == ""
    d = s.push(ids[3:], finished=False)
    assert d.text == "中" and d.num_ids == 1


def test_incomplete_char_flushed_on_finish(tok, byte_ids):
    ids = byte_ids("ok中")[:-1]  # drop the last byte of 中
    expected = tok.decode(ids)
    assert expected.endswith(FFFD)
    s = DecodeStream(tok)
    assert s.push(ids, finished=False).text == "ok"
    d = s.push([], finished=True)
    assert d.text == expected[2:] and d.num_ids == 0
    assert s.text == expected
    # Same when the incomplete tail arrives in the finishing push itself.
    s = DecodeStream(tok)
    assert joined([s.push(ids[:2], False), s.push(ids[2:], True)]) == expected


def test_skip_special_tokens(tok):
    eos = tok.eos_token_id
    ids = enc(tok, "Hello 你好") + [eos] + enc(tok, " world") + [eos]
    for skip in (True, False):
        s = DecodeStream(tok, skip_special_tokens=skip)
        out = joined(run(s, ids))
        assert out == tok.decode(ids, skip_special_tokens=skip)
        assert ("</s>" in out) is (not skip)


def test_spaces_between_special_tokens_accepted(tok):
    ids = enc(tok, "a") + [tok.eos_token_id] + enc(tok, "b")
    s = DecodeStream(tok, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert joined(run(s, ids)) == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_style_matches_full_decode(sp_tok, skip):
    # Leading-space stripping and byte-fallback grouping depend on where decoding starts;
    # long outputs (window slides) with special tokens in between must still match.
    tok = sp_tok
    assert "<0x" in "".join(tok.convert_ids_to_tokens(enc(tok, " 龘")))  # byte fallback in use
    rng = random.Random(5 + skip)
    words = [" hi", "龘", " 😀", "Hello", " 𝄞x", "中文", " ", " the", "今天天气很好", "  "]
    for _ in range(100):
        ids: list[int] = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.1:
                ids += [tok.eos_token_id] * rng.randint(1, 8)
            else:
                ids += enc(tok, rng.choice(words))
        expected = tok.decode(ids, skip_special_tokens=skip)
        for chunks in (None, random_chunks(rng, len(ids))):
            s = DecodeStream(tok, skip_special_tokens=skip)
            deltas = run(s, ids, chunks)
            assert joined(deltas) == expected
            assert all(FFFD not in d.text for d in deltas)


def test_long_output_uses_bounded_window(tok, byte_ids):
    # The per-token decode must not grow with the output length.
    sizes: list[int] = []

    class Spy:
        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)

    text = "".join(SAMPLE_TEXTS) * 30
    for ids in (enc(tok, text), byte_ids(text)):
        sizes.clear()
        s = DecodeStream(Spy())
        assert joined(run(s, ids)) == text
        assert len(ids) > 1000
        assert max(sizes) <= 32
        assert len(sizes) <= 1.2 * len(ids)  # about one decode per pushed id


def test_garbage_bytes_stay_bounded(tok, byte_ids):
    # A long run of lone continuation bytes never ends with a complete character.
    sizes: list[int] = []

    class Spy:
        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)

    cont = byte_ids("中")[1]
    ids = [cont] * 1000 + enc(tok, "end")
    s = DecodeStream(Spy())
    assert joined(run(s, ids)) == tok.decode(ids)
    assert max(sizes) <= DecodeStream._MAX_WINDOW + 1


def test_push_after_finish_raises(tok):
    s = DecodeStream(tok)
    s.push(enc(tok, "hi"), finished=True)
    assert s.finished
    with pytest.raises(RuntimeError):
        s.push([], finished=True)
    s = DecodeStream(tok, stop=["hi"])
    assert s.push(enc(tok, "hi there"), finished=False).stop_matched == "hi"
    assert s.finished
    with pytest.raises(RuntimeError):
        s.push(enc(tok, "x"), finished=False)


def test_empty_finish(tok):
    s = DecodeStream(tok, stop=["x"])
    d = s.push([], finished=True)
    assert d == Delta(text="", stop_matched=None, num_ids=0)
    assert s.text == ""


# --------------------------------------------------------------------------- stop strings


def _multi_char_token(tok, min_len=4) -> tuple[int, str]:
    """An id whose text is >= min_len ASCII chars, letters or spaces (a merged BPE token)."""
    for tid in range(len(tok)):
        t = tok.decode([tid])
        if len(t) >= min_len and t.isascii() and t.replace(" ", "").isalpha():
            return tid, t
    raise AssertionError("no long token in vocab")


def test_stop_inside_one_token(tok, byte_ids):
    tid, t = _multi_char_token(tok)
    stop = t[1:-1]  # strictly inside the token
    ids = byte_ids("ab ") + [tid] + byte_ids(" after")
    s = DecodeStream(tok, stop=[stop])
    deltas = run(s, ids)
    assert deltas[3].stop_matched == stop and deltas[3].num_ids == 1
    assert joined(deltas[:4]) == "ab " + t[0]
    assert s.text == "ab " + t[0]
    # no_stop_trim keeps the stop string, but not what followed it inside the token.
    s = DecodeStream(tok, stop=[stop], no_stop_trim=True)
    d = s.push(ids, finished=False)
    assert d == Delta(text="ab " + t[:-1], stop_matched=stop, num_ids=4)


def test_stop_across_tokens(tok, byte_ids):
    ids = byte_ids("say STOP now")
    s = DecodeStream(tok, stop=["STOP"])
    deltas = [s.push([i], finished=False) for i in ids[:8]]
    # "S", "T", "O" are held back as a possible stop start, then "P" completes it.
    assert [d.text for d in deltas[:4]] == ["s", "a", "y", " "]
    assert [d.text for d in deltas[4:7]] == ["", "", ""]
    assert deltas[7] == Delta(text="", stop_matched="STOP", num_ids=1)
    assert s.text == "say "


def test_stop_across_bpe_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = enc(tok, text)
    stop = "k brown f"  # spans several BPE tokens
    s = DecodeStream(tok, stop=[stop])
    deltas = run(s, ids)
    assert deltas[-1].stop_matched == stop
    assert s.text == "The quic"
    # matched at the id that completes the "f"
    prefix_ids = ids[: len(deltas)]
    assert stop in tok.decode(prefix_ids) and stop not in tok.decode(prefix_ids[:-1])


def test_stop_at_first_token(tok, byte_ids):
    tid, t = _multi_char_token(tok)
    for stop in (t, t[:2]):
        s = DecodeStream(tok, stop=[stop])
        d = s.push([tid] + byte_ids("more"), finished=False)
        assert d == Delta(text="", stop_matched=stop, num_ids=1)
        s = DecodeStream(tok, stop=[stop], no_stop_trim=True)
        d = s.push([tid], finished=False)
        assert d == Delta(text=stop, stop_matched=stop, num_ids=1)


def test_multiple_stops_earliest_wins(tok, byte_ids):
    ids = byte_ids("one two three four")
    for order in (["four", "two", "three"], ["three", "two", "four"]):
        s = DecodeStream(tok, stop=order)
        d = s.push(ids, finished=False)
        assert d == Delta(text="one ", stop_matched="two", num_ids=len("one two"))
    # In one token's text the match that completes first wins; on an equal end, the
    # longer (earlier-starting) one.
    tid, t = _multi_char_token(tok)
    s = DecodeStream(tok, stop=[t, t[1:3]])
    assert s.push([tid], False) == Delta(text=t[0], stop_matched=t[1:3], num_ids=1)
    s = DecodeStream(tok, stop=[t[-2:], t])
    assert s.push([tid], False) == Delta(text="", stop_matched=t, num_ids=1)


def test_stop_completes_first_wins_across_ids(tok, byte_ids):
    # "bc" completes at the 3rd id, before "abcd" could; it wins although it starts later.
    s = DecodeStream(tok, stop=["abcd", "bc"])
    d = s.push(byte_ids("abcd"), finished=False)
    assert d == Delta(text="a", stop_matched="bc", num_ids=3)


def test_no_stop_trim(tok, byte_ids):
    ids = byte_ids("hello END tail")
    s = DecodeStream(tok, stop=["END"], no_stop_trim=True)
    deltas = run(s, ids)
    assert deltas[-1].stop_matched == "END"
    assert s.text == "hello END"
    assert len(deltas) == len("hello END")


def test_held_prefix_released_when_disproved(tok, byte_ids):
    s = DecodeStream(tok, stop=["xyz"])
    assert s.push(byte_ids("ax"), False).text == "a"  # "x" may start "xyz"
    assert s.push(byte_ids("y"), False).text == ""  # "xy" still may
    d = s.push(byte_ids("q"), False)  # "xyq" cannot
    assert d == Delta(text="xyq", stop_matched=None, num_ids=1)
    # Overlapping candidate: "xyx" disproves "xyz" from the first x but the last x is held.
    s = DecodeStream(tok, stop=["xyz"])
    assert s.push(byte_ids("xyx"), False).text == "xy"
    assert s.push(byte_ids("yz"), False) == Delta(text="", stop_matched="xyz", num_ids=2)
    assert s.text == "xy"


def test_held_prefix_flushed_on_finish(tok, byte_ids):
    s = DecodeStream(tok, stop=["STOP"])
    assert s.push(byte_ids("go ST"), False).text == "go "
    d = s.push([], finished=True)
    assert d == Delta(text="ST", stop_matched=None, num_ids=0)
    assert s.text == "go ST"
    # and when the finishing push carries ids
    s = DecodeStream(tok, stop=["STOP"])
    assert joined([s.push(byte_ids("go"), False), s.push(byte_ids(" STO"), True)]) == "go STO"


def test_stop_num_ids_mid_push(tok):
    text = "Hello world! The quick brown fox jumps over the lazy dog."
    ids = enc(tok, text)
    stop = "brown"
    # first id count whose decoded text contains the stop
    k = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    head = 2
    s = DecodeStream(tok, stop=[stop])
    d1 = s.push(ids[:head], False)
    d2 = s.push(ids[head:], False)
    assert d2.stop_matched == stop
    assert d2.num_ids == k - head
    assert d1.text + d2.text == text[: text.index(stop)]


def test_stop_with_multibyte_chars(tok, byte_ids):
    ids = byte_ids("前面中间后面")
    s = DecodeStream(tok, stop=["中间"])
    deltas = [s.push([i], False) for i in ids[:12]]
    assert deltas[-1].stop_matched == "中间" and deltas[-1].num_ids == 1
    assert s.text == "前面"
    assert all(FFFD not in d.text for d in deltas)


def test_stop_random_against_reference(tok):
    # Reference: decode everything, cut at the first stop completion (char by char).
    rng = random.Random(99)
    words = ["the", " dog", " 你好", " 😀", " lazy", "!", " fox", " 世界", " go"]
    stops_pool = ["dog", "你", "😀 l", "y!", "x 世", "zz", " go the"]
    for _ in range(150):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 15)))
        ids = enc(tok, text)
        stops = rng.sample(stops_pool, rng.randint(1, 3))
        trim = rng.random() < 0.5
        s = DecodeStream(tok, stop=stops, no_stop_trim=not trim)
        deltas = run(s, ids, random_chunks(rng, len(ids)))
        # reference: smallest prefix of ids whose text contains a stop string
        ref_k, ref_stop = None, None
        for k in range(1, len(ids) + 1):
            t = tok.decode(ids[:k])
            found = [(t.find(st) + len(st), t.find(st), st) for st in stops if st in t]
            if found:
                end, start, ref_stop = min(found, key=lambda f: (f[0], f[1]))
                ref_k, ref_text = k, t[:start] if trim else t[:end]
                break
        if ref_k is None:
            assert s.text == text and s.stop_matched is None
        else:
            assert s.stop_matched == ref_stop
            assert s.text == ref_text
            assert sum(d.num_ids for d in deltas) == ref_k
        for d in deltas:
            assert FFFD not in d.text


# ---- Detokenizer: one TokenBatch in, one TextBatch out; bad outputs end only their request --

def out(rid, ids, finish=None, decode=True, **kw) -> TokenOutput:
    return TokenOutput(rid=rid, new_ids=ids, finish=finish, prompt_tokens=3, cached_tokens=0,
                       queue_time=0.01, decode=DecodeParams(**kw) if decode else None)


def step(detok, *outputs):
    texts, release = detok.process(TokenBatch(list(outputs), SchedulerLoad(seq=7)))
    assert len(texts) == detok.api_servers
    assert all(text.load == SchedulerLoad(seq=7) for text in texts)    # load to every API
    return {o.rid: o for text in texts for o in text.outputs}, release


LENGTH = FinishReason("length", length=4)


def test_outputs_go_to_the_api_process_that_owns_their_rid(tok):
    detok = Detokenizer(tok, api_servers=3)
    ids = tok.encode("hello world")
    first = [out("a", ids[:1], api=2), out("b", ids[:1], api=0), out("c", ids[:1], api=1)]
    texts, _ = detok.process(TokenBatch(first, SchedulerLoad(seq=1)))
    assert [[o.rid for o in t.outputs] for t in texts] == [["b"], ["c"], ["a"]]
    # Later outputs carry no decode params: the rid's owner is remembered.
    texts, _ = detok.process(TokenBatch([out("a", ids[1:2], LENGTH, decode=False)],
                                        SchedulerLoad(seq=2)))
    assert [[o.rid for o in t.outputs] for t in texts] == [[], [], ["a"]]
    assert all(t.load.seq == 2 for t in texts)
    # A forged owner ends its request with an error, sent to process 0 (which drops it).
    texts, _ = detok.process(TokenBatch([out("d", ids[:1], LENGTH, api=3)],
                                        SchedulerLoad(seq=3)))
    assert texts[0].outputs[0].finish.status_code == 500 and detok.failed == 1


def test_detokenizer_happy_path(tok):
    detok = Detokenizer(tok)
    ids = enc(tok, "Hello world")
    outs, release = step(detok, out("a", ids[:1]))
    outs2, _ = step(detok, out("a", ids[1:], LENGTH, decode=False))
    assert outs["a"].text + outs2["a"].text == "Hello world" and not release
    assert outs2["a"].finish == LENGTH and outs2["a"].completion_tokens == len(ids)
    assert not detok.states


@pytest.mark.parametrize("bad", [-1, 400, 10**6, 2**40, 2**63])
def test_out_of_vocab_id_ends_only_that_request(tok, bad):
    detok = Detokenizer(tok)
    ids = enc(tok, "Hello world")
    step(detok, out("a", ids[:1]), out("b", ids[:1]))
    outs, release = step(detok, out("a", [ids[1], bad], decode=False),
                         out("b", ids[1:2], decode=False))
    err = outs["a"].finish
    assert err.type == "abort" and err.status_code == 500
    assert f"token id {bad}, outside the vocabulary [0, {len(tok)})" in err.message
    assert outs["a"].new_ids == [] and outs["a"].text == ""
    assert release == ["a"]                       # the scheduler stops running it
    assert outs["b"].finish is None and outs["b"].new_ids == ids[1:2]
    assert detok.failed == 1
    # The scheduler's outputs until its own end are dropped quietly; then the state goes.
    outs, release = step(detok, out("a", ids[2:3], decode=False),
                         out("b", ids[2:], LENGTH, decode=False))
    assert set(outs) == {"b"} and not release
    outs, _ = step(detok, out("a", [], FinishReason("abort", message="Released"),
                              decode=False))
    assert outs == {} and set(detok.states) == set()


def test_bad_first_output_of_a_new_rid(tok):
    detok = Detokenizer(tok)
    outs, release = step(detok, out("a", [10**6]))
    assert outs["a"].finish.status_code == 500 and release == ["a"]
    outs, release = step(detok, out("t", [10**6], LENGTH))      # terminal: nothing to release
    assert outs["t"].finish.status_code == 500 and not release and "t" not in detok.states


def test_ids_of_a_padded_model_vocabulary_decode_to_nothing(tok):
    """A model's embedding may have rows past the tokenizer's ids (Qwen's padding)."""
    detok = Detokenizer(tok, model_vocab_size=len(tok) + 64)
    assert detok.vocab_size == len(tok) + 64
    outs, release = step(detok, out("a", [len(tok) + 63], LENGTH))
    assert outs["a"].finish == LENGTH and outs["a"].text == "" and not release


def test_unknown_rid_without_decode_params_is_dropped(tok):
    detok = Detokenizer(tok)
    outs, release = step(detok, out("ghost", [5], decode=False),
                         out("ghost2", [10**9], LENGTH, decode=False))
    assert outs == {} and not release and detok.dropped == 2 and not detok.states


@pytest.mark.parametrize("lp", [
    Logprobs(token_ids=[5], logprobs=[-0.1, -0.2], top_ids=[[]], top_logprobs=[[]]),
    Logprobs(token_ids=[5], logprobs=[-0.1], top_ids=[[1, 2]], top_logprobs=[[-0.1]]),
    Logprobs(token_ids=[5], logprobs=[-0.1], top_ids=[[1, 10**6]], top_logprobs=[[-1, -2]]),
    Logprobs(token_ids=[-3], logprobs=[-0.1], top_ids=[[]], top_logprobs=[[]]),
])
def test_inconsistent_logprobs_end_the_request(tok, lp):
    detok = Detokenizer(tok)
    o = out("a", [5])
    o.logprobs = lp
    outs, release = step(detok, o)
    assert outs["a"].finish.status_code == 500 and release == ["a"]


def test_input_logprobs_and_finish_are_checked(tok):
    detok = Detokenizer(tok)
    o = out("a", [5], LENGTH)
    o.input_logprobs = Logprobs(token_ids=[1, 2], logprobs=[None, -1.0], top_ids=[[], [999]],
                                top_logprobs=[[], [-1.0]])
    assert "input_logprobs" in step(detok, o)[0]["a"].finish.message
    o = out("b", [5], FinishReason("exploded"))
    assert "unknown finish type" in step(detok, o)[0]["b"].finish.message
    o = out("c", [5])
    o.queue_time = float("nan")
    assert step(detok, o)[0]["c"].finish.status_code == 500


def test_decode_params_beyond_the_api_limits_end_the_request(tok):
    detok = Detokenizer(tok)
    outs, release = step(detok, out("a", [5], stop=["ab" * 200]),
                         out("b", [5], stop=["x"] * 33), out("c", [5], stop=["x"] * 32))
    assert outs["a"].finish.status_code == 500 and outs["b"].finish.status_code == 500
    assert outs["c"].finish is None and release == ["a", "b"]


def test_a_decoding_bug_ends_only_that_request(tok, monkeypatch, caplog):
    detok = Detokenizer(tok)
    step(detok, out("a", [5]), out("b", [5]))

    def broken(self, ids, finished):
        raise RuntimeError("decoder bug")
    monkeypatch.setattr(DecodeStream, "push", broken)      # slots: patch the class
    outs, release = step(detok, out("a", [6], decode=False))
    monkeypatch.undo()
    assert outs["a"].finish.status_code == 500 and release == ["a"]
    assert "Internal error in the detokenizer (RuntimeError)" in outs["a"].finish.message
    assert "decoder bug" in caplog.text and "Traceback" in caplog.text
    outs, _ = step(detok, out("b", [6], LENGTH, decode=False))
    assert outs["b"].finish == LENGTH
