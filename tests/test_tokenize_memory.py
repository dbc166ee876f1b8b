"""What a /tokenize call holds (api_proc/tokenize_routes.py). Four concurrent calls of 1,024
x 7 KB took the API process from 46 to 421 MB and left it at 305: each call held its ids as
Python ints (~36 bytes a token) and the calls ran in parallel threads, whose freed heaps
glibc kept. Now a batch's ids become JSON text prompt by prompt, calls run one at a time on
one thread, and a big answer's freed heap is handed back."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette

from api_proc.tokenize_routes import TokenizeHandler
from tokenization.prompts import Tokenizer

CONTEXT = 1 << 16


@pytest.fixture(scope="module")
def handler(tiny_model):
    path = tiny_model("llama")
    tok = Tokenizer(str(path), 1 << 20, CONTEXT)
    h = TokenizeHandler(SimpleNamespace(context_length=CONTEXT, vocab_size=len(tok.tok),
                                        served_model_name="tiny"))
    h._tokenizer = tok
    return h


def texts(n: int, size: int) -> list[str]:
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "42", "é"]
    return [" ".join(rng.choice(words) for _ in range(size // 4))[:size] for _ in range(n)]


def test_the_answers_keep_their_shape(handler):
    tok = handler._tokenizer
    batch = texts(3, 200)
    assert json.loads(handler._tokenize({"prompt": batch})) == {
        "tokens": [tok.encode(t) for t in batch], "count": [len(tok.encode(t)) for t in batch],
        "max_model_len": CONTEXT}
    assert json.loads(handler._tokenize({"prompt": batch[0], "add_special_tokens": False})) \
        == {"tokens": tok.encode(batch[0], add_special_tokens=False),
            "count": len(tok.encode(batch[0], add_special_tokens=False)),
            "max_model_len": CONTEXT}
    ids = [tok.encode(t) for t in batch]
    assert json.loads(handler._detokenize({"tokens": ids})) == {
        "text": [tok.tok.decode(i) for i in ids], "prompt": [tok.tok.decode(i) for i in ids]}
    assert json.loads(handler._detokenize({"tokens": ids[0]}))["text"] == tok.tok.decode(ids[0])


def test_a_batch_holds_its_answer_not_its_ids(handler):
    """Python's own allocations during a 128 x 7 KB batch, at their peak: ~3 times the
    answer's bytes (its parts, their join, one prompt's work). Holding the ids as ints, then
    their JSON text, took ~15 times (13 MB for an answer of 0.86 MB)."""
    body = {"prompt": texts(128, 7000)}
    handler._tokenize({"prompt": body["prompt"][:1]})          # warm: caches, first imports
    tracemalloc.start()
    try:
        answer = handler._tokenize(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(json.loads(answer)["count"]) > 128 * 1000     # the ids are all there
    assert peak < 5 * len(answer), (peak, len(answer))


def test_calls_run_one_at_a_time(handler, monkeypatch):
    """Concurrent calls queue for the one tokenize thread instead of each taking its own."""
    tok, busy, seen = handler._tokenizer, [0], {"most": 0, "threads": set()}
    lock, real = threading.Lock(), handler._tokenizer.encode

    def encode(text, **kwargs):
        with lock:
            busy[0] += 1
            seen["most"] = max(seen["most"], busy[0])
            seen["threads"].add(threading.current_thread().name)
        time.sleep(0.05)                # long enough for parallel threads to overlap
        with lock:
            busy[0] -= 1
        return real(text, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    app = Starlette(routes=handler.routes())

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            return await asyncio.gather(*[client.post("/tokenize", json={
                "prompt": texts(2, 100)}) for _ in range(4)])

    answers = asyncio.run(calls())
    assert [a.status_code for a in answers] == [200] * 4
    assert seen["most"] == 1
    assert len(seen["threads"]) == 1 and next(iter(seen["threads"])).startswith("tokenize")
