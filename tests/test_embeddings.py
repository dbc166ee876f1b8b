"""Embeddings, score and rerank (api_proc/embeddings.py).

In process: the sentence-transformers pooling config and its resolution at startup, the
bodies, base64, the scores, Req's pooling across chunks, the Scheduler's refusals and
pooling (test_scheduler_unit's fake runner), and every pooling and labels on two
tensor-parallel ranks (threads) against one rank. End to end: one server of the tiny llama
checkpoint with 16-token prefill chunks, against transformers' hidden states and logits,
with the openai SDK and raw HTTP; and a small second server under --is-embedding for its
refusals."""

from __future__ import annotations

import base64
import json
import math
import struct

import httpx
import numpy as np
import openai
import pytest
import torch

from api_proc.embeddings import (MAX_INPUTS, MAX_ITEMS, RERANK_LABELS, encode_vector,
                                 label_scores, parse_embeddings, parse_rerank, parse_score,
                                 rerank_prompt)
from api_proc.openai_api import OpenAIError
from scheduler_proc.request import Req
from tests.reference import _load
from tests.server import serving, wait_idle
from tests.test_scheduler_unit import (VOCAB, FakeRunner, assert_pool_idle, finishes, make,
                                       request, run_until_idle)
from wire.messages import MAX_LABEL_IDS, TokenizedRequest, VectorRequest
from wire.model_path import StartupError, sentence_transformers_pooling
from wire.sampling import SamplingParams

MODEL = "m"
CHUNK = 16                          # the server's --chunked-prefill-size
LONG = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the "
        "forest where nobody can see it any more.")
# Tolerance on components of unit vectors. zserve and transformers compute the same float32
# arithmetic in different orders (zserve's batched, chunked attention and its own matmul
# kernels against eager attention and torch's GEMMs). A reordered sum of k float32 terms
# differs by at most ~k * 2^-24 of its terms' magnitude, ~sqrt(k) * 2^-24 typically: for the
# tiny model (hidden 64, k <= 128 terms per dot product, two layers, RMS-normed activations
# of size ~1) that is ~1e-6 relative on a hidden value at worst; the mean adds <= 40 rows in
# another order (<= 40 * 6e-8 more); L2 normalization divides by the norm (~sqrt(64) * the
# values) and does not amplify. Components are ~0.1-0.4: 2e-5 leaves >= 10x over that
# bound (measured: <= 3e-7), and is far below what a wrong row, a missed final norm or a
# wrong pooling gives (~0.1).
ATOL = 2e-5


# ---- pure logic ---------------------------------------------------------------------------

def _st_dir(tmp_path, config: dict, path: str | None = None):
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": path or "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / (path or "1_Pooling")).mkdir()
    (tmp_path / (path or "1_Pooling") / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("key,mode", [("pooling_mode_cls_token", "cls"),
                                      ("pooling_mode_mean_tokens", "mean"),
                                      ("pooling_mode_lasttoken", "last")])
def test_pooling_from_sentence_transformers_config(tmp_path, key, mode):
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
              "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
              "pooling_mode_lasttoken": False, key: True}
    assert sentence_transformers_pooling(_st_dir(tmp_path, config, "2_Pool")) == mode


def test_pooling_config_absent_unsupported_or_newer(tmp_path):
    assert sentence_transformers_pooling(str(tmp_path)) is None     # no modules.json: last
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert sentence_transformers_pooling(_st_dir(a, {"pooling_mode": "lasttoken"})) == "last"
    with pytest.raises(StartupError, match="max_tokens.*pass --pooling"):
        sentence_transformers_pooling(_st_dir(b, {"pooling_mode_max_tokens": True}))


def test_server_resolves_the_default_pooling(tiny_model, tmp_path):
    from launch import resolve_args
    from wire.server_args import ServerArgs
    model = tmp_path / "st"
    model.mkdir()
    for f in tiny_model("llama").iterdir():             # the checkpoint, plus an ST config
        (model / f.name).symlink_to(f)
    assert resolve_args(ServerArgs(model_path=str(model))).pooling == "last"
    _st_dir(model, {"pooling_mode_mean_tokens": True})
    assert resolve_args(ServerArgs(model_path=str(model))).pooling == "mean"
    assert resolve_args(ServerArgs(model_path=str(model), pooling="cls")).pooling == "cls"


