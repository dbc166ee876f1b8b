"""End to end: bad input gets a 400 with {"error": {"message": ...}} and the server keeps
serving; nothing a client sends produces a 500."""

from __future__ import annotations

import pytest

from tests.server import wait_idle

CONTEXT = 512   # the tiny checkpoints' max_position_embeddings

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


def post_raw(server, content: bytes, headers=None):
    return server.client.post("/generate", content=content,
                              headers=headers or {"content-type": "application/json"})


def assert_400(r, *fragments: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert isinstance(message, str) and message
    for f in fragments:
        assert f in message, message


BAD_BODIES = [
    ({}, "Either text or input_ids should be provided."),
    ({"sampling_params": {}}, "Either text or input_ids should be provided."),
    ({"text": "a", "input_ids": [1]}, "Either text or input_ids should be provided."),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"text": ["a", 3]}, "text"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [1, True]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1], got 1.5."),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "a", "sampling_params": {"min_p": 2}}, "min_p"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": "a", "sampling_params": {"stop": ["x"] * 33}}, "stop"),
    ({"text": "a", "sampling_params": {"n": 129}}, "n must be at most 128"),
    ({"text": "a", "sampling_params": {"stop": ["x" * 257]}}, "at most 256 characters"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "rid": 7}, "rid"),
    ({"text": "a", "surprise": 1}, "surprise"),
]


@pytest.mark.parametrize("body,fragment", BAD_BODIES, ids=[str(b) for b, _ in BAD_BODIES])
def test_bad_body_is_400(server, body, fragment):
    assert_400(server.generate(**body), fragment)


def test_non_object_bodies(server):
    assert_400(post_raw(server, b"{not json"), "Malformed JSON")
    assert_400(post_raw(server, b"\xff\xfe"), "Malformed JSON")
    assert_400(post_raw(server, b"[1, 2]"), "JSON object")
    assert_400(post_raw(server, b"null"), "JSON object")


def test_prompt_over_context_length(server):
    ids = [5] * (CONTEXT + 3)
    assert_400(server.generate(input_ids=ids), f"The input ({CONTEXT + 3} tokens) is longer "
               f"than the model's context length ({CONTEXT} tokens).")
    assert_400(server.generate(text="word " * 2000), "longer than the model's context length")
    # Fits alone, but not with the requested completion.
    assert_400(server.generate(input_ids=[5] * 400, sampling_params={"max_new_tokens": 200}),
               "maximum context length")


def test_token_ids_outside_the_vocabulary(server):
    assert_400(server.generate(input_ids=[1, 10 ** 6]), "vocabulary")
    assert_400(server.generate(input_ids=[-1, 2]), "vocabulary")
    assert_400(server.generate(text="a", sampling_params={"stop_token_ids": [10 ** 6]}),
               "vocabulary")
    wait_idle(server)                       # nothing admitted, no slot taken


HUGE = 10 ** 30   # wider than any int the wire carries


@pytest.mark.parametrize("body,fragment", [
    ({"input_ids": [HUGE]}, ""),
    ({"text": "a", "sampling_params": {"stop_token_ids": [HUGE]}}, "stop_token_ids"),
    ({"text": "a", "sampling_params": {"max_new_tokens": HUGE}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"sampling_seed": HUGE}}, "sampling_seed"),
    ({"text": "a", "sampling_params": {"logit_bias": {str(HUGE): 1.0}}}, "logit_bias"),
    ({"text": "a", "sampling_params": {"logit_bias": {"100000": 1.0}}}, "logit_bias"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": HUGE}, ""),
], ids=["input_ids", "stop_token_ids", "max_new_tokens", "seed", "logit_bias_huge",
        "logit_bias_vocab", "logprob_start_len"])
def test_out_of_range_numbers_are_400(server, body, fragment):
    assert_400(server.generate(**body), fragment)


def test_lone_surrogates_are_400(server):
    # JSON allows "\ud800" escapes that are not valid Unicode; they cannot cross a socket.
    for raw in (rb'{"text": "\ud800"}', rb'{"text": "a", "sampling_params": {"stop": ["\udfff"]}}'):
        assert_400(post_raw(server, raw))


def test_logprob_start_beyond_the_prompt_is_served(server):
    out = server.generate_ok(input_ids=[5, 6, 7], return_logprob=True, logprob_start_len=1000,
                             sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == 2


def test_bad_item_in_batch_fails_the_batch(server):
    assert_400(server.generate(input_ids=[[1, 2], [1, 10 ** 6]]), "vocabulary")


def test_bad_streaming_request_is_a_plain_400(server):
    r = server.client.post("/generate", json={"input_ids": [10 ** 6], "stream": True})
    assert_400(r, "vocabulary")


def test_duplicate_rid_in_one_batch(server):
    assert_400(server.generate(text=["a", "b"], rid=["same", "same"]), "Duplicate")


def test_wrong_method_and_route(server):
    assert server.client.get("/generate").status_code == 405
    assert server.client.get("/nope").status_code == 404


def test_server_still_serves_after_bad_input(server):
    for body, _ in BAD_BODIES[:5]:
        server.generate(**body)
    # ignore_eos: the shared server's sampling state depends on what ran before, and a
    # sampled EOS would end the request early without saying anything about bad input.
    out = server.generate_ok(text="still alive", sampling_params={"max_new_tokens": 4,
                                                                  "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 4
    assert server.client.get("/health").status_code == 200
