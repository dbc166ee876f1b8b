"""End to end: --tokenizer-worker-num 3 --api-server-count 2 --dp-size 2: three tokenizer
processes behind each API process's one ZeroMQ PUSH (which hands them messages in turn), two
API processes on one port (SO_REUSEPORT: each connection is served by one of them), and two
scheduler replicas behind the data-parallel controller.

100 concurrent mixed requests (unary, batch, streaming, /v1/completions, chat) all succeed
with the greedy outputs their prompts get when sent one at a time, batches in input order;
every tokenizer worker and both API processes served some of them; aborts by rid (which
travel through another worker than their request, and may overtake it; or reach another
API process than their request's) and cache flushes (answered by the scheduler, once)
work; SIGKILL of one tokenizer worker, or of the second API process, takes the server down
non-zero and leaves no process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import psutil
import pytest

from tests.server import Server, serving_until_killed, wait_idle, wait_until
from tests.test_metrics import check_traffic, generate
from tests.test_lifecycle import (LONG, assert_death_takes_the_server_down, gone,
                                  wait_running)

pytestmark = pytest.mark.e2e

WORKERS = 3
TITLES = ["tokenizer", "tokenizer-1", "tokenizer-2"]
APIS = 2
MAX_NEW = 16
NEAR_TIE = 1e-3      # a solo run's top-1 / top-2 logprob margin below this may flip in a batch
CANDIDATES = [
    "The quick brown fox", "Once upon a time", "In the beginning", "Hello, my name is",
    "The capital of France", "A long time ago", "Numbers: 1, 2, 3,", "It was a dark night",
    "def main():", "Dear Sir or Madam", "The weather today", "Rain falls on the hills",
]
PROMPTS = 6          # prompts with a clear greedy path, drawn from CANDIDATES
JOBS = 100
KINDS = ("unary", "batch", "stream", "completions", "chat")


def greedy_params() -> dict:
    return {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def openai_body(**body) -> dict:
    return {**body, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@dataclass(frozen=True)
class Solo:
    """One prompt's greedy outputs when sent alone: /generate (text and ids) and chat."""
    prompt: str
    ids: list[int]
    text: str
    chat_text: str
    clear: bool         # no near-tie on either greedy path: batching cannot flip a token


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """Ends in the last test: its second API process is killed."""
    with serving_until_killed(tiny_model("llama"), "--tokenizer-worker-num", str(WORKERS),
                              "--api-server-count", str(APIS), "--dp-size", "2",
                              tmpdir=tmp_path_factory.mktemp("tokw")) as s:
        yield s


def pinned_client(server: Server, api: int) -> httpx.Client:
    """A client with one keep-alive connection, which the kernel gave to API process `api`
    (SO_REUSEPORT spreads connections by a hash of their ports: try new ones until then)."""
    for _ in range(100):
        client = httpx.Client(base_url=server.url, timeout=120.0,
                              limits=httpx.Limits(max_connections=1))
        if client.get("/server_info").json()["api_server"] == api:
            return client
        client.close()
    pytest.fail(f"no connection reached API process {api} in 100 tries")


@pytest.fixture(scope="module")
def clients(server) -> list[httpx.Client]:
    pinned = [pinned_client(server, k) for k in range(APIS)]
    yield pinned
    for c in pinned:
        c.close()


def solo(server: Server, prompt: str) -> Solo:
    gen = server.generate_ok(text=prompt, sampling_params=greedy_params(),
                             return_logprob=True, top_logprobs_num=2)
    tops = gen["meta_info"]["output_top_logprobs"]
    margins = [abs(t[0][0] - t[1][0]) for t in tops]
    r = server.client.post("/v1/chat/completions", json=openai_body(
        messages=chat_messages(prompt), logprobs=True, top_logprobs=2))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    margins += [abs(e["top_logprobs"][0]["logprob"] - e["top_logprobs"][1]["logprob"])
                for e in choice["logprobs"]["content"]]
    assert len(gen["output_ids"]) == MAX_NEW and len(margins) == 2 * MAX_NEW
    return Solo(prompt, gen["output_ids"], gen["text"], choice["message"]["content"],
                clear=min(margins) >= NEAR_TIE)


@pytest.fixture(scope="module")
def solos(server) -> list[Solo]:
    """The prompts, each sent alone, one after another (the oracle)."""
    clear = []
    for prompt in CANDIDATES:
        if (s := solo(server, prompt)).clear:
            clear.append(s)
        if len(clear) == PROMPTS:
            return clear
    pytest.fail(f"only {len(clear)} of {len(CANDIDATES)} prompts have a clear greedy path")


def wakeups(proc: psutil.Process) -> int:
    """Context switches of a child's main thread (/proc/PID/status counts it alone). The
    tokenizer's and the idle scheduler's loops sleep in a ZeroMQ poll with no timeout, so
    the count moves only when messages arrive, once they are handled and it sleeps again."""
    return sum(proc.num_ctx_switches())


def main_thread_wakeups(server: Server) -> list[int]:
    return [wakeups(server.child(t)) for t in TITLES]