def test_embeddings_body():
    assert parse_embeddings({"input": "a"}, MODEL).inputs == ["a"]
    body = parse_embeddings({"input": [[1, 2], [3]], "model": "default",
                             "encoding_format": "base64", "pooling": "mean"}, MODEL)
    assert body.inputs == [[1, 2], [3]] and body.encoding == "base64" and body.pooling == "mean"
    assert parse_embeddings({"input": [5, 6]}, MODEL).inputs == [[5, 6]]
    bad = {"dimensions": ({"input": "a", "dimensions": 8}, "dimensions is not supported"),
           "encoding": ({"input": "a", "encoding_format": "int8"}, "float or base64"),
           "mixed": ({"input": ["a", [1]]}, "input must be"),
           "empty": ({"input": []}, "input must be"),
           "bools": ({"input": [True, 2]}, "input must be"),
           "missing": ({}, "input must be"),
           "pooling": ({"input": "a", "pooling": "max"}, "pooling must be one of"),
           "many": ({"input": ["a"] * (MAX_INPUTS + 1)}, "more than the limit"),
           "model": ({"input": "a", "model": "other"}, "does not exist")}
    for name, (body, message) in bad.items():
        with pytest.raises(OpenAIError, match=message) as e:
            parse_embeddings(body, MODEL)
        assert e.value.status == (404 if name == "model" else 400), name
    with pytest.raises(OpenAIError, match="JSON object"):
        parse_embeddings(["a"], MODEL)


def test_base64_is_little_endian_float32():
    v = np.array([0.5, -1.25, 3e-8], dtype=np.float32)
    raw = base64.b64decode(encode_vector(v, "base64"))
    assert raw == struct.pack("<3f", *v.tolist())
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), v)
    assert encode_vector(v, "float") == [float(x) for x in v]


def test_score_body_and_scores():
    body = parse_score({"query": "Q", "items": ["a", "b"], "label_token_ids": [1, 2],
                        "apply_softmax": True}, MODEL, vocab_size=10)
    assert body.prompts == ["Qa", "Qb"] and body.label_ids == [1, 2] and body.apply_softmax
    body = parse_score({"query": [1], "items": [[2, 3]], "label_token_ids": [4],
                        "item_first": True}, MODEL, vocab_size=10)
    assert body.prompts == [[2, 3, 1]] and not body.apply_softmax
    assert parse_score({"query": "Q", "items": "x", "label_token_ids": [0]}, MODEL,
                       10).prompts == ["Qx"]
    bad = [({"query": "Q", "items": [[1]], "label_token_ids": [1]}, "both be text or both"),
           ({"query": [1], "items": ["a"], "label_token_ids": [1]}, "both be text or both"),
           ({"query": "Q", "items": [], "label_token_ids": [1]}, "items must be"),
           ({"query": None, "items": ["a"], "label_token_ids": [1]}, "query must be"),
           ({"query": "Q", "items": ["a"], "label_token_ids": []}, "label_token_ids must"),
           ({"query": "Q", "items": ["a"], "label_token_ids": [10]}, "outside the vocabulary"),
           ({"query": "Q", "items": ["a"], "label_token_ids": [1] * (MAX_LABEL_IDS + 1)},
            "1 to 1024"),
           ({"query": "Q", "items": ["a"] * (MAX_ITEMS + 1), "label_token_ids": [1]},
            "more than the limit"),
           ({"query": "Q", "items": ["a"], "label_token_ids": [1], "apply_softmax": 1},
            "must be a boolean")]
    for raw, message in bad:
        with pytest.raises(OpenAIError, match=message):
            parse_score(raw, MODEL, vocab_size=10)
    lp = np.log(np.array([0.2, 0.05], dtype=np.float32))
    assert label_scores(lp, False) == pytest.approx([0.2, 0.05], rel=1e-6)
    assert label_scores(lp, True) == pytest.approx([0.8, 0.2], rel=1e-6)
    assert label_scores(np.array([-np.inf, -np.inf]), True) == [0.0, 0.0]


