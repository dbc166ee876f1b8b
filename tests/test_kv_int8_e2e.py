"""End to end with an int8 KV cache (--kv-cache-dtype int8): a server whose pool holds each
K/V value in 8 bits (one float32 scale per 32 values of a head) decodes greedily like
transformers in float32, up to the reference's first near-tie; /server_info says what the
pool holds, and it empties again after the requests (no slot or scale leaks a request).

The checkpoint has heads of 32, so decode steps run on the attention kernel and every
layer in one C call (models/fast_decode.py), reading int8 K/V with their scales; prompts
are prefilled in chunks of 16, so every chunk after a prompt's first reads its prefix back
from the int8 pool too (the first attends its own K/V as computed: attention.py).

What a near tie is here: an int8 value is off by at most half a step, 1/254 of its block's
largest, the size of bfloat16's relative rounding (2^-9 to 2^-8), and only K and V are
rounded (not the weights, activations or logits, as under --dtype bfloat16). So the logits
move less than a bfloat16 stack's, for which test_bfloat16_e2e argues BF16_TIE = 1 logit;
the same margin is used, and the test asserts that enough decisive steps were compared.
"""

from __future__ import annotations

import random

import pytest
import torch

from checkpoints.tiny import build_tiny_checkpoint
from tests.reference import assert_greedy_match, assert_served_batch_greedy, greedy_reference
from tests.server import serving, wait_idle

pytestmark = pytest.mark.e2e

MAX_NEW = 16
TIE = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("wide"), "llama",
                                      hidden_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=192)
    with serving(model_dir, "--kv-cache-dtype", "int8", "--chunked-prefill-size", "16",
                 tmpdir=tmp_path_factory.mktemp("srv")) as s:
        s.model_dir = model_dir
        yield s


def test_server_info_says_int8(server):
    info = server.server_info()
    assert info["kv_cache_dtype"] == "int8" and info["dtype"] == "float32"


def test_greedy_matches_transformers(server):
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 700) for _ in range(n)] for n in (3, 17, 40, 90)]
    assert_served_batch_greedy(server, prompts, MAX_NEW, torch.float32, TIE)
    wait_idle(server)


def test_a_cached_prefix_reads_back_the_same(server):
    """The same prompt twice: the second hits the radix cache (its prefix read from the int8
    pool) and, greedy, continues with the same ids where the reference is decisive."""
    prompt = list(range(100, 150))
    body = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    first = server.generate_ok(input_ids=prompt, sampling_params=body)
    second = server.generate_ok(input_ids=prompt, sampling_params=body)
    assert second["meta_info"]["cached_tokens"] > 0
    ref_ids, margins = greedy_reference(server.model_dir, prompt, MAX_NEW)
    for out in (first, second):
        assert_greedy_match(out["output_ids"], ref_ids, margins, tie_tol=TIE)
    wait_idle(server)
