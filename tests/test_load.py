"""End to end under load, on one server whose KV pool is far smaller than the load needs:
many concurrent greedy requests (forcing retraction) and streaming clients that hang up at
random points. The oracle is each prompt's greedy output run alone on the same server (up
to near-ties, judged by that solo run's top-1 / top-2 logprob margins); afterwards nothing
runs or waits and the pool is back at its idle invariant (free + evictable == total)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx
import pytest

from tests.reference import assert_greedy_match
from tests.server import serving, wait_idle

pytestmark = pytest.mark.e2e

CONTEXT = 512        # the tiny checkpoints' context length
POOL = 600           # KV slots: ~15 of the requests below at once, against 64 concurrent
NUM_PROMPTS = 32
MAX_NEW = 24
LONG_NEW = 400       # two of these at once outgrow the pool (2 x 400 > POOL) by themselves
TOKENS = (10, 700)   # prompt ids valid for the tiny tokenizer's 754-token vocabulary


@dataclass(frozen=True)
class Solo:
    """A prompt's greedy output when it ran alone, and the margin behind each token."""
    prompt: list[int]
    ids: list[int]
    margins: list[float]

    def check(self, ours: list[int], max_new: int) -> None:
        assert_greedy_match(ours, self.ids[:max_new], self.margins[:max_new])


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(tiny_model("llama"), "--max-total-tokens", str(POOL),
                 tmpdir=tmp_path_factory.mktemp("srv")) as s:
        yield s


@pytest.fixture(scope="module")
def solos(server) -> list[Solo]:
    """NUM_PROMPTS seeded prompts (8..24 tokens), each run alone, one after another."""
    rng = random.Random(2)
    out = []
    for _ in range(NUM_PROMPTS):
        prompt = [rng.randrange(*TOKENS) for _ in range(rng.randrange(8, 25))]
        r = server.generate_ok(input_ids=prompt, return_logprob=True, top_logprobs_num=2,
                               sampling_params={**greedy(MAX_NEW)})
        top = r["meta_info"]["output_top_logprobs"]
        out.append(Solo(prompt, r["output_ids"], [t[0][0] - t[1][0] for t in top]))
        assert len(out[-1].ids) == MAX_NEW
    return out


@pytest.fixture(scope="module")
def long_solo(server, solos) -> Solo:
    """One seeded prompt run alone for LONG_NEW tokens. After it and the solos (over a
    thousand steps alone) the scheduler's estimate of what a request will still need is at
    its floor, so two of these are admitted together, and together they must be retracted."""
    rng = random.Random(5)
    prompt = [rng.randrange(*TOKENS) for _ in range(16)]
    r = server.generate_ok(input_ids=prompt, return_logprob=True, top_logprobs_num=2,
                           sampling_params=greedy(LONG_NEW))
    top = r["meta_info"]["output_top_logprobs"]
    assert len(r["output_ids"]) == LONG_NEW
    return Solo(prompt, r["output_ids"], [t[0][0] - t[1][0] for t in top])


def greedy(max_new: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def assert_pool_idle(info: dict) -> None:
    kv = info["kv_pool"]
    assert kv["total"] == POOL, kv
    assert kv["free"] + kv["evictable"] == kv["total"], kv


def async_client(server, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=120.0,
                             limits=httpx.Limits(max_connections=connections,
                                                 max_keepalive_connections=connections))


async def unary(client: httpx.AsyncClient, body: dict) -> dict:
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def stream(client: httpx.AsyncClient, body: dict, hang_up_after: int | None = None):
    """A streaming /generate; returns its frames. With hang_up_after=k the client reads k
    frames (0: only the response head) and closes the connection."""
    frames = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        if hang_up_after == 0:
            return frames
        async for line in r.aiter_lines():
            if not line or line.startswith(":"):        # an SSE comment: keep-alive
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                assert hang_up_after is None, "the request ended before its client hung up"
                return frames
            frames.append(json.loads(line[len("data: "):]))
            if len(frames) == hang_up_after:
                return frames
    raise AssertionError("the stream ended without data: [DONE]")


async def run_normal(client, solo: Solo, max_new: int, streaming: bool) -> None:
    """A client that reads its whole answer, which must equal the solo run's."""
    body = {"input_ids": solo.prompt, "sampling_params": greedy(max_new)}
    out = (await stream(client, body))[-1] if streaming else await unary(client, body)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": max_new}
    solo.check(out["output_ids"], max_new)


def test_200_requests_at_concurrency_64_retract_and_match_solo(server, solos, long_solo):
    """Acceptance check 2: 64 clients share 200 requests on a pool that holds ~15 of them,
    while two requests that outgrow the pool together run: the scheduler must retract, and
    every output still equals its solo greedy output."""
    before = wait_idle(server)
    rng = random.Random(3)
    jobs = [(solos[i % NUM_PROMPTS], rng.choice((12, 16, 20, MAX_NEW, MAX_NEW)),
             rng.random() < 0.25) for i in range(200)]
    done = []

    async def main():
        queue = list(jobs)
        async with async_client(server, 66) as client:
            async def worker():
                while queue:
                    solo, max_new, streaming = queue.pop()
                    await run_normal(client, solo, max_new, streaming)
                    done.append(max_new)
            longs = [asyncio.ensure_future(run_normal(client, long_solo, LONG_NEW, False))
                     for _ in range(2)]
            while (await client.get("/server_info")).json()["running_requests"] < 2:
                assert not any(t.done() for t in longs), "a long request ended before both ran"
                await asyncio.sleep(0.05)
            await asyncio.gather(*longs, *(worker() for _ in range(64)))
    asyncio.run(main())

    assert len(done) == 200
    info = wait_idle(server)
    assert info["retracted_total"] > before["retracted_total"], \
        "the pool was never short: the test did not exercise retraction"
    assert info["generated_tokens_total"] - before["generated_tokens_total"] >= \
        sum(done) + 2 * LONG_NEW
    assert_pool_idle(info)


def test_50_streams_hanging_up_at_random_are_aborted_and_spare_the_others(server, solos):
    """Acceptance check 3: 50 streaming clients hang up after a seeded random number of
    frames (0..15) while 16 other clients read whole answers. Each hung-up request could
    run to the context's end; they must all be aborted, the others must equal their solo
    outputs, and the server must end idle."""
    before = wait_idle(server)
    rng = random.Random(4)
    prompt_len = 8
    long_max_new = CONTEXT - prompt_len - 1
    quitters = [({"input_ids": [rng.randrange(*TOKENS) for _ in range(prompt_len)],
                  "sampling_params": {"max_new_tokens": long_max_new, "ignore_eos": True}},
                 rng.randrange(0, 16)) for _ in range(50)]
    normals = [(solos[rng.randrange(NUM_PROMPTS)], rng.choice((16, MAX_NEW)), i % 2 == 0)
               for i in range(16)]

    async def main():
        async with async_client(server, 66) as client:
            await asyncio.gather(*(stream(client, body, k) for body, k in quitters),
                                 *(run_normal(client, *n) for n in normals))
    asyncio.run(main())

    info = wait_idle(server)
    assert_pool_idle(info)
    generated = info["generated_tokens_total"] - before["generated_tokens_total"]
    by_quitters = generated - sum(max_new for _, max_new, _ in normals)
    # Were any sizable share of them not aborted, they would have run to the context's end.
    assert by_quitters < len(quitters) * long_max_new // 2, by_quitters
