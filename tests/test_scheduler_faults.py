"""End to end: no request takes the scheduler down (issue 8, defects 1, 9 and 11, and the
watchdog). Extreme sampling values on every route get a 200 or a 400; forged messages
pushed straight onto the scheduler's ipc socket are dropped; a chat request without
max_tokens fits a pool smaller than the context; a stalled scheduler takes the server down
with a stack dump. After each, the server serves the next request and its KV pool is at
its idle invariant (free + evictable == total)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import zmq

from tests.server import Server, serving, wait_idle, wait_until
from wire.codec import encode
from wire.messages import (AbortRequest, FlushCacheRequest, LogprobRequest, ReleaseRequest,
                           TokenizedRequest)
from wire.sampling import SamplingParams

pytestmark = pytest.mark.e2e

POOL = 256          # KV slots: smaller than the tiny checkpoints' 512-token context


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def vocab(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with serving(model_dir, "--max-total-tokens", str(POOL),
                 tmpdir=tmp_path_factory.mktemp("srv")) as s:
        yield s


def assert_still_serving(server) -> None:
    out = server.generate_ok(text="still here", sampling_params={"max_new_tokens": 3,
                                                                 "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    wait_idle(server)


# ---- defect 1: extreme sampling values, on every route ------------------------------------

def defect_1_bodies(vocab: int) -> list[dict]:
    """sampling_params of defect 1; each once crashed the scheduler."""
    return [
        {"top_p": 1e-300, "max_new_tokens": 4},
        {"top_p": 1e-46, "max_new_tokens": 4},
        {"temperature": 1e39, "max_new_tokens": 4},
        {"temperature": 3.5e38, "min_new_tokens": 2, "max_new_tokens": 4},
        {"repetition_penalty": 1e-300, "max_new_tokens": 4},
        # Every token banned until the minimum: all values in range.
        {"temperature": 0.7, "min_new_tokens": 2, "stop_token_ids": list(range(vocab)),
         "max_new_tokens": 4},
    ]


IDS = ["top_p_1e-300", "top_p_1e-46", "temperature_1e39", "temperature_3.5e38_min_new",
       "repetition_penalty_1e-300", "every_token_banned"]


def as_openai(sampling: dict) -> dict:
    names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
    return {names.get(k, k): v for k, v in sampling.items()}


def post(server, route: str, sampling: dict, model_dir) -> httpx.Response:
    if route == "/generate":
        return server.client.post(route, json={"text": "hello", "sampling_params": sampling})
    body = {"model": str(model_dir), **as_openai(sampling)}
    if route == "/v1/completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    return server.client.post(route, json=body)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("index", range(len(IDS)), ids=IDS)
def test_extreme_sampling_values_get_200_or_400(server, vocab, model_dir, route, index):
    sampling = defect_1_bodies(vocab)[index]
    r = post(server, route, sampling, model_dir)
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["message"]
    if IDS[index] == "every_token_banned":      # in range: served, never cut short
        assert r.status_code == 200, r.text
    assert_still_serving(server)


# ---- defect 9: forged messages on the scheduler's socket ----------------------------------

def scheduler_socket(server) -> str:
    [path] = Path(server.log_path).parent.glob("zserve-*/scheduler")
    return f"ipc://{path}"


def test_forged_messages_on_the_scheduler_socket_leave_it_serving(server, vocab):
    good = SamplingParams(max_new_tokens=4)
    long = SamplingParams(max_new_tokens=POOL - 8, ignore_eos=True)
    forged = [
        TokenizedRequest(rid="forged-vocab", input_ids=[1, 10 ** 6], sampling=good),
        TokenizedRequest(rid="forged-negative", input_ids=[-5], sampling=good),
        TokenizedRequest(rid="forged-empty", input_ids=[], sampling=good),
        TokenizedRequest(rid="forged-context", input_ids=[1] * 600, sampling=good),
        TokenizedRequest(rid="forged-sampling", input_ids=[1, 2],
                         sampling=SamplingParams(top_p=1e-300, temperature=float("nan"))),
        TokenizedRequest(rid="forged-penalty", input_ids=[1, 2],
                         sampling=SamplingParams(frequency_penalty=1e300, max_new_tokens=4)),
        TokenizedRequest(rid="forged-stop", input_ids=[1, 2],
                         sampling=SamplingParams(stop_token_ids=[vocab], min_new_tokens=1)),
        TokenizedRequest(rid="forged-bias", input_ids=[1, 2],
                         sampling=SamplingParams(logit_bias={"x": 1e300})),
        TokenizedRequest(rid="forged-logprobs", input_ids=[1, 2], sampling=good,
                         logprob=LogprobRequest(top_logprobs_num=10 ** 6, start_len=-7)),
        TokenizedRequest(rid="", input_ids=[1, 2], sampling=good),
        # A duplicate of a request in flight: dropped, the first one untouched.
        TokenizedRequest(rid="forged-dup", input_ids=[1, 2, 3], sampling=long),
        TokenizedRequest(rid="forged-dup", input_ids=[7, 10 ** 6], sampling=long),
        AbortRequest(rid="nobody"),
        ReleaseRequest(rids=["nobody", "nobody", ""]),
        FlushCacheRequest(req_id="forged-flush"),
        AbortRequest(rid="forged-dup", message="forged abort"),
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(scheduler_socket(server))
        sock.send(b"\x93garbage that is not a message")
        for msg in forged:
            sock.send(encode(msg))
    finally:
        sock.close()
        ctx.term()
    logs = wait_until(lambda: "forged-dup" in (text := server.logs()) and text,
                      what="the scheduler to log the duplicate rid")
    for rid in ("forged-vocab", "forged-negative", "forged-empty", "forged-context",
                "forged-sampling", "forged-penalty", "forged-stop", "forged-bias",
                "forged-logprobs"):
        assert f"rejected request '{rid}'" in logs, rid
    assert "dropped a request with a duplicate rid 'forged-dup'" in logs
    wait_idle(server)
    assert server.client.get("/health").status_code == 200
    assert_still_serving(server)


# ---- defect 11: chat without max_tokens on a pool smaller than the context ----------------

def test_chat_without_max_tokens_fits_the_pool(server, model_dir):
    r = server.client.post("/v1/chat/completions", json={
        "model": str(model_dir), "messages": [{"role": "user", "content": "hello"}],
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # The request may hold the whole pool: prompt + completion - 1 KV slots (the last
    # sampled token's KV is never computed).
    assert usage["prompt_tokens"] + usage["completion_tokens"] - 1 == POOL
    assert r.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(server)


def test_a_prompt_that_cannot_fit_the_pool_is_still_400(server, model_dir):
    r = server.client.post("/v1/chat/completions", json={
        "model": str(model_dir), "messages": [{"role": "user", "content": "hello " * 300}]})
    assert r.status_code == 400, r.text
    assert_still_serving(server)


# ---- the watchdog ---------------------------------------------------------------------------

def test_a_stalled_scheduler_takes_the_server_down_with_a_stack_dump(model_dir, tmp_path):
    s = Server(model_dir, "--watchdog-timeout", "1", tmpdir=tmp_path,
               env={"ZSERVE_TEST_STALL_AFTER_STEPS": "3"})
    try:
        # Two steps (prefill, one decode), then idle for longer than the timeout: an idle
        # scheduler is never taken down.
        s.generate_ok(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2,
                                                            "ignore_eos": True})
        time.sleep(3)
        assert s.proc.poll() is None, s.logs()
        # The third step stalls forever; the watchdog fires 1-2 s later.
        try:
            r = s.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 50,
                                                                 "ignore_eos": True})
            assert r.status_code != 200, r.text
        except httpx.HTTPError:
            pass                                # the server went away mid-request
        code = s.proc.wait(timeout=60)
    finally:
        s.kill()
    logs = s.logs()
    assert code != 0, logs
    assert "stalling inside step 4" in logs
    assert "Timeout (0:00:02)!" in logs and "most recent call first" in logs, logs
    assert "scheduler.py" in logs                # the stuck frame is in the dump
