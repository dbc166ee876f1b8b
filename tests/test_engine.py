"""End to end: the engine's memory system keeps outputs exact.

Greedy output equals transformers' with the radix cache on and off, with prompts sharing
long prefixes, with chunked prefill forced by a tiny chunk, and with retraction forced by a
tiny KV pool; cached_tokens is reported; the pool is whole again once idle. One config
turns our CPU kernels off (ZSERVE_CPU_KERNELS=0), so torch's fallback path is held to the
same checks. One runs the model over two tensor-parallel ranks (--tp-size 2, with the radix
cache and small prefill chunks), for llama and qwen3: the same checks, and for llama the
same ids as the one-rank server. The families with sliding-window attention (Gemma 2 and 3,
a Mistral with a window) run with windows of 8 positions, which every prompt here reaches
past: Gemma 3 under the radix cache, tiny chunks without it, and two ranks; Gemma 2 and
the windowed Mistral in tiny chunks without it (Gemma 2 with it: served from its GGUF in
test_gguf.py).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from models import kernels
from tests.conftest import FAMILIES
from tests.reference import (assert_greedy_match, assert_output_greedy, greedy_reference,
                             shared_prefix_prompts as prompts)
from tests.server import serving, wait_idle

pytestmark = pytest.mark.e2e

MAX_NEW = 20
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
CONFIGS = {                                    # name: (flags, environment)
    "radix": ((), None),
    "no-radix-tiny-chunk": (("--disable-radix-cache", "--chunked-prefill-size", "7"), None),
    "tiny-pool": (("--max-total-tokens", "160", "--chunked-prefill-size", "16"), None),
    "torch-kernels": (("--chunked-prefill-size", "16"), {"ZSERVE_CPU_KERNELS": "0"}),
    "tp2": (("--tp-size", "2", "--chunked-prefill-size", "16"), None),
}
CACHING = ("radix", "tp2")          # the radix cache on, default pool


def check(model_dir, prompt: list[int], out: dict, max_new: int = MAX_NEW) -> None:
    assert_output_greedy(model_dir, prompt, out, max_new)


# Every engine configuration on one family, every family on the default configuration:
# the configurations exercise the scheduler, the families the model file, and each
# server launch costs seconds.
SERVERS = [("llama", config) for config in CONFIGS] + \
    [(family, "radix") for family in FAMILIES if family != "llama"] + [("qwen3", "tp2")] + \
    [("gemma3", config) for config in ("radix", "no-radix-tiny-chunk", "tp2")] + \
    [("gemma2", "no-radix-tiny-chunk"), ("mistral_window", "no-radix-tiny-chunk")]


@pytest.fixture(scope="module", params=SERVERS, ids=[f"{f}-{c}" for f, c in SERVERS])
def server(request, tiny_model, tmp_path_factory):
    family, config = request.param
    flags, env = CONFIGS[config]
    if config == "torch-kernels" and not (kernels.available("cpu", torch.float32)
                                          or kernels.avx2_available("cpu")):
        pytest.skip("no CPU kernels on this machine: every configuration runs torch's path")
    if (family, config) == ("llama", "radix"):          # default flags: the shared server
        s = request.getfixturevalue("llama_server")
        s.config, s.model_dir, s.family = config, tiny_model(family), family
        yield s
        return
    with serving(tiny_model(family), *flags, tmpdir=tmp_path_factory.mktemp("srv"),
                 env=env) as s:
        s.config, s.model_dir, s.family = config, tiny_model(family), family
        yield s


def test_shared_prefixes_concurrently_match_transformers(server):
    ps = prompts(1, 8)
    first = server.generate_ok(input_ids=ps[0], sampling_params=GREEDY)
    check(server.model_dir, ps[0], first)
    with ThreadPoolExecutor(len(ps)) as pool:
        outs = list(pool.map(lambda p: server.generate_ok(input_ids=p, sampling_params=GREEDY),
                             ps))
    for p, out in zip(ps, outs):
        check(server.model_dir, p, out)
    info = wait_idle(server)
    pool_ = info["kv_pool"]
    assert pool_["free"] + pool_["evictable"] == pool_["total"], pool_
    if server.config in CACHING:
        assert max(o["meta_info"]["cached_tokens"] for o in outs) >= 48


def test_stream_matches_transformers(server):
    """A streamed request's last frame (cumulative: frames may be coalesced on a loaded
    machine) holds transformers' greedy ids."""
    p = prompts(8, 1, prefix_len=20)[0]
    frames = server.stream(input_ids=p, sampling_params=GREEDY)
    check(server.model_dir, p, frames[-1])


