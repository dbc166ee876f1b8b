"""SmolLM3 (Llama with no RoPE on every no_rope_layer_interval-th layer) end to end: greedy
ids on /generate equal transformers' SmolLM3ForCausalLM, unary, in a batch and streamed, on
a tiny checkpoint (checkpoints/tiny.py's rules) whose every second layer has no RoPE,
without the prefix cache and in prefill chunks of 7 (with the cache: SmolLM3 served from
its GGUF, test_gguf.py)."""

from __future__ import annotations

import pytest

from checkpoints.tiny import build_tiny_checkpoint
from tests.reference import assert_served_greedy
from tests.server import serving

pytestmark = pytest.mark.e2e
N = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("smollm3"), "smollm3")


def test_greedy_equals_transformers(model, tmp_path):
    prompts = [[10, 200, 31, 77, 5, 600], [400, 12], list(range(20, 60))]
    with serving(model, "--disable-radix-cache", "--chunked-prefill-size", "7",
                 tmpdir=tmp_path) as s:
        assert_served_greedy(s, model, prompts, N)
