"""Speculative decoding (--speculative-algorithm NGRAM, scheduler_proc/speculative.py).

Unit: the n-gram index and store propose what followed the longest latest match; the draft
length follows acceptance and the step's size; `verify` keeps the drafts up to the first
row whose token differs, and its sampled tokens are the model's distribution (chi-square,
fixed logits); KVManager.truncate gives the rejected positions' slots back.

Served (tiny llama, ZSERVE_SPEC_ROW_COST=0 so that every decoding request drafts as much as
it can, whatever the batch): random prompts give a random model nothing to draft from, so
each prompt is asked once to teach the server's n-gram store its greedy answer, then again
in every engine form, now drafting that answer (accepted) and, where the forms differ,
drafts that are wrong (rejected). Greedy ids equal transformers' (up to its first near tie)
unary, batched, streamed, concurrently, in prefill chunks of 7, under retraction in a tiny
pool, over two tensor-parallel ranks, and with prefix-cache hits; structured outputs,
penalties, stop strings, min_new_tokens, logprobs and seeded sampling give what the server
without speculation (the shared llama server) gives. A chi-square test over many seeded
draws of a tiny model's first three tokens, most of them kept from accepted drafts, against
the distribution transformers' logits define. The metrics: meta_info, /server_info and
/metrics count drafted and accepted tokens.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from scheduler_proc.kv_manager import KVManager
from scheduler_proc.request import Req
from scheduler_proc.runner import verify
from scheduler_proc.speculative import (NgramIndex, NgramProposer, NgramStore, SpecState,
                                        Speculator, cpu_step_cost, linear_step_cost)
from tests.reference import _load, assert_greedy_match, assert_output_greedy, \
    greedy_reference, shared_prefix_prompts
from tests.server import serving, wait_idle
from wire.messages import TokenizedRequest
from wire.sampling import SamplingParams

MAX_NEW = 24
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
SPEC = ("--speculative-algorithm", "NGRAM")
ALWAYS = {"ZSERVE_SPEC_ROW_COST": "0"}
P_VALUE = 1e-4          # a correct sampler fails a chi-square test this rarely


# ---------------------------------------------------------------------------------------
# Unit


class Tokens:
    """A request's token surface for the proposers."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.spec = tokens, SpecState()

    @property
    def seq_len(self) -> int:
        return len(self.tokens)

    def token_ids(self, lo: int, hi: int) -> list[int]:
        return self.tokens[lo:hi]


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    req = Tokens([5, 6, 7, 8, 9, 6, 7, 1, 2, 3, 4, 7])
    # The suffix (7,) last occurred before 1 2 3 4; no longer suffix occurred before.
    assert index.match(req, 3) == (1, [1, 2, 3])
    req.tokens += [1, 2]                         # ... 7 1 2: (7, 1, 2) occurred: 3 4 7 1 2
    assert index.match(req, 8) == (3, [3, 4, 7, 1, 2])
    req.tokens += [3]
    assert index.match(req, 2) == (3, [4, 7])    # grown incrementally, as when rebuilt
    assert NgramIndex(1, 3).match(Tokens(list(req.tokens)), 2) == (3, [4, 7])
    assert NgramIndex(2, 3).match(Tokens([1, 2, 3, 4]), 4) == (0, [])   # never itself