def test_retraction_keeps_outputs_exact(server):
    """Outputs grow past what admission reserved for them: in the tiny pool some requests
    must be retracted and recomputed, and their outputs must not change."""
    rng = random.Random(7)
    ps = [[rng.randrange(5, 700) for _ in range(10)] for _ in range(6)]
    params = {**GREEDY, "max_new_tokens": 60}
    before = server.server_info()["retracted_total"]
    with ThreadPoolExecutor(len(ps)) as pool:
        outs = list(pool.map(lambda p: server.generate_ok(input_ids=p, sampling_params=params),
                             ps))
    for p, out in zip(ps, outs):
        check(server.model_dir, p, out, max_new=60)
    info = wait_idle(server)
    if server.config == "tiny-pool":
        assert info["retracted_total"] > before, "the tiny pool should force a retraction"
    kv = info["kv_pool"]
    assert kv["free"] + kv["evictable"] == kv["total"], kv


def test_batch_with_long_prompt_and_tiny_chunks(server):
    ps = prompts(2, 3, prefix_len=100)
    outs = server.generate_ok(input_ids=ps, sampling_params=GREEDY)
    for p, out in zip(ps, outs):
        check(server.model_dir, p, out)


def test_cached_tokens(server):
    if server.config == "no-radix-tiny-chunk":
        p = prompts(3, 1)[0]
        for _ in range(2):
            out = server.generate_ok(input_ids=p, sampling_params=GREEDY)
            assert out["meta_info"]["cached_tokens"] == 0
        return
    server.client.post("/flush_cache")
    p = prompts(4, 1)[0]
    a = server.generate_ok(input_ids=p, sampling_params=GREEDY)
    assert a["meta_info"]["cached_tokens"] == 0
    b = server.generate_ok(input_ids=p, sampling_params=GREEDY)
    assert b["meta_info"]["cached_tokens"] == len(p) - 1
    assert b["output_ids"] == a["output_ids"]
    # A prompt that extends the first one (diverging from its output) shares the prompt.
    extra = next(t for t in range(5, 700) if t != a["output_ids"][0])
    c = server.generate_ok(input_ids=p + [extra, 9, 10], sampling_params=GREEDY)
    assert c["meta_info"]["cached_tokens"] == len(p)
    check(server.model_dir, p + [extra, 9, 10], c)


def test_burst_leaves_the_pool_whole(server):
    rng = random.Random(5)
    bodies = [{"input_ids": [rng.randrange(5, 700) for _ in range(rng.randrange(2, 40))],
               "sampling_params": {"max_new_tokens": rng.randrange(1, 30), "ignore_eos": True,
                                   "temperature": rng.choice([0, 0.8])}}
              for _ in range(64)]
    with ThreadPoolExecutor(64) as pool:
        outs = list(pool.map(lambda b: server.generate_ok(**b), bodies))
    for b, out in zip(bodies, outs):
        assert out["meta_info"]["completion_tokens"] == b["sampling_params"]["max_new_tokens"]
    info = wait_idle(server)
    kv = info["kv_pool"]
    assert kv["free"] + kv["evictable"] == kv["total"], kv
    r = server.client.post("/flush_cache")
    assert r.status_code == 200, r.text
    kv = server.server_info()["kv_pool"]
    assert kv["free"] == kv["total"] and kv["evictable"] == 0, kv


def test_request_that_can_never_fit_is_a_400(server):
    if server.config != "tiny-pool":
        pytest.skip("only the tiny pool is smaller than this request")
    r = server.generate(input_ids=list(range(5, 105)), sampling_params={"max_new_tokens": 100})
    assert r.status_code == 400, r.text
    assert "KV slots" in r.json()["error"]["message"]
    assert server.generate_ok(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})


def test_tensor_parallel_ranks_give_the_one_rank_ids(server, request):
    """Row-parallel sums change float rounding only: where transformers' choice is clear,
    two ranks and one rank (the shared llama server) pick the same ids."""
    if (server.family, server.config) != ("llama", "tp2"):
        pytest.skip("the llama tensor-parallel server only")
    one_rank = request.getfixturevalue("llama_server")
    ps = prompts(6, 4, prefix_len=30)
    ours = server.generate_ok(input_ids=ps, sampling_params=GREEDY)
    theirs = one_rank.generate_ok(input_ids=ps, sampling_params=GREEDY)
    for p, a, b in zip(ps, ours, theirs):
        ref_ids, margins = greedy_reference(server.model_dir, p, MAX_NEW)
        assert_greedy_match(a["output_ids"], b["output_ids"], margins)
    wait_idle(one_rank)