def test_rerank_body():
    body = parse_rerank({"query": "q", "documents": ["a", "b"]}, MODEL)
    assert body.top_n == 2 and not body.return_documents
    for raw, message in [({"query": "q", "documents": []}, "non-empty list of strings"),
                         ({"query": "q", "documents": ["a", 1]}, "non-empty list of strings"),
                         ({"query": 1, "documents": ["a"]}, "query must be a string"),
                         ({"query": "q", "documents": ["a"], "top_n": 0}, "positive integer")]:
        with pytest.raises(OpenAIError, match=message):
            parse_rerank(raw, MODEL)


def test_vector_request_checks():
    assert VectorRequest("mean").problem(10) is None
    assert "pooling must be" in VectorRequest("max").problem(10)
    assert "outside the vocabulary" in VectorRequest("labels", [3, 10]).problem(10)
    assert "pooling labels only" in VectorRequest("last", [1]).problem(10)


def test_mean_pooling_sums_across_chunks_and_restarts_after_a_retraction():
    ids = list(range(1, 11))
    req = Req(TokenizedRequest(rid="r", input_ids=ids, sampling=SamplingParams(
        max_new_tokens=0), vector=VectorRequest("mean")))
    assert req.max_prefix_match == 0            # mean reads position 0 onwards
    rows = torch.randn(10, 4)
    req.pool(torch.randn(4, 4), 0)             # a first attempt, then retracted
    assert req.vector_positions(0, 4) == (0, 4)
    for start in (0, 4, 8):                     # recomputed from 0 in chunks of 4
        lo, hi = req.vector_positions(start, min(start + 4, 10))
        req.pool(rows[lo:hi], lo)
    got = np.frombuffer(req.vector_bytes(), dtype="<f4")
    want = torch.nn.functional.normalize(rows.mean(0), dim=0).numpy()
    assert np.allclose(got, want, atol=1e-6)
    last = Req(TokenizedRequest(rid="s", input_ids=ids, sampling=SamplingParams(
        max_new_tokens=0), vector=VectorRequest("last")))
    assert last.max_prefix_match == 9 and last.vector_positions(0, 8) == (0, 0)
    assert last.vector_positions(8, 10) == (9, 10)


class PoolingRunner(FakeRunner):
    """test_scheduler_unit's FakeRunner, pooling as the real runner does: position p's
    "hidden state" is [its token, 1]."""

    def _forward(self, segments, req_to_token):
        out = super()._forward(segments, req_to_token)
        for seg in segments:
            req = seg.req
            lo, hi = req.vector_positions(seg.start, seg.start + seg.length)
            if lo < hi and req.vector.pooling != "labels":
                req.pool(torch.tensor([[float(t), 1.0] for t in req.token_ids(lo, hi)]), lo)
        return out


def test_scheduler_pools_across_chunks_and_mean_skips_the_cache():
    s, batches, _ = make(chunked_prefill_size=4)
    s.runner = PoolingRunner()
    ids = list(range(1, 12))
    run_until_idle(s, [request("gen", ids, max_new_tokens=1)])        # caches the prompt
    vec = {p: request(p, ids, max_new_tokens=0) for p in ("mean", "last", "cls")}
    for p, msg in vec.items():
        msg.vector = VectorRequest(p)
    run_until_idle(s, list(vec.values()))
    out = {o.rid: o for b in batches for o in b.outputs if o.finish is not None}
    want = {"mean": [np.mean(ids), 1.0], "last": [ids[-1], 1.0], "cls": [ids[0], 1.0]}
    for p, w in want.items():
        assert out[p].finish.type == "length" and out[p].new_ids == []
        w = np.array(w, dtype=np.float32) / np.linalg.norm(w)
        assert np.allclose(np.frombuffer(out[p].vector, dtype="<f4"), w, atol=1e-6), p
    assert out["mean"].cached_tokens == out["cls"].cached_tokens == 0
    assert out["last"].cached_tokens == len(ids) - 1 and out["gen"].vector is None
    assert_pool_idle(s)


