"""End to end: two zserve servers behind sglang-router 0.3.2 with its cache_aware policy.

The router (a Rust gateway started by `python -m sglang_router.launch_router`) registers
each worker through /health and /get_server_info and passes /generate and /v1/* through.
40 concurrent requests through it (/generate unary and streamed, /v1/completions,
/v1/chat/completions) all succeed with the greedy outputs the same prompts get sent straight
to a worker one at a time; both workers served some of them; requests sharing a long prefix
all land on one worker. Which worker ran what is read from each worker's own /server_info
(requests_total: the requests its scheduler accepted).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.server import Server, free_port, serving, wait_idle, wait_until

pytestmark = pytest.mark.e2e

MAX_NEW = 8
NEAR_TIE = 1e-3      # a solo run's top-1 / top-2 logprob margin below this may flip in a batch
# Prompts that share no beginning: cache_aware sends a text that matches nothing in its
# tree to the worker with the smaller tree, so distinct prompts spread over both workers.
CANDIDATES = [
    "The quick brown fox", "Once upon a time", "In the beginning", "Hello, my name is",
    "A long time ago", "Numbers: 1, 2, 3,", "def main():", "Dear Sir or Madam",
    "Rain falls on the hills", "What is the capital of France?", "My favourite colour",
    "Quiet rivers run deep",
]
PROMPTS = 8          # prompts with a clear greedy path, drawn from CANDIDATES
JOBS = 40
KINDS = ("unary", "stream", "completions", "chat")
# ~90% of every affinity request's text is this shared prefix.
SHARED = ("You are a careful assistant. Read the following notes about the village market, "
          "the river, the mill and the old bridge, then answer the question at the end "
          "in one short sentence. Notes: the market opens at dawn on Saturdays. ")
AFFINITY = 6


def greedy_params() -> dict:
    return {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def workers(llama_server, tiny_model, tmp_path_factory):
    """The session's tiny llama server and one more on the same checkpoint."""
    with serving(tiny_model("llama"), tmpdir=tmp_path_factory.mktemp("worker2")) as second:
        yield [llama_server, second]


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    """sglang-router in front of both workers, in its own process group; ready once it
    reports both workers healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router",
             "--worker-urls", *(w.url for w in workers), "--policy", "cache_aware",
             "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(free_port()), "--disable-retries",
             "--shutdown-grace-period-secs", "5", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready():
            assert proc.poll() is None, f"router exited:\n{log_path.read_text()}"
            try:
                r = httpx.get(url + "/readiness", timeout=2)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and r.json().get("healthy_workers") == len(workers)
        wait_until(ready, 60, "the router to register both workers")
        with httpx.Client(base_url=url, timeout=120.0) as client:
            yield client
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def model(workers) -> str:
    """The served model name. Through the router an OpenAI request must name it: the router
    refuses a completion without one (422) and names a chat's "unknown" (a worker's 404)."""
    return workers[0].server_info()["served_model_name"]


def served(workers: list[Server]) -> list[int]:
    """How many requests each worker's scheduler has accepted, once it is idle."""
    return [wait_idle(w)["requests_total"] for w in workers]


# ---- the oracle: each prompt sent straight to a worker, alone ------------------------------

def solo(server: Server, prompt: str) -> dict | None:
    """A prompt's greedy outputs sent alone to a worker (native text and chat), or None if
    either path has a near-tie that batching could flip."""
    gen = server.generate_ok(text=prompt, sampling_params=greedy_params(),
                             return_logprob=True, top_logprobs_num=2)
    tops = [(t[0][0], t[1][0]) for t in gen["meta_info"]["output_top_logprobs"]]
    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW,
        "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tops += [(e["top_logprobs"][0]["logprob"], e["top_logprobs"][1]["logprob"])
             for e in choice["logprobs"]["content"]]
    if min(abs(top1 - top2) for top1, top2 in tops) < NEAR_TIE:
        return None
    return {"prompt": prompt, "ids": gen["output_ids"], "text": gen["text"],
            "chat": choice["message"]["content"]}


@pytest.fixture(scope="module")
def solos(workers) -> list[dict]:
    """PROMPTS prompts with a clear greedy path and their solo outputs (the oracle)."""
    clear = []
    for prompt in CANDIDATES:
        if (s := solo(workers[0], prompt)) is not None:
            clear.append(s)
        if len(clear) == PROMPTS:
            return clear
    pytest.fail(f"only {len(clear)} of {len(CANDIDATES)} prompts have a clear greedy path")


