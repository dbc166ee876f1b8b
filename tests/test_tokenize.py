"""End to end: POST /tokenize and /detokenize (SGLang's shapes, vLLM's chat form), on the
shared tiny llama server: text round-trips, batches keep their order, the chat form counts
what a chat request's prompt counts, and mistakes are 4xx with a message."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!", "a  b\nc"]


def post(server, path: str, body: dict) -> dict:
    r = server.client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_then_detokenize_round_trips(llama_server, prefix):
    for text in TEXTS:
        out = post(llama_server, f"{prefix}/tokenize", {"prompt": text,
                                                       "add_special_tokens": False})
        assert out["count"] == len(out["tokens"]) > 0
        assert out["max_model_len"] == llama_server.server_info()["context_length"]
        back = post(llama_server, f"{prefix}/detokenize", {"tokens": out["tokens"]})
        assert back["text"] == back["prompt"] == text


def test_batches_keep_their_order_and_match_generate(llama_server):
    out = post(llama_server, "/tokenize", {"prompt": TEXTS})
    assert out["count"] == [len(t) for t in out["tokens"]]
    for text, ids in zip(TEXTS, out["tokens"]):
        meta = llama_server.generate_ok(text=text, sampling_params={"max_new_tokens": 0})
        assert meta["meta_info"]["prompt_tokens"] == len(ids)   # what /generate counts
    assert post(llama_server, "/detokenize", {"tokens": out["tokens"]})["text"] == \
        [post(llama_server, "/detokenize", {"tokens": ids})["text"] for ids in out["tokens"]]


def test_the_chat_form_counts_what_a_chat_request_counts(llama_server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = post(llama_server, "/tokenize", {"messages": messages})
    r = llama_server.client.post("/v1/chat/completions", json={
        "model": llama_server.server_info()["served_model_name"], "messages": messages,
        "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == out["count"]


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/tokenize", {}, 400, "exactly one of prompt or messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt must be a string"),
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "exactly one"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages must be"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "x" * 10**6}, 400, "longer than the model's context"),
    ("/detokenize", {"tokens": [10**9]}, 400, "token ids in [0,"),
    ("/detokenize", {"tokens": [[1], "x"]}, 400, "token ids in [0,"),
    ("/detokenize", {"tokens": [True]}, 400, "token ids"),
])
def test_mistakes_are_client_errors(llama_server, path, body, status, fragment):
    r = llama_server.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


def test_model_default_is_accepted_and_unknown_routes_are_json_404s(llama_server):
    assert post(llama_server, "/tokenize", {"prompt": "hi", "model": "default"})["count"] > 0
    r = llama_server.client.get("/no/such/route")
    assert r.status_code == 404 and "error" in r.json()
