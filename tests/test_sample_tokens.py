"""Statistical tests of the scheduler's sampling entry point (sample_tokens): logit_bias,
penalties and min_new_tokens applied to a known distribution before drawing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from scheduler_proc.sampler import sample_tokens, seeded_generator, token_logprobs
from wire.sampling import SamplingParams

V = 8
DRAWS = 20000
TOL = 0.015


@dataclass
class FakeReq:
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def frequencies(logits: torch.Tensor, req: FakeReq, eos=()) -> torch.Tensor:
    torch.manual_seed(0)
    reqs = [req] * DRAWS
    ids = sample_tokens(logits.expand(DRAWS, V).clone(), reqs, list(eos))
    return torch.bincount(torch.tensor(ids), minlength=V).float() / DRAWS


def expected(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def test_logit_bias_shifts_the_distribution():
    logits = torch.zeros(1, V)
    req = FakeReq(SamplingParams.from_json({"logit_bias": {"3": math.log(3.0)}}))
    want = expected(torch.tensor([[0, 0, 0, math.log(3.0), 0, 0, 0, 0]]))[0]
    assert abs(want[3].item() - 3 / 10) < 1e-6
    assert torch.allclose(frequencies(logits, req), want, atol=TOL)


def test_frequency_and_presence_penalties_follow_output_counts():
    logits = torch.zeros(1, V)
    outputs = [1, 1, 2]                       # token 1 twice, token 2 once
    req = FakeReq(SamplingParams.from_json({"frequency_penalty": 0.5,
                                            "presence_penalty": 0.25}), outputs)
    shifted = torch.zeros(1, V)
    shifted[0, 1] = -(0.5 * 2 + 0.25)
    shifted[0, 2] = -(0.5 * 1 + 0.25)
    assert torch.allclose(frequencies(logits, req), expected(shifted)[0], atol=TOL)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    req = FakeReq(SamplingParams.from_json({"repetition_penalty": 2.0}), [0, 1])
    want = torch.tensor([[0.5, -2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(frequencies(logits, req), expected(want)[0], atol=TOL)


def test_min_new_tokens_bans_stop_tokens_then_releases_them():
    logits = torch.zeros(1, V)
    params = SamplingParams.from_json({"min_new_tokens": 2, "stop_token_ids": [5]})
    early = frequencies(logits, FakeReq(params, [0]), eos=[7])
    assert early[5] == 0 and early[7] == 0
    assert torch.allclose(early[[0, 1, 2, 3, 4, 6]], torch.full((6,), 1 / 6), atol=TOL)
    late = frequencies(logits, FakeReq(params, [0, 1]), eos=[7])
    assert torch.allclose(late, torch.full((V,), 1 / V), atol=TOL)
    ignoring_eos = SamplingParams.from_json({"min_new_tokens": 2, "ignore_eos": True})
    assert frequencies(logits, FakeReq(ignoring_eos, []), eos=[7])[7] > 0


def test_sample_tokens_leaves_the_logits_untouched():
    logits = torch.randn(2, V)
    before = logits.clone()
    reqs = [FakeReq(SamplingParams.from_json({"logit_bias": {"1": 5}, "frequency_penalty": 1,
                                              "min_new_tokens": 3, "stop_token_ids": [2]}),
                    [1, 1])] * 2
    sample_tokens(logits, reqs, [0])
    assert torch.equal(logits, before)


def test_token_logprobs_are_log_softmax_and_sorted_tops():
    logits = torch.randn(3, V)
    lp = token_logprobs(logits, [1, 4, 7], top_n=3)
    ref = torch.log_softmax(logits, dim=-1)
    assert lp.token_ids == [1, 4, 7]
    for i, t in enumerate([1, 4, 7]):
        assert abs(lp.logprobs[i] - ref[i, t].item()) < 1e-6
        assert lp.top_logprobs[i] == sorted(lp.top_logprobs[i], reverse=True)
        assert lp.top_ids[i][0] == ref[i].argmax().item()


def test_huge_logit_bias_saturates_instead_of_breaking_the_draw():
    logits = torch.zeros(1, V)
    req = FakeReq(SamplingParams.from_json({"logit_bias": {"2": 1e300, "5": -1e300}}))
    freq = frequencies(logits, req)
    assert freq[2] == 1.0 and freq[5] == 0.0


# ---- defect 1's requests: each gets a token, none raises ---------------------------------

def test_min_new_tokens_that_would_ban_every_token_yields():
    # temperature 0.7, min_new_tokens 2, every token a stop token: all values in range.
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    params = SamplingParams.from_json({"temperature": 0.7, "min_new_tokens": 2,
                                       "stop_token_ids": list(range(V))})
    ids = sample_tokens(logits, [FakeReq(params)] * 3, [0])
    assert ids == logits.argmax(-1).tolist()        # the raw model's choice


def test_min_new_tokens_ban_with_partial_stop_list_still_bans():
    logits = torch.zeros(1, V)
    logits[0, 3] = 5.0
    params = SamplingParams.from_json({"temperature": 0, "min_new_tokens": 2,
                                       "stop_token_ids": [3]})
    assert sample_tokens(logits, [FakeReq(params)], [7]) != [3]


@pytest.mark.parametrize("sampling", [
    {"top_p": 1e-300}, {"top_p": 1e-46}, {"temperature": 1e39}, {"temperature": 3.5e38,
                                                                  "min_new_tokens": 2},
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e-38},
    {"temperature": float("inf"), "min_new_tokens": 2},
    {"frequency_penalty": 1e300, "presence_penalty": -1e300},
    {"stop_token_ids": [10**6, -1], "min_new_tokens": 2},     # outside V: ignored
], ids=str)
def test_values_float32_cannot_carry_never_break_the_draw(sampling):
    # Built directly (as a forged message would be): the API would reject most of these.
    params = SamplingParams(**sampling)
    torch.manual_seed(2)
    logits = torch.randn(4, V)
    reqs = [FakeReq(params, [1, 2]), FakeReq(params, []), FakeReq(SamplingParams()),
            FakeReq(params, [5], seeded_generator(3, "cpu"))]
    for _ in range(20):
        ids = sample_tokens(logits, reqs, [0])
        assert len(ids) == 4 and all(0 <= t < V for t in ids)
        if params.min_new_tokens:
            assert ids[1] != 0 and ids[3] != 0         # under their minimum: EOS banned


def test_tiny_repetition_penalty_picks_the_boosted_token():
    # 1e-300 rounds to 0 in float32: a seen positive logit divided by it is +inf.
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0, 0.0, 0.1, 0.2]])
    req = FakeReq(SamplingParams(repetition_penalty=1e-300), [2])
    assert sample_tokens(logits, [req], []) == [2]