def test_ngram_store_drafts_a_finished_requests_answer():
    proposer = NgramProposer(2, 4, span=8)
    done = Tokens([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    done.output_ids = [15]
    proposer.finished(done)
    again = Tokens([10, 11, 12, 13])
    assert proposer.propose(again, 5) == [14, 15, 16, 17, 18]
    # Its own longer match wins over the store's shorter one.
    own = Tokens([1, 2, 12, 13, 99, 3, 1, 2, 12, 13])
    assert proposer.propose(own, 2) == [99, 3]
    store = NgramStore(1, 2, span=3)
    store.add([1, 2, 3, 4, 2, 9])
    assert store.match([7, 2]) == (1, (9,)) and store.match([1, 2]) == (2, (3, 4, 2))


def test_draft_length_follows_acceptance_and_the_batch():
    # The CPU's cost: 2 rows ~ 1.1 steps, 3 rows ~ 2.1 (two passes over the weights), 4
    # rows ~ 1.32 (one tile of 4), 8 ~ 2.3.
    assert cpu_step_cost(1) == pytest.approx(1.0) and cpu_step_cost(2) == pytest.approx(1.1)
    assert cpu_step_cost(3) > cpu_step_cost(4) and cpu_step_cost(9) > cpu_step_cost(8)
    spec = Speculator(NgramProposer(2, 4, 8), max_draft=8, step_cost=cpu_step_cost,
                      accept_lengths=[0] * 10)
    req = Tokens([1])

    def k(a, rows=1, cap=20):
        req.spec.accepted, req.spec.tried = a, 1.0
        return spec.draft_len(req, rows=rows, tokens=float(rows), cap=cap)
    assert k(0.6) == 3                  # (1 + .6 + .36 + .22) / 1.32 beats 1.6 / 1.1
    assert k(0.6, cap=2) == 1           # 3 rows cost two passes
    assert k(0.3) == 1 and k(0.05) == 0
    assert k(0.97) == 7                 # (1 + ... + .97^7) / 2.3
    assert k(0.9, rows=32) == 0         # another tile of weights for a few tokens
    always = Speculator(NgramProposer(2, 4, 8), max_draft=8, step_cost=linear_step_cost(0.0),
                        accept_lengths=[0] * 10)
    req.spec.accepted = 0.01
    assert always.draft_len(req, rows=40, tokens=40.0, cap=20) == 8
    spec.record(req, drafted=4, accepted=2)
    assert spec.accept_lengths[3] == 1 and spec.drafted_total == 4 and \
        spec.accepted_total == 2 and req.spec.verify_ct == 1


def _req(rid: str = "r", **sampling) -> Req:
    return Req(TokenizedRequest(rid=rid, input_ids=[1, 2, 3],
                                sampling=SamplingParams(max_new_tokens=64, **sampling)))


def test_verify_keeps_drafts_up_to_the_first_disagreement():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([4, 5, 6, 7]):
        logits[row, token] = 5.0
    greedy = _req(temperature=0)
    assert verify(logits, greedy, [4, 5, 6], eos_ids=[0]) == [4, 5, 6, 7]    # all + bonus
    assert verify(logits, greedy, [4, 9, 6], eos_ids=[0]) == [4, 5]          # 9 rejected
    assert verify(logits, greedy, [8, 5, 6], eos_ids=[0]) == [4]
    # Not plain greedy (a penalty): the rows are sampled one at a time, each after the
    # drafts before it (here the penalty is too small to change any choice), and the
    # output ids are as before.
    penalized = _req(temperature=0, frequency_penalty=0.1)
    assert verify(logits, penalized, [4, 5, 6], eos_ids=[0]) == [4, 5, 6, 7]
    assert penalized.output_ids == []
    # A stop token ends the kept tokens even where its draft agreed.
    stopping = _req(temperature=0, frequency_penalty=0.1)
    logits[1, 0] = 9.0
    assert verify(logits, stopping, [4, 0, 6], eos_ids=[0]) == [4, 0]


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Pearson's test: the chance a correct sampler gives a statistic this large (cells
    expected fewer than 5 times pooled into one)."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for o, e in zip(observed, expected):
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            obs.append(o)
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_verify_samples_the_models_distribution():
    """Row 0 is the next token's distribution whatever the draft; given that row 0 kept
    its draft, row 1's token is the distribution after it. Drafts here are the likeliest
    token or another, so both the accepted and the rejected paths are taken."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    p = [torch.softmax(row, -1).tolist() for row in logits]
    first, second = [0] * 6, [0] * 6
    n = 6000
    for seed in range(n):
        draft = [int(logits[0].argmax()) if seed % 3 else 2, 1]
        kept = verify(logits, _req(temperature=1.0, sampling_seed=seed), draft, eos_ids=[])
        assert kept[:-1] == draft[:len(kept) - 1]
        first[kept[0]] += 1
        if len(kept) > 1:
            second[kept[1]] += 1
    assert chi_square_p(first, [n * q for q in p[0]]) > P_VALUE, first
    accepted = sum(second)
    assert accepted > 1000, accepted
    assert chi_square_p(second, [accepted * q for q in p[1]]) > P_VALUE, second


def test_truncate_gives_the_rejected_positions_slots_back():
    kv = KVManager(pool_size=32, max_running=2, context_len=32, device="cpu",
                   use_cache=False)
    req = _req()
    empty = kv.pool.num_free
    kv.admit(req)
    kv.extend(req, 8)
    free = kv.pool.num_free
    kv.truncate(req, 5)
    assert len(req.slots) == 5 and kv.pool.num_free == free + 3
    assert kv.req_to_token.table[req.row, 5:8].tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError):
        kv.truncate(req, 6)
    kv.release(req)
    assert kv.pool.num_free == empty


# ---------------------------------------------------------------------------------------
# Served

CONFIGS = {
    "chunks": ("--chunked-prefill-size", "7"),
    "tiny-pool": ("--max-total-tokens", "160", "--chunked-prefill-size", "16"),
    "tp2": ("--tp-size", "2", "--chunked-prefill-size", "16"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def server(request, tiny_model, tmp_path_factory):
    with serving(tiny_model("llama"), *SPEC, *CONFIGS[request.param],
                 tmpdir=tmp_path_factory.mktemp("spec"), env=ALWAYS) as s:
        s.config, s.model_dir = request.param, tiny_model("llama")
        yield s


def spec_of(outs) -> tuple[int, int]:
    """(drafted, accepted) over some outputs' meta_info."""
    return (sum(o["meta_info"]["spec_draft_token_num"] for o in outs),
            sum(o["meta_info"]["spec_accept_token_num"] for o in outs))


def concurrently(server, prompts, params):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: server.generate_ok(input_ids=p, sampling_params=params),
                             prompts))


