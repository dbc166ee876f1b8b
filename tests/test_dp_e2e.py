"""End to end: --dp-size 2, two scheduler replicas behind the data-parallel controller,
with each --load-balance-method; the shortest_queue server's replicas are each two
tensor-parallel ranks (--tp-size 2: four model processes).

40 concurrent greedy requests all succeed and equal transformers' output (where its choice
is not a near-tie); /server_info lists both replicas, and both served some; once idle each
replica's KV pool is whole; idle, no process of either server uses CPU. A flush reaches both
replicas. SIGKILL of a replica's rank takes the server down non-zero and leaves no process;
so does SIGKILL of the controller.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.reference import assert_greedy_match, greedy_reference
from tests.server import pool_whole, serving_until_killed, wait_idle
from tests.test_lifecycle import assert_death_takes_the_server_down, assert_idle_uses_no_cpu

pytestmark = pytest.mark.e2e

JOBS = 40
MAX_NEW = 8
VOCAB = 754          # the tiny checkpoints' (tests/model_helpers.py)


SERVERS = {"round_robin": (), "shortest_queue": ("--tp-size", "2")}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tiny_model, tmp_path_factory):
    """Each server ends in the last test, killed (no launch of its own for that)."""
    with serving_until_killed(tiny_model("llama"), "--dp-size", "2", "--load-balance-method",
                              request.param, *SERVERS[request.param],
                              tmpdir=tmp_path_factory.mktemp("dp")) as s:
        s.method = request.param
        yield s


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(JOBS)]


async def send_all(url: str, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(ids):
            r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            return r.json()
        return await asyncio.gather(*(one(ids) for ids in prompts))


def test_concurrent_requests_are_correct_and_both_replicas_serve(server, tiny_model):
    before = {x["dp_rank"]: x["requests_total"] for x in server.server_info()["replicas"]}
    ps = prompts()
    outs = asyncio.run(send_all(server.url, ps))
    for ids, out in zip(ps, outs):
        ref, margins = greedy_reference(tiny_model("llama"), ids, MAX_NEW)
        assert_greedy_match(out["output_ids"], ref, margins)
    info = wait_idle(server)
    replicas = info["replicas"]
    assert [x["dp_rank"] for x in replicas] == [0, 1]
    served = [x["requests_total"] - before[x["dp_rank"]] for x in replicas]
    assert sum(served) == JOBS and min(served) > 0, served
    assert all(pool_whole(x) for x in replicas), replicas
    assert info["requests_total"] == sum(x["requests_total"] for x in replicas)


def test_flush_reaches_every_replica(server):
    server.generate_ok(input_ids=list(range(1, 30)), sampling_params={"max_new_tokens": 1})
    server.generate_ok(input_ids=list(range(31, 60)), sampling_params={"max_new_tokens": 1})
    wait_idle(server)
    r = server.client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["message"] == "Cache flushed."
    assert all(x["kv_pool"]["evictable"] == 0 and pool_whole(x)
               for x in server.server_info()["replicas"])


def test_idle_replicas_controller_and_ranks_use_no_cpu(server):
    assert_idle_uses_no_cpu(server)


VICTIMS = {"round_robin": "dp-controller", "shortest_queue": "scheduler-1-tp1"}


def test_a_killed_controller_or_rank_takes_the_server_down(server):
    """Last: each module server ends here, killed: the controller of one, a tensor-parallel
    follower of a replica of the other."""
    assert_death_takes_the_server_down(server, VICTIMS[server.method], server.log_path.parent)
