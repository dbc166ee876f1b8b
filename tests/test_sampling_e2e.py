"""End to end: sampling parameters, seeds, logprobs and parallel sampling (n) through the
launched server, checked against transformers where there is an oracle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.server import serving

pytestmark = pytest.mark.e2e

PROMPT = [0, 45, 97, 210, 33, 18, 402]
SAMPLED = {"temperature": 2.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with serving(model_dir, tmpdir=tmp_path_factory.mktemp("srv")) as s:
        yield s


@pytest.fixture(scope="module")
def hf_log_softmax(model_dir):
    """log_softmax of transformers' logits at every position of prompt + continuation."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def test_seed_gives_the_same_output_alone_and_in_a_crowd(server):
    body = {"input_ids": PROMPT, "sampling_params": {**SAMPLED, "sampling_seed": 1234}}
    alone = server.generate_ok(**body)["output_ids"]
    crowd = [{"input_ids": PROMPT[:3] + [i + 50], "sampling_params": {
        **SAMPLED, "temperature": 0.5 + i / 8, "top_p": 0.9, "sampling_seed": i}}
        for i in range(16)]
    with ThreadPoolExecutor(17) as pool:
        futures = [pool.submit(server.generate_ok, **b) for b in crowd[:8]]
        mine = pool.submit(server.generate_ok, **body)
        futures += [pool.submit(server.generate_ok, **b) for b in crowd[8:]]
        assert mine.result()["output_ids"] == alone
        for f in futures:
            f.result()


def test_different_seeds_differ_and_greedy_ignores_seeds(server):
    outs = {seed: tuple(server.generate_ok(input_ids=PROMPT, sampling_params={
        **SAMPLED, "sampling_seed": seed})["output_ids"]) for seed in range(4)}
    assert len(set(outs.values())) == 4
    greedy = {tuple(server.generate_ok(input_ids=PROMPT, sampling_params={
        **SAMPLED, "temperature": 0, "sampling_seed": seed})["output_ids"])
        for seed in (None, 1, 2)}
    assert len(greedy) == 1


def test_output_logprobs_match_transformers(server, hf_log_softmax):
    out = server.generate_ok(input_ids=PROMPT, return_logprob=True, top_logprobs_num=3,
                             sampling_params={"temperature": 0, "max_new_tokens": 8,
                                              "ignore_eos": True})
    meta = out["meta_info"]
    ids = out["output_ids"]
    ref = hf_log_softmax(PROMPT + ids)
    assert len(meta["output_token_logprobs"]) == len(ids)
    for i, (logprob, token, text) in enumerate(meta["output_token_logprobs"]):
        assert token == ids[i] and text is None
        assert abs(logprob - ref[len(PROMPT) - 1 + i, token].item()) < 1e-3
        top = meta["output_top_logprobs"][i]
        assert len(top) == 3
        values = [t[0] for t in top]
        assert values == sorted(values, reverse=True)
        assert top[0][1] == token                     # greedy: the chosen one is the top
        assert abs(values[0] - ref[len(PROMPT) - 1 + i].max().item()) < 1e-3


def test_input_logprobs_match_transformers(server, hf_log_softmax):
    server.client.post("/flush_cache")
    out = server.generate_ok(input_ids=PROMPT, return_logprob=True, logprob_start_len=2,
                             return_text_in_logprobs=True, top_logprobs_num=2,
                             sampling_params={"temperature": 0, "max_new_tokens": 2})
    meta = out["meta_info"]
    ref = hf_log_softmax(PROMPT)
    got = meta["input_token_logprobs"]
    assert [t[1] for t in got] == PROMPT[2:]
    for q, (logprob, token, text) in zip(range(2, len(PROMPT)), got):
        assert abs(logprob - ref[q - 1, token].item()) < 1e-3
        assert isinstance(text, str)
    assert all(len(t) == 2 for t in meta["input_top_logprobs"])
    # From the start: the first token has no logprob; cached prompts are recomputed.
    again = server.generate_ok(input_ids=PROMPT, return_logprob=True, logprob_start_len=0,
                               sampling_params={"temperature": 0, "max_new_tokens": 2})
    first = again["meta_info"]["input_token_logprobs"]
    assert first[0] == [None, PROMPT[0], None]
    assert len(first) == len(PROMPT)
    for a, b in zip(first[2:], got):
        assert a[1] == b[1] and abs(a[0] - b[0]) < 1e-3


def test_streamed_logprobs_are_per_frame_in_incremental_and_cumulative(server):
    frames = server.stream(input_ids=PROMPT, return_logprob=True,
                           sampling_params={"temperature": 0, "max_new_tokens": 5,
                                            "ignore_eos": True})
    for f in frames:
        assert len(f["meta_info"]["output_token_logprobs"]) == len(f["output_ids"])


def test_n_samples_share_the_prompt(server):
    server.client.post("/flush_cache")
    prompt = PROMPT + [77, 78, 79]
    outs = server.generate_ok(input_ids=prompt, sampling_params={**SAMPLED, "n": 3})
    assert len(outs) == 3
    for o in outs:
        assert o["meta_info"]["cached_tokens"] == len(prompt) - 1
        assert o["meta_info"]["completion_tokens"] == SAMPLED["max_new_tokens"]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_min_new_tokens_delays_stop_tokens(server):
    greedy = {"temperature": 0, "max_new_tokens": 12}
    base = server.generate_ok(input_ids=PROMPT, sampling_params={**greedy, "ignore_eos": True})
    first = base["output_ids"][0]
    stopped = server.generate_ok(input_ids=PROMPT, sampling_params={
        **greedy, "stop_token_ids": [first]})
    assert stopped["output_ids"] == [first]
    held = server.generate_ok(input_ids=PROMPT, sampling_params={
        **greedy, "stop_token_ids": [first], "min_new_tokens": 3})
    assert len(held["output_ids"]) >= 4 or held["meta_info"]["finish_reason"]["type"] == "length"
    assert first not in held["output_ids"][:3]


def test_penalties_and_logit_bias(server):
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    biased = server.generate_ok(input_ids=PROMPT, sampling_params={
        **greedy, "logit_bias": {"9": 100.0}})
    assert biased["output_ids"] == [9] * 16
    penalized = server.generate_ok(input_ids=PROMPT, sampling_params={
        **greedy, "logit_bias": {"9": 5.0}, "frequency_penalty": 2.0})
    assert penalized["output_ids"].count(9) < 16
    rep = server.generate_ok(input_ids=PROMPT, sampling_params={
        **greedy, "repetition_penalty": 2.0, "presence_penalty": 2.0})
    assert len(set(rep["output_ids"])) >= 12
