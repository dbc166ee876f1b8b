"""SmolLM3 (Llama with no RoPE on every no_rope_layer_interval-th layer) end to end: greedy
ids on /generate equal transformers' SmolLM3ForCausalLM, alone and in a batch, on a tiny
checkpoint (checkpoints/tiny.py's rules) whose every second layer has no RoPE."""

from __future__ import annotations

import pytest

from checkpoints.tiny import build_tiny_checkpoint
from tests.reference import first_near_tie, greedy_reference
from tests.server import serving

pytestmark = pytest.mark.e2e
N = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("smollm3"), "smollm3")


def test_greedy_equals_transformers(model, tmp_path):
    prompts = [[10, 200, 31, 77, 5, 600], [400, 12], list(range(20, 60))]
    with serving(model, tmpdir=tmp_path) as s:
        outs = s.generate_ok(input_ids=prompts, sampling_params={
            "max_new_tokens": N, "temperature": 0, "ignore_eos": True})
        alone = s.generate_ok(input_ids=prompts[0], sampling_params={
            "max_new_tokens": N, "temperature": 0, "ignore_eos": True})
    assert alone["output_ids"] == outs[0]["output_ids"]
    for ids, out in zip(prompts, outs):
        want, margins = greedy_reference(model, ids, N)
        tie = first_near_tie(margins)
        n = N if tie is None else tie
        assert n >= 4 and out["output_ids"][:n] == want[:n]