@pytest.mark.parametrize("vector, max_new, is_embedding, fragment", [
    (VectorRequest("mean"), 3, False, "prefill-only"),
    (VectorRequest("max"), 0, False, "pooling must be"),
    (VectorRequest("labels", [VOCAB]), 0, False, "outside the vocabulary"),
    (VectorRequest("labels", []), 0, False, "label_token_ids must hold"),
    (None, 3, True, "--is-embedding"),
    (VectorRequest("labels", [1]), 0, True, "--is-embedding")])
def test_forged_or_refused_vector_requests_are_400(vector, max_new, is_embedding, fragment):
    s, batches, _ = make(is_embedding=is_embedding)
    msg = request("r", max_new_tokens=max_new)
    msg.vector = vector
    s.step([msg])
    assert fragment in finishes(batches)["r"].message
    assert finishes(batches)["r"].status_code == 400 and s.idle
    ok = request("ok", max_new_tokens=0)
    ok.vector = VectorRequest("last")
    run_until_idle(s, [ok])                         # and an embedding is served after
    assert finishes(batches)["ok"].type == "length"
    assert_pool_idle(s)


def vectors_served(runner, args, context: int) -> dict[str, np.ndarray]:
    """The real Scheduler on `runner` (rank 0 of its group), for vector requests of every
    pooling (prefilled in 8-token chunks, mixed with a generation), until idle."""
    from scheduler_proc.kv_manager import KVManager
    from scheduler_proc.scheduler import Scheduler
    kv = KVManager(pool_size=runner.pool_size, max_running=args.max_running_requests,
                   context_len=context, device=runner.device, use_cache=True)
    runner.share_table(kv.req_to_token)
    batches = []
    s = Scheduler(args, runner, kv, batches.append, lambda reply: None)
    ids = list(range(40, 70))
    msgs = [TokenizedRequest(rid="gen", input_ids=ids[:12], sampling=SamplingParams(
        max_new_tokens=5, temperature=0.0))]
    for rid, vector in [("mean", VectorRequest("mean")), ("last", VectorRequest("last")),
                        ("cls", VectorRequest("cls")), ("labels", VectorRequest("labels",
                                                                                [3, 9, 41]))]:
        msgs.append(TokenizedRequest(rid=rid, input_ids=ids, vector=vector,
                                     sampling=SamplingParams(max_new_tokens=0)))
    run_until_idle(s, msgs)
    runner.stop_followers()
    assert kv.pool.num_free + kv.evictable == kv.pool.size
    return {o.rid: np.frombuffer(o.vector, dtype="<f4") for b in batches for o in b.outputs
            if o.finish is not None and o.vector is not None}


def test_vectors_on_two_tensor_parallel_ranks_equal_one_rank(tiny_model):
    """Rank 0 pools the whole hidden rows alone; label logits are gathered over the ranks."""
    from launch import resolve_args
    from models.distributed import ThreadGroup
    from scheduler_proc import tp_worker
    from scheduler_proc.runner import ModelRunner
    from tests.test_tp_plan import Watchdog
    from wire.server_args import ServerArgs
    args = ServerArgs(model_path=str(tiny_model("llama")), max_total_tokens=600,
                      chunked_prefill_size=8, max_running_requests=4)
    config = resolve_args(args)
    want = vectors_served(ModelRunner(config), args, config.context_length)
    assert want.keys() == {"mean", "last", "cls", "labels"}

    def rank(g):
        runner = ModelRunner(config, tp=g)
        if g.rank == 0:
            return vectors_served(runner, args, config.context_length)
        tp_worker.follow(runner, Watchdog())
    got = ThreadGroup.run(2, rank)[0]
    for rid, v in want.items():
        assert np.allclose(got[rid], v, atol=1e-5), rid


