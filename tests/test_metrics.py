"""End to end: GET /metrics (Prometheus text), meta_info's timing fields and the request
log, against known traffic on the shared tiny llama server (one API process; the scale-out
module checks the same with two).

After known requests, the counters moved by exactly what was sent (requests by route and
finish reason, prompt, generated and cached tokens) and each latency histogram's sum moved
by the sum of the meta_info latencies of those requests (within 5%). In streaming, the mean
inter-token latency the API reports equals the client's own within a few milliseconds.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import wait_idle

pytestmark = pytest.mark.e2e

HISTOGRAMS = {            # metric -> the meta_info field it sums
    "zserve:time_to_first_token_seconds": "first_token_latency",
    "zserve:e2e_request_latency_seconds": "e2e_latency",
    "zserve:queue_time_seconds": "queue_time",
    "zserve:prefill_time_seconds": "prefill_time",
    "zserve:decode_time_seconds": "decode_time",
}


def scrape(client: httpx.Client) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def generate(client: httpx.Client, **body) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def check_traffic(scrape_client: httpx.Client, send) -> None:
    """Scrape, send(): list of meta_info dicts of /generate requests that finished by
    length, scrape again: the counters and histogram sums moved by exactly those."""
    before = scrape(scrape_client)
    metas = send()
    after = scrape(scrape_client)
    n = len(metas)
    assert delta(after, before, "zserve:requests_total", route="generate",
                 finish_reason="length") == n
    assert delta(after, before, "zserve:prompt_tokens_total") == \
        sum(m["prompt_tokens"] for m in metas)
    assert delta(after, before, "zserve:generation_tokens_total") == \
        sum(m["completion_tokens"] for m in metas)
    assert delta(after, before, "zserve:cached_prompt_tokens_total") == \
        sum(m["cached_tokens"] for m in metas)
    for metric, field in HISTOGRAMS.items():
        assert delta(after, before, metric + "_count") == n, metric
        ours = sum(m[field] for m in metas)
        theirs = delta(after, before, metric + "_sum")
        assert theirs == pytest.approx(ours, rel=0.05, abs=1e-6), (metric, theirs, ours)
    assert after[("zserve:requests_in_flight", ())] == 0


def test_counters_and_histograms_match_the_requests_sent(llama_server):
    wait_idle(llama_server)
    prompts = [[5, 6, 7], list(range(10, 40)), [5, 6, 7]]      # the third hits the cache

    def send() -> list[dict]:
        return [generate(llama_server.client, input_ids=p, sampling_params={
            "max_new_tokens": 6, "ignore_eos": True})["meta_info"] for p in prompts]
    check_traffic(llama_server.client, send)
    wait_idle(llama_server)


def test_meta_info_phases_add_up_within_the_request(llama_server):
    meta = generate(llama_server.client, input_ids=list(range(20, 50)), sampling_params={
        "max_new_tokens": 12, "ignore_eos": True})["meta_info"]
    phases = [meta["queue_time"], meta["prefill_time"], meta["decode_time"]]
    assert all(isinstance(x, float) and x >= 0 for x in phases), meta
    # Two clocks (scheduler and API), but the scheduler's phases lie inside the API's span.
    assert sum(phases) <= meta["e2e_latency"] + 0.005, meta
    assert meta["decode_time"] > 0 and meta["inter_token_latency"] > 0, meta


def test_scheduler_gauges_and_rejections(llama_server):
    wait_idle(llama_server)
    before = scrape(llama_server.client)
    r = llama_server.client.post("/generate", json={"input_ids": [10**6]})
    assert r.status_code == 400
    after = scrape(llama_server.client)
    assert delta(after, before, "zserve:rejected_requests_total", reason="invalid") == 1
    labels = (("dp_rank", "0"),)
    assert after[("zserve:num_running_reqs", labels)] == 0
    assert after[("zserve:kv_pool_usage", labels)] == 0
    assert after[("zserve:kv_pool_total_tokens", labels)] == \
        llama_server.server_info()["kv_pool"]["total"]
    assert 0 <= after[("zserve:prefix_cache_hit_rate", labels)] <= 1


def test_streamed_inter_token_latency_matches_the_client(llama_server):
    """The client stamps each frame as it arrives; the API stamped each output as it
    arrived. On loopback both see the same spacing: their mean gaps per token agree. (Over
    200 tokens, so that one stalled frame on a busy machine cannot move the mean by 3 ms.)"""
    new = 200
    wait_idle(llama_server)
    stamps: list[tuple[float, int]] = []             # (arrival, tokens so far)
    with llama_server.client.stream("POST", "/generate", json={
            "input_ids": [5, 6, 7, 8], "stream": True,
            "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                frame = json.loads(line[len("data: "):])
                stamps.append((time.monotonic(), len(frame["output_ids"])))
    last = frame["meta_info"]
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    assert n1 == new and n1 > n0
    client_itl = (t1 - t0) / (n1 - n0)
    assert abs(last["inter_token_latency"] - client_itl) < 0.003, (last, client_itl)
    wait_idle(llama_server)
