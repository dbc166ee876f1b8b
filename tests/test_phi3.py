"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM) end to end: greedy ids on /generate equal
transformers' Phi3ForCausalLM in unary, batch and streaming form, with the prefix cache and
without, on a tiny checkpoint (checkpoints/tiny.py's rules) with Phi-4-mini's partial rotary
(12 of each head's 16 dims) and Phi-3's longrope over an original context of 64 positions.

Where the short and long factors apply (models/rope.py): a prompt within 64 tokens whose
generation runs past 64 is transformers' own greedy run (its prefill takes the short
factors, each decode step from position 64 on the long ones, as zserve's table does); a
prompt longer than 64 is compared with transformers prefilled in two forwards split at 64,
which gives each position the factors zserve gives it (a single forward over the whole
prompt would take the long factors everywhere, tests/reference.py)."""

from __future__ import annotations

import pytest

from checkpoints.tiny import build_tiny_checkpoint
from tests.reference import assert_served_greedy
from tests.server import serving

pytestmark = pytest.mark.e2e
N = 24
ORIGINAL = 64           # the tiny config's original_max_position_embeddings
LONG = list(range(20, 110))                 # 90 tokens: prefilled past the original context
PROMPTS = [
    list(range(300, 350)),                  # 50 tokens: the generation crosses position 64
    [400, 12, 31, 77],                      # stays within the short factors
    LONG,
    LONG[:70] + [5, 600, 31, 200, 9],       # shares 70 tokens of LONG (the prefix cache's)
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3")


# without the prefix cache, prefill chunks of 24 tokens that straddle position 64: each
# position takes its factors whatever step computes it
@pytest.mark.parametrize("flags", [(), ("--disable-radix-cache", "--chunked-prefill-size", "24")],
                         ids=["prefix-cache", "no-prefix-cache-small-chunks"])
def test_greedy_equals_transformers(model, tmp_path, flags):
    with serving(model, *flags, tmpdir=tmp_path) as s:
        outs = assert_served_greedy(s, model, PROMPTS, N, split=ORIGINAL)
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    if flags:
        assert cached == [0] * len(outs)
    else:       # the last prompt reused LONG's first 70 (or more, once served itself)
        assert cached[3] >= 70 and all(c > 0 for c in cached[len(PROMPTS):])