# ---- end to end ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with serving(model_dir, "--chunked-prefill-size", str(CHUNK),
                 tmpdir=tmp_path_factory.mktemp("embed")) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


@torch.no_grad()
def reference(model_dir, ids: list[int], pooling: str = "last") -> np.ndarray:
    """transformers: hidden_states[-1] (after the final norm in Llama), pooled, normalized."""
    out = _load(model_dir)(torch.tensor([ids]), output_hidden_states=True)
    h = out.hidden_states[-1][0]
    pooled = {"last": h[-1], "cls": h[0], "mean": h.mean(0)}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


@torch.no_grad()
def next_token_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(_load(model_dir)(torch.tensor([ids])).logits[0, -1].float(), -1)


def embeddings(server, **body) -> dict:
    r = server.client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.e2e
def test_openai_sdk_single_string_equals_transformers(server, model_dir, tok):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        r = client.embeddings.create(model=str(model_dir), input="Hello there, world")
    ids = tok("Hello there, world")["input_ids"]
    assert len(r.data) == 1 and r.data[0].index == 0
    assert np.allclose(r.data[0].embedding, reference(model_dir, ids), atol=ATOL)
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(ids)


@pytest.mark.e2e
def test_batch_and_token_ids_as_floats(server, model_dir, tok):
    texts = ["a cat", LONG, "zebra"]                   # LONG spans several prefill chunks
    out = embeddings(server, input=texts, encoding_format="float")
    assert out["object"] == "list" and out["model"] == str(model_dir)
    ids = [tok(t)["input_ids"] for t in texts]
    assert len(ids[1]) > 2 * CHUNK
    for item, prompt in zip(out["data"], ids):
        assert item["object"] == "embedding"
        assert np.allclose(item["embedding"], reference(model_dir, prompt), atol=ATOL)
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids))
    by_ids = embeddings(server, input=ids[0])["data"]
    assert np.allclose(by_ids[0]["embedding"], out["data"][0]["embedding"], atol=ATOL)
    assert len(embeddings(server, input=ids[:2])["data"]) == 2