async def run_job(client: httpx.AsyncClient, kind: str, prompts: list[Solo]) -> None:
    """One request of `kind`; asserts it succeeded with its prompts' solo outputs."""
    p = prompts[0]
    if kind == "unary":
        r = await client.post("/generate", json={"text": p.prompt,
                                                 "sampling_params": greedy_params()})
        assert r.status_code == 200, r.text
        assert (r.json()["output_ids"], r.json()["text"]) == (p.ids, p.text)
    elif kind == "batch":
        r = await client.post("/generate", json={"text": [q.prompt for q in prompts],
                                                 "sampling_params": greedy_params()})
        assert r.status_code == 200, r.text
        assert [(o["output_ids"], o["text"]) for o in r.json()] == \
            [(q.ids, q.text) for q in prompts], "batch outputs out of input order"
    elif kind == "stream":
        frames = []
        async with client.stream("POST", "/generate", json={
                "text": p.prompt, "sampling_params": greedy_params(), "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line:
                    frames.append(line)
        assert frames[-1] == "data: [DONE]"
        last = json.loads(frames[-2][len("data: "):])
        assert (last["output_ids"], last["text"]) == (p.ids, p.text)
    elif kind == "completions":
        r = await client.post("/v1/completions", json=openai_body(prompt=p.prompt))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == p.text
    else:
        r = await client.post("/v1/chat/completions",
                              json=openai_body(messages=chat_messages(p.prompt)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == p.chat_text


@pytest.fixture(scope="module")
def burst(server, solos, clients) -> dict:
    """JOBS requests of every kind in turn, all sent at once; each worker's wake-ups
    during the burst."""
    wait_idle(server)
    before = main_thread_wakeups(server)
    served_before = api_requests(clients)
    jobs = [(KINDS[i % len(KINDS)], [solos[(i + j) % PROMPTS] for j in range(3)])
            for i in range(JOBS)]

    async def main() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0, limits=httpx.Limits(
                max_connections=JOBS, max_keepalive_connections=JOBS)) as client:
            return await asyncio.gather(*(run_job(client, kind, prompts)
                                          for kind, prompts in jobs), return_exceptions=True)
    results = asyncio.run(main())
    info = wait_idle(server)
    after = main_thread_wakeups(server)
    return {"jobs": jobs, "results": results, "info": info,
            "wakeups": [a - b for a, b in zip(after, before)],
            "api_served": [a - b for a, b in zip(api_requests(clients), served_before)]}


def api_requests(clients: list[httpx.Client]) -> list[int]:
    """Requests each API process has taken in since start (its own /server_info)."""
    return [c.get("/server_info").json()["api_requests_total"] for c in clients]


def test_three_tokenizer_processes_with_their_own_inboxes(server):
    for title in TITLES:
        assert server.child(title).is_running()
    with pytest.raises(LookupError):
        server.child("tokenizer-3")
    (ipc_dir,) = server.log_path.parent.glob("zserve-*/")
    assert set(TITLES) <= {p.name for p in ipc_dir.iterdir()}
    assert server.server_info()["tokenizer_worker_num"] == WORKERS


def test_concurrent_mixed_requests_equal_their_solo_outputs(burst):
    failed = [(kind, [p.prompt for p in prompts], repr(r))
              for (kind, prompts), r in zip(burst["jobs"], burst["results"]) if r is not None]
    assert not failed, failed
    assert burst["info"]["rejected_total"] == 0


def test_every_tokenizer_worker_tokenized_some_requests(burst):
    assert all(n > 0 for n in burst["wakeups"]), dict(zip(TITLES, burst["wakeups"]))


def test_both_api_processes_took_requests_and_see_the_same_server(burst, clients):
    # A batch of 3 prompts is 3 requests; every job of the burst went to one process.
    sizes = [3 if kind == "batch" else 1 for kind, _ in burst["jobs"]]
    assert sum(burst["api_served"]) == sum(sizes) and min(burst["api_served"]) > 0, \
        burst["api_served"]
    infos = [c.get("/server_info").json() for c in clients]
    assert [i["api_server"] for i in infos] == list(range(APIS))
    whole = ("requests_total", "prompt_tokens_total", "generated_tokens_total", "kv_pool",
             "replicas")
    assert all({k: i[k] for k in whole} == {k: infos[0][k] for k in whole} for i in infos)


def test_metrics_of_both_api_processes_add_up_in_either(server, clients):
    """Requests through each API process; /metrics from one of them counts them all, and
    its latency sums are those of the requests' meta_info (issue 12, check 1)."""
    wait_idle(server)

    def send() -> list[dict]:
        return [generate(c, input_ids=[5 + i, 6, 7, 8], sampling_params={
            "max_new_tokens": 4, "ignore_eos": True})["meta_info"]
            for i, c in enumerate(clients * 3)]
    for scraped_from in clients:
        check_traffic(scraped_from, send)
    wait_idle(server)


def abort_once_in_flight(client: httpx.Client, rid: str, future) -> None:
    """POST /abort_request for rid until it finds the request ({"aborted": 1})."""
    deadline = time.monotonic() + 30
    while client.post("/abort_request", json={"rid": rid}).json()["aborted"] != 1:
        assert time.monotonic() < deadline and not future.done(), "never in flight"


def assert_aborted(r: httpx.Response, max_tokens: int) -> None:
    """The request ended aborted with fewer than max_tokens tokens."""
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert meta["completion_tokens"] < max_tokens, meta


@pytest.mark.parametrize("runs_on,aborted_through", [(0, 1), (1, 0)])
def test_an_abort_through_the_other_api_process_reaches_its_request(
        server, clients, runs_on, aborted_through):
    wait_idle(server)
    rid = f"cross-{runs_on}"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(clients[runs_on].post, "/generate", json={**LONG, "rid": rid})
        abort_once_in_flight(clients[aborted_through], rid, future)
        r = future.result(timeout=60)
    assert_aborted(r, LONG["sampling_params"]["max_new_tokens"])


def test_abort_by_rid_reaches_its_request(server):
    """An abort goes out through the next worker, not the one that has its request: sent
    while the request runs, and sent the moment the API knows the rid (it may then reach
    the scheduler first, which keeps it until the request arrives). Either way the request
    ends aborted, far from its end."""
    wait_idle(server)
    max_new = LONG["sampling_params"]["max_new_tokens"]
    with ThreadPoolExecutor(1) as pool:
        for i in range(4):
            rid = f"long-{i}"
            future = pool.submit(server.generate, **LONG, rid=rid)
            if i == 0:
                wait_running(server, future)
            abort_once_in_flight(server.client, rid, future)
            assert_aborted(future.result(timeout=60), max_new)
    info = wait_idle(server)
    assert info["requests_in_flight"] == 0


def test_an_abort_that_overtakes_its_request_still_ends_it(server):
    """Made to happen: the worker that gets the request is stopped (SIGSTOP) until the
    abort, sent through the next worker, has been handled by the scheduler; then the
    request arrives there and ends at once, aborted, without a token."""
    wait_idle(server)
    workers = [server.child(t) for t in TITLES]
    order = []                 # the workers in the order the API's PUSH hands out messages
    for _ in range(WORKERS):
        before = main_thread_wakeups(server)
        server.generate_ok(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})
        moved = wait_until(lambda: [w for w, (a, b) in enumerate(zip(
            main_thread_wakeups(server), before)) if a != b], what="a worker to wake")
        assert len(moved) == 1, moved
        order += moved
    assert sorted(order) == list(range(WORKERS)), order
    wait_idle(server)
    slow, fast = workers[order[0]], workers[order[1]]    # the next two to get a message
    scheduler = server.child("scheduler")
    fast_before, scheduler_before = wakeups(fast), wakeups(scheduler)
    slow.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(server.generate, **LONG, rid="overtaken")
            abort_once_in_flight(server.client, "overtaken", future)
            wait_until(lambda: wakeups(fast) != fast_before, what="the abort's worker")
            wait_until(lambda: wakeups(scheduler) != scheduler_before,
                       what="the scheduler to take the abort")
            assert not future.done()
            slow.send_signal(signal.SIGCONT)
            r = future.result(timeout=60)
    finally:
        slow.send_signal(signal.SIGCONT)
    assert_aborted(r, 1)                        # without a token
    wait_idle(server)


def test_flush_cache_is_answered_through_any_worker(server):
    wait_idle(server)
    server.generate_ok(text="fill the cache", sampling_params={"max_new_tokens": 2})
    wait_idle(server)
    for _ in range(WORKERS):            # one flush through each worker in turn
        r = server.client.post("/flush_cache")
        assert r.status_code == 200 and r.json() == {"message": "Cache flushed."}, r.text
    kv = wait_idle(server)["kv_pool"]
    assert kv["evictable"] == 0 and kv["free"] == kv["total"], kv


def test_a_killed_tokenizer_worker_takes_the_server_down(tiny_model, tmp_path):
    """As tests/test_lifecycle.py for the single tokenizer: the request in flight fails with
    a 503 naming the death; the server exits non-zero within 10 s of the kill, leaving no
    process and no ipc directory."""
    s = Server(tiny_model("llama"), "--tokenizer-worker-num", "2", tmpdir=tmp_path)
    try:
        assert_death_takes_the_server_down(s, "tokenizer-1", tmp_path)
    finally:
        s.kill()


def test_a_killed_api_process_takes_the_server_down(server):
    """Last: the module's server ends here. SIGKILL of API process 1: the server exits
    non-zero within 10 s, leaving no process and no ipc directory."""
    procs = [psutil.Process(server.proc.pid), *server.children]
    server.child("api-1").send_signal(signal.SIGKILL)
    assert server.proc.wait(timeout=10) != 0, server.logs()
    assert gone(procs, 5.0), [p for p in procs if p.is_running()]
    assert not list(server.log_path.parent.glob("zserve-*/"))
    assert "The api-1 process died" in server.logs()
