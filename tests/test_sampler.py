"""The batched sampler: greedy, temperature/top-k/top-p/min-p frequencies, seeded rows."""

import pytest
import torch

from scheduler_proc.sampler import (SamplingBatch, apply_penalties, sample,
                                    seeded_generator)
from wire.sampling import SamplingParams

# A fixed 8-token distribution, most likely first, placed at shuffled vocab positions so a
# bug in mapping sorted positions back to token ids shows up.
P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
PERM = torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])         # token id of the i-th most likely
N = 10_000                                             # std of a frequency <= 0.005
TOL = 0.02                                             # 4 std; the draws are seeded


def frequencies(**sampling) -> torch.Tensor:
    """Sample N times from P with these params; return frequencies in rank order."""
    torch.manual_seed(0)
    logits = torch.empty(8)
    logits[PERM] = P.log()
    params = SamplingParams.from_json(sampling)
    batch = SamplingBatch.from_params([params] * N, vocab_size=8, device="cpu")
    tokens = sample(logits.expand(N, 8).contiguous(), batch)
    return torch.bincount(tokens, minlength=8).float()[PERM] / N


def expect(kept: int, weights: torch.Tensor = P) -> torch.Tensor:
    out = torch.zeros(8)
    out[:kept] = weights[:kept] / weights[:kept].sum()
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, atol=TOL), f"\n got {got.tolist()}\nwant {want.tolist()}"
    assert torch.equal(got > 0, want > 0), "a token outside the kept set was sampled"


def test_temperature_1_matches_distribution():
    assert_close(frequencies(), P)


def test_temperature_half_sharpens():
    assert_close(frequencies(temperature=0.5), expect(8, P**2))


def test_top_k_renormalizes_over_top_2():
    assert_close(frequencies(top_k=2), expect(2))            # 0.6, 0.4


@pytest.mark.parametrize("top_p, kept", [
    (0.25, 1),     # below the top token's mass: only it
    (0.49, 2),     # 0.30 < 0.49 <= 0.50: the first two reach it
    (0.51, 3),     # 0.50 < 0.51: needs the third
    (0.99, 8),     # 0.98 < 0.99: needs the last
])
def test_top_p_keeps_smallest_prefix_reaching_it(top_p, kept):
    assert_close(frequencies(top_p=top_p), expect(kept))


def test_top_p_applies_to_what_top_k_kept():
    # After top_k=3: 0.46, 0.31, 0.23. top_p=0.7 is reached by the first two.
    assert_close(frequencies(top_k=3, top_p=0.7), expect(2))


@pytest.mark.parametrize("extra", [{}, {"top_k": 6}], ids=["unsorted", "sorted"])
def test_min_p_drops_below_fraction_of_max(extra):
    # 0.45 * 0.30 = 0.135: keeps 0.30, 0.20, 0.15; drops 0.12 and below.
    assert_close(frequencies(min_p=0.45, **extra), expect(3))


def test_greedy_is_argmax():
    torch.manual_seed(1)
    logits = torch.randn(16, 1000)
    greedy = [SamplingParams.from_json({"temperature": 0}),
              SamplingParams.from_json({"top_k": 1, "temperature": 2.0})]
    batch = SamplingBatch.from_params(greedy * 8, 1000, "cpu")
    assert batch.all_greedy
    assert torch.equal(sample(logits, batch), logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch():
    torch.manual_seed(2)
    logits = torch.randn(8, 1000)
    params = [SamplingParams.from_json({"temperature": 0}),
              SamplingParams.from_json({"temperature": 1.5, "top_p": 0.9, "top_k": 50})] * 4
    batch = SamplingBatch.from_params(params, 1000, "cpu")
    assert not batch.all_greedy
    tokens = sample(logits, batch)
    assert tokens.dtype == torch.int64 and tokens.shape == (8,)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_batch_tensors():
    params = [SamplingParams.from_json(s) for s in (
        {}, {"top_k": 5}, {"top_k": 10_000}, {"temperature": 0, "top_p": 0.5})]
    batch = SamplingBatch.from_params(params, 100, "cpu")
    assert batch.temperatures.shape == (4, 1)
    assert batch.top_ks.tolist() == [100, 5, 100, 100]
    assert batch.top_ps.tolist() == [1.0, 1.0, 1.0, 1.0]      # greedy row is neutralized
    assert batch.is_greedy.tolist() == [False, False, False, True]
    assert (batch.need_top_k, batch.need_top_p, batch.need_min_p) == (True, False, False)
    assert not batch.need_penalties


@pytest.mark.parametrize("mine", [{"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.95}])
def test_seeded_row_ignores_the_rest_of_the_batch(mine):
    torch.manual_seed(3)
    vocab = 500
    row = torch.randn(1, vocab)
    others = torch.randn(4, vocab)
    other_params = [SamplingParams.from_json(s) for s in (
        {"temperature": 0}, {"top_k": 5}, {"top_p": 0.5, "min_p": 0.1}, {"temperature": 2})]
    params = SamplingParams.from_json(mine)
    seen = set()
    for seed in range(10):
        alone = sample(row, SamplingBatch.from_params([params], vocab, "cpu"),
                       [seeded_generator(seed, "cpu")])
        batch = SamplingBatch.from_params(other_params[:2] + [params] + other_params[2:],
                                          vocab, "cpu")
        logits = torch.cat([others[:2], row, others[2:]])
        for _ in range(3):                      # unseeded rows draw differently each time
            gens = [None, None, seeded_generator(seed, "cpu"), None, None]
            assert sample(logits, batch, gens)[2] == alone[0]
        seen.add(alone.item())
    assert len(seen) > 3                        # the seed matters


def test_apply_penalties():
    params = SamplingParams.from_json({"frequency_penalty": 0.5, "presence_penalty": 0.25,
                                       "repetition_penalty": 2.0, "logit_bias": {"2": 1.0}})
    batch = SamplingBatch.from_params([params, SamplingParams()], 3, "cpu")
    assert batch.need_penalties
    logits = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0]])
    counts = torch.tensor([[2, 1, 0], [2, 1, 0]])
    out = apply_penalties(logits, batch, counts)
    # row 0: 1/2 - 0.5*2 - 0.25 = -0.75; -1*2 - 0.5 - 0.25 = -2.75; 2 + bias 1 = 3
    assert torch.allclose(out[0], torch.tensor([-0.75, -2.75, 3.0]))
    assert torch.allclose(out[1], torch.tensor([1.0, -1.0, 2.0]))  # neutral row unchanged