@pytest.mark.e2e
def test_greedy_in_every_form_matches_transformers(server):
    prompts = shared_prefix_prompts(11, 4, prefix_len=30)
    first = [server.generate_ok(input_ids=p, sampling_params=GREEDY) for p in prompts]
    forms = {"unary": [server.generate_ok(input_ids=p, sampling_params=GREEDY)
                       for p in prompts],
             "batch": server.generate_ok(input_ids=prompts, sampling_params=GREEDY),
             "concurrent": concurrently(server, prompts, GREEDY),
             "stream": [server.stream(input_ids=p, sampling_params=GREEDY)[-1]
                        for p in prompts[:2]]}
    for name, outs in {"first": first, **forms}.items():
        for p, out in zip(prompts, outs):
            assert_output_greedy(server.model_dir, p, out, MAX_NEW)
    drafted, accepted = spec_of([o for outs in forms.values() for o in outs])
    assert accepted >= MAX_NEW * len(prompts), (drafted, accepted)     # answers drafted
    # Teach the store a wrong answer (each prompt, its answer's first two tokens, then
    # another token): asked again, each drafts its second token (accepted) and the wrong
    # ones (rejected, their KV given back), and goes on from there.
    for p, out in zip(prompts, first):
        g = out["output_ids"]
        wrong = 5 if g[2] != 5 else 6
        server.generate_ok(input_ids=p + g[:2] + [wrong] * 6,
                           sampling_params={"temperature": 0, "max_new_tokens": 1})
    outs = [server.generate_ok(input_ids=p, sampling_params=GREEDY) for p in prompts]
    for p, out in zip(prompts, outs):
        assert_output_greedy(server.model_dir, p, out, MAX_NEW)
    drafted, accepted = spec_of(outs)
    assert drafted > accepted > 0, (drafted, accepted)
    wait_idle(server)
    if server.config != "tiny-pool":
        assert max(o["meta_info"]["cached_tokens"] for o in forms["unary"]) >= 30


@pytest.mark.e2e
def test_retraction_with_drafts_keeps_outputs_exact(server):
    if server.config != "tiny-pool":
        pytest.skip("only the tiny pool retracts")
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 700) for _ in range(10)] for _ in range(6)]
    params = {**GREEDY, "max_new_tokens": 60}
    before = server.server_info()["retracted_total"]
    for _ in range(2):              # the second time drafting the first time's answers
        outs = concurrently(server, prompts, params)
        for p, out in zip(prompts, outs):
            assert_output_greedy(server.model_dir, p, out, 60)
    assert spec_of(outs)[1] > 0
    info = wait_idle(server)
    assert info["retracted_total"] > before, "the tiny pool should force a retraction"


@pytest.fixture(scope="module")
def spec_server(tiny_model, tmp_path_factory):
    """The shared llama server's flags, and speculation."""
    with serving(tiny_model("llama"), *SPEC, tmpdir=tmp_path_factory.mktemp("spec1"),
                 env=ALWAYS) as s:
        s.model_dir = tiny_model("llama")
        yield s


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}}
VARIANTS = {
    "json_schema": {"json_schema": SCHEMA, "max_new_tokens": 60},
    "regex": {"regex": r"[a-e]{3,12}( [a-e]{2,5}){2}", "max_new_tokens": 40},
    "penalties": {"frequency_penalty": 0.6, "presence_penalty": 0.3,
                  "repetition_penalty": 1.2},
    "stop": {"stop": ["e"], "min_new_tokens": 3},
    "min_new": {"min_new_tokens": 20, "ignore_eos": False},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 5},
}