@pytest.mark.e2e
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_mean_and_cls_pooling_across_chunks(server, model_dir, tok, pooling):
    ids = tok(LONG)["input_ids"]
    embeddings(server, input=LONG)           # cached first: mean and cls must not use it
    out = embeddings(server, input=[LONG, "short"], pooling=pooling, encoding_format="base64")
    got = np.frombuffer(base64.b64decode(out["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(got, reference(model_dir, ids, pooling), atol=ATOL)
    short = np.frombuffer(base64.b64decode(out["data"][1]["embedding"]), dtype="<f4")
    assert np.allclose(short, reference(model_dir, tok("short")["input_ids"], pooling),
                       atol=ATOL)


@pytest.mark.e2e
def test_score_is_the_label_probabilities(server, model_dir, tok):
    labels = [5, 17, 300]
    r = server.client.post("/v1/score", json={"query": "The cat", "items": [" sat", " ran"],
                                              "label_token_ids": labels})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and out["model"] == str(model_dir)
    for item, scores in zip([" sat", " ran"], out["scores"]):
        want = next_token_logprobs(model_dir, tok("The cat" + item)["input_ids"])[labels].exp()
        assert scores == pytest.approx(want.tolist(), rel=1e-3, abs=1e-7)
    first = server.client.post("/v1/score", json={
        "query": tok(" sat", add_special_tokens=False)["input_ids"],
        "items": [tok("The cat")["input_ids"]], "label_token_ids": labels,
        "item_first": True, "apply_softmax": True}).json()["scores"][0]
    p = np.array(out["scores"][0])
    assert first == pytest.approx((p / p.sum()).tolist(), rel=1e-3)
    assert math.isclose(sum(first), 1.0, rel_tol=1e-6)


@pytest.mark.e2e
def test_rerank_orders_by_the_scores_of_v1_score(server, model_dir, tok):
    query = "Which animal barks?"
    docs = ["A dog barks at night.", "Cats purr.", "The sea is salty.", "Birds sing songs."]
    r = server.client.post("/v1/rerank", json={"query": query, "documents": docs,
                                               "top_n": 3, "return_documents": True})
    assert r.status_code == 200, r.text
    out = r.json()
    labels = [tok(w, add_special_tokens=False)["input_ids"][0] for w in RERANK_LABELS]
    head = rerank_prompt(query, "")[0]
    score = server.client.post("/v1/score", json={
        "query": head, "items": [rerank_prompt(query, d)[1] for d in docs],
        "label_token_ids": labels, "apply_softmax": True}).json()
    relevance = [s[0] for s in score["scores"]]
    order = sorted(range(len(docs)), key=lambda i: -relevance[i])
    assert [x["index"] for x in out["results"]] == order[:3]
    for x in out["results"]:
        assert x["relevance_score"] == pytest.approx(relevance[x["index"]], rel=1e-4)
        assert x["document"] == {"text": docs[x["index"]]}
    assert out["object"] == "list" and out["usage"]["prompt_tokens"] > 0
    plain = server.client.post("/rerank", json={"query": query, "documents": docs}).json()
    assert len(plain["results"]) == 4 and "document" not in plain["results"][0]


@pytest.mark.e2e
def test_bad_bodies_are_400s_and_the_pool_is_whole_after(server, model_dir):
    cases = [("/v1/embeddings", {"input": "a", "dimensions": 4}, 400, "dimensions"),
             ("/v1/embeddings", {"input": [[1, 99999]]}, 400, "outside the vocabulary"),
             ("/v1/embeddings", {"input": [1] * 600}, 400, "context length"),
             ("/v1/embeddings", {"input": "a", "model": "nope"}, 404, "does not exist"),
             ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400, "base64"),
             ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [10**9]}, 400,
              "outside the vocabulary"),
             ("/v1/score", {"query": "a", "items": [[1]], "label_token_ids": [1]}, 400,
              "both be text"),
             ("/v1/rerank", {"query": "a", "documents": "b"}, 400, "documents must be"),
             ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n")]
    for path, body, status, message in cases:
        r = server.client.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert message in err["message"] and err["code"] == status, (path, body, err)
    # an embedding batched with a long generation in the same steps, then nothing held
    with httpx.Client(base_url=server.url, timeout=60) as c:
        gen = c.build_request("POST", "/generate", json={
            "text": LONG, "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}})
        pending = c.send(gen, stream=True)
        assert len(embeddings(server, input=["x", LONG])["data"]) == 2
        pending.read()
        assert pending.status_code == 200
        pending.close()
    kv = wait_idle(server)["kv_pool"]
    assert kv["free"] + kv["evictable"] == kv["total"]
    info = server.client.get("/model_info").json()
    assert info["is_generation"] is True
    assert server.server_info()["pooling"] == "last"


@pytest.mark.e2e
def test_is_embedding_serves_embeddings_only(model_dir, tmp_path_factory, tok):
    """--is-embedding (with --pooling mean): embeddings as transformers gives them; the
    generation and score routes refuse naming the flag; /model_info says so;
    /health_generate still answers."""
    with serving(model_dir, "--is-embedding", "--pooling", "mean",
                 tmpdir=tmp_path_factory.mktemp("embed-tp")) as s:
        out = embeddings(s, input=[LONG, "zebra"])
        for item, text in zip(out["data"], [LONG, "zebra"]):
            want = reference(model_dir, tok(text)["input_ids"], "mean")
            assert np.allclose(item["embedding"], want, atol=ATOL)
        assert s.client.get("/model_info").json()["is_generation"] is False
        assert s.client.get("/health_generate").status_code == 200
        for path, body in [("/generate", {"text": "a"}),
                           ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [
                               {"role": "user", "content": "a"}]}),
                           ("/v1/score", {"query": "a", "items": ["b"],
                                          "label_token_ids": [1]}),
                           ("/v1/rerank", {"query": "a", "documents": ["b"]})]:
            r = s.client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "--is-embedding" in r.text, (path, r.text)
        wait_idle(s)