# ---- through the router ----------------------------------------------------------------

async def post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def run_job(client: httpx.AsyncClient, kind: str, p: dict, model: str) -> None:
    """One request of `kind` through the router; asserts its output equals the solo one."""
    native = {"text": p["prompt"], "sampling_params": greedy_params()}
    openai = {"model": model, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    if kind == "unary":
        out = await post(client, "/generate", native)
        assert (out["output_ids"], out["text"]) == (p["ids"], p["text"])
    elif kind == "stream":
        async with client.stream("POST", "/generate", json={**native, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            frames = [line async for line in r.aiter_lines() if line]
        assert frames[-1] == "data: [DONE]", frames[-1]
        out = json.loads(frames[-2][len("data: "):])
        assert (out["output_ids"], out["text"]) == (p["ids"], p["text"])
    elif kind == "completions":
        out = await post(client, "/v1/completions", {**openai, "prompt": p["prompt"]})
        assert out["choices"][0]["text"] == p["text"]
    else:
        out = await post(client, "/v1/chat/completions", {
            **openai, "messages": [{"role": "user", "content": p["prompt"]}]})
        assert out["choices"][0]["message"]["content"] == p["chat"]


def test_the_router_registered_both_workers(router, workers, model):
    listed = router.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(w.url for w in workers)
    assert all(w["is_healthy"] and w["model_id"] == model for w in listed), listed


@pytest.fixture(scope="module")
def burst(router, workers, solos, model) -> dict:
    """JOBS requests of every kind in turn, all sent at once through the router; how
    many of them each worker served."""
    before = served(workers)
    jobs = [(KINDS[i % len(KINDS)], solos[i % PROMPTS]) for i in range(JOBS)]

    async def main() -> list:
        async with httpx.AsyncClient(base_url=str(router.base_url), timeout=120.0,
                                     limits=httpx.Limits(max_connections=JOBS)) as client:
            return await asyncio.gather(*(run_job(client, kind, p, model) for kind, p in jobs),
                                        return_exceptions=True)
    results = asyncio.run(main())
    return {"jobs": jobs, "results": results,
            "served": [a - b for a, b in zip(served(workers), before)]}


def test_concurrent_requests_through_the_router_equal_their_solo_outputs(burst):
    failed = [(kind, p["prompt"], repr(r)) for (kind, p), r in
              zip(burst["jobs"], burst["results"]) if r is not None]
    assert not failed, failed
    assert sum(burst["served"]) == JOBS, burst["served"]


def test_both_workers_served_some_of_them(burst):
    assert all(n > 0 for n in burst["served"]), burst["served"]


def test_requests_sharing_a_long_prefix_land_on_one_worker(router, workers, burst):
    """After the burst (which needs the router's prefix trees about even: cache_aware sends
    a text that matches nothing to the worker with the smaller tree)."""
    before = served(workers)
    metas = []
    for i in range(AFFINITY):
        text = f"{SHARED}Question {i}: where is the mill?"
        assert len(SHARED) >= 0.8 * len(text)
        r = router.post("/generate", json={"text": text, "sampling_params": greedy_params()})
        assert r.status_code == 200, r.text
        metas.append(r.json()["meta_info"])
    grew = [a - b for a, b in zip(served(workers), before)]
    assert sorted(grew) == [0, AFFINITY], grew
    assert all(2 * m["cached_tokens"] > m["prompt_tokens"] for m in metas[1:]), metas


def test_info_routes_through_the_router(router, workers):
    r = router.get("/get_model_info")
    assert r.status_code == 200, r.text
    assert r.json() == workers[0].client.get("/model_info").json()
    r = router.get("/get_server_info")
    assert r.status_code == 200, r.text
    assert isinstance(r.json(), dict)


def test_what_the_router_reads_from_a_worker(workers):
    """/get_server_info parses into the router's worker record (never both "model" and
    "model_id"; integer fields are integers); /get_load is a list, one entry per replica."""
    info = workers[1].client.get("/get_server_info").json()
    assert not {"model", "model_id"} <= info.keys()
    for key in ("dp_size", "max_total_tokens", "max_running_requests"):
        assert type(info[key]) is int, (key, info[key])
    wait_idle(workers[1])
    assert workers[1].client.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