@pytest.mark.e2e
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_sampling_form_gives_what_it_gives_without_drafts(variant, spec_server,
                                                               llama_server):
    """The same request to a server without speculation and, twice, to one with it (the
    second time drafting the first answer): the same ids (greedy: at these margins float
    rounding never flips a choice, tests/reference.py; seeded: each output token takes one
    draw of the request's generator either way, so a flip needs a draw within float
    rounding of a boundary), and logprobs within float32 rounding of the logits."""
    params = {**GREEDY, **VARIANTS[variant]}
    body = {"text": "The list: a b c d a b c", "sampling_params": params,
            "return_logprob": True}
    plain = llama_server.generate_ok(**body)
    outs = [spec_server.generate_ok(**body) for _ in range(2)]
    for out in outs:
        assert out["output_ids"] == plain["output_ids"], (variant, out, plain)
        assert out["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
        ours = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        theirs = [t[0] for t in plain["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    if len(plain["output_ids"]) > 2:
        assert outs[1]["meta_info"]["spec_accept_token_num"] > 0, outs[1]["meta_info"]
    wait_idle(spec_server)


@pytest.mark.e2e
def test_sampled_tokens_have_the_models_distribution(spec_server):
    """Seeded draws of the tiny model's first three tokens at temperature 1.5, top_k 3 (27
    possible sequences), most of the second and third tokens kept from accepted drafts
    (the n-gram store drafts what the earlier draws said), against the probabilities
    transformers' logits give each sequence under the same top-k and temperature."""
    prompt = shared_prefix_prompts(13, 1, prefix_len=12)[0]
    params = {"temperature": 1.5, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True}
    spec_server.generate_ok(input_ids=prompt, sampling_params={**params, "temperature": 0})
    n, counts, kept = 1200, {}, 0
    for lo in range(0, n, 200):
        outs = spec_server.generate_ok(
            input_ids=[prompt] * 200,
            sampling_params=[{**params, "sampling_seed": lo + i} for i in range(200)])
        for out in outs:
            key = tuple(out["output_ids"])
            counts[key] = counts.get(key, 0) + 1
            kept += out["meta_info"]["spec_accept_token_num"]
    assert kept > n // 2, f"only {kept} tokens came from accepted drafts"
    model = _load(spec_server.model_dir)

    @torch.no_grad()
    def top3(ids):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        values, tokens = logits.topk(3)
        return dict(zip(tokens.tolist(), torch.softmax(values / 1.5, -1).tolist()))
    expected = {}
    for a, pa in top3(prompt).items():
        for b, pb in top3(prompt + [a]).items():
            for c, pc in top3(prompt + [a, b]).items():
                expected[(a, b, c)] = pa * pb * pc
    assert set(counts) <= set(expected), set(counts) - set(expected)
    keys = sorted(expected)
    p = chi_square_p([counts.get(k, 0) for k in keys], [n * expected[k] for k in keys])
    assert p > P_VALUE, (p, counts)
    wait_idle(spec_server)


@pytest.mark.e2e
def test_speculation_is_counted(spec_server, llama_server):
    prompt = shared_prefix_prompts(17, 1)[0]
    outs = [spec_server.generate_ok(input_ids=prompt, sampling_params=GREEDY)
            for _ in range(2)]
    meta = outs[1]["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_token_num"] >= MAX_NEW // 2
    assert meta["spec_accept_rate"] == meta["spec_accept_token_num"] / \
        meta["spec_draft_token_num"]
    assert meta["spec_accept_length"] == (meta["spec_accept_token_num"] +
                                          meta["spec_verify_ct"]) / meta["spec_verify_ct"]
    info = wait_idle(spec_server)
    spec = info["speculative"]
    assert spec["verify_steps"] == sum(spec["accept_length_hist"]) >= 1
    assert info["internal_states"][0]["avg_spec_accept_length"] == spec["accept_length"]
    text = spec_server.client.get("/metrics").text
    for name in ("spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_accept_rate",
                 "spec_accept_length", "spec_verify_step_tokens_bucket"):
        assert f"zserve:{name}{{" in text, name
    plain = llama_server.generate_ok(input_ids=prompt, sampling_params=GREEDY)
    assert "spec_verify_ct" not in plain["meta_info"]
    assert "speculative" not in llama_server.server_info()
    assert "zserve:spec_" not in llama_server.client.get("/metrics").text


# ---------------------------------------------------------------------------------------
# A draft model (STANDALONE)


def perturbed_copy(model_dir, out_dir, scale: float, seed: int = 0):
    """A copy of a checkpoint with every weight moved by scale x its tensor's std of
    noise: a draft that agrees with its target often, not always."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, out_dir)
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                t += torch.randn(t.shape, generator=gen, dtype=t.dtype) * t.float().std() * scale
        save_file(tensors, f, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def draft_server(tiny_model, tmp_path_factory):
    target = tiny_model("llama")
    draft = perturbed_copy(target, tmp_path_factory.mktemp("draft") / "model", 0.01)
    with serving(target, "--speculative-algorithm", "STANDALONE",
                 "--speculative-draft-model-path", str(draft), "--max-total-tokens", "160",
                 "--chunked-prefill-size", "16", tmpdir=tmp_path_factory.mktemp("spec2"),
                 env=ALWAYS) as s:
        s.model_dir = target
        yield s


@pytest.mark.e2e
def test_draft_model_keeps_the_greedy_ids(draft_server):
    """A perturbed copy of the target as its draft model (often right, not always): greedy
    ids equal transformers' unary, batched, concurrently, streamed and under retraction
    in a pool of 160 tokens; drafts were kept and rejected."""
    s = draft_server
    prompts = shared_prefix_prompts(19, 4, prefix_len=20)
    forms = [[s.generate_ok(input_ids=p, sampling_params=GREEDY) for p in prompts],
             s.generate_ok(input_ids=prompts, sampling_params=GREEDY),
             concurrently(s, prompts, GREEDY),
             [s.stream(input_ids=p, sampling_params=GREEDY)[-1] for p in prompts[:2]]]
    for outs in forms:
        for p, out in zip(prompts, outs):
            assert_output_greedy(s.model_dir, p, out, MAX_NEW)
    rng = random.Random(7)
    long = [[rng.randrange(5, 700) for _ in range(10)] for _ in range(6)]
    before = s.server_info()["retracted_total"]
    for p, out in zip(long, concurrently(s, long, {**GREEDY, "max_new_tokens": 60})):
        assert_output_greedy(s.model_dir, p, out, 60)
    info = wait_idle(s)
    assert info["retracted_total"] > before, "the pool of 160 should force a retraction"
    spec = info["speculative"]
    assert spec["draft_tokens"] > spec["accepted_tokens"] > spec["draft_tokens"] // 5, spec


@pytest.mark.e2e
@pytest.mark.parametrize("variant", ["json_schema", "penalties", "seeded"])
def test_draft_model_samples_as_without_drafts(variant, draft_server, llama_server):
    params = {**GREEDY, **VARIANTS[variant]}
    body = {"text": "The list: a b c d a b c", "sampling_params": params}
    assert draft_server.generate_ok(**body)["output_ids"] == \
        llama_server.generate_ok(**body)["output_ids"]


def test_a_draft_model_is_asked_for_with_its_path(tmp_path):
    from wire.server_args import ServerArgs
    with pytest.raises(SystemExit):
        ServerArgs(speculative_algorithm="STANDALONE").check()
    with pytest.raises(SystemExit):
        ServerArgs(speculative_draft_model_path=str(tmp_path)).check()
    with pytest.raises(SystemExit):
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(
            tmp_path / "missing")).check()
    with pytest.raises(SystemExit):
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(
            tmp_path), tp_size=2).check()
    ServerArgs(speculative_algorithm="STANDALONE",
               speculative_draft_model_path=str(tmp_path)).check()


def test_a_failing_proposer_costs_its_request_only_its_drafts(caplog):
    """The scheduler with test_scheduler_unit's fake runner: a proposer that raises leaves
    the request drafting nothing that step; it ends as it would have, the pool whole."""
    from test_scheduler_unit import finishes, make, request, run_until_idle, token_after
    from scheduler_proc.speculative import Proposer

    class Broken(Proposer):
        def propose(self, req, k):
            raise RuntimeError("the draft model fell over")
    s, batches, _ = make()
    s.spec = Speculator(Broken(), 4, linear_step_cost(0.0), accept_lengths=[0] * 6)
    run_until_idle(s, [request("a", max_new_tokens=6, ignore_eos=True)])
    assert finishes(batches)["a"].type == "length"
    ids = [i for b in batches for o in b.outputs for i in o.new_ids]
    assert ids == [token_after(3 + i) for i in range(6)]
    assert s.kv.pool.num_free + s.kv.evictable == s.kv.pool.size
    assert "proposing drafts for request a failed" in caplog.text
