"""Unit tests for api_proc/native.py parse_generate: the /generate body at the boundary
(DESIGN.md section 2, SGLang's GenerateReqInput normalization)."""

from __future__ import annotations

import re

import pytest

from api_proc.native import BadRequest, parse_generate
from wire.messages import GenerateRequest, LogprobRequest
from wire.sampling import SamplingParams

EITHER = "Either text or input_ids should be provided."
HEX32 = re.compile(r"[0-9a-f]{32}")


def _bad(body, match: str | None = None) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse_generate(body)
    assert info.value.status == 400
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


# ---- text vs input_ids -------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {}, {"text": None}, {"input_ids": None}, {"text": None, "input_ids": None},
    {"text": "a", "input_ids": [1]}, {"text": ["a"], "input_ids": [[1]]},
    {"text": "", "input_ids": []}, {"sampling_params": {}},
])
def test_exactly_one_of_text_or_input_ids(body):
    err = _bad(body)
    assert str(err) == EITHER


def test_single_text():
    p = parse_generate({"text": "hello 你好"})
    assert not p.is_batch and not p.stream and len(p.requests) == 1
    (r,) = p.requests
    assert type(r) is GenerateRequest
    assert r.text == "hello 你好" and r.input_ids is None
    assert r.sampling == SamplingParams() and r.stream is False


def test_single_input_ids():
    p = parse_generate({"input_ids": [1, 2, 3], "text": None})
    assert not p.is_batch and len(p.requests) == 1
    (r,) = p.requests
    assert r.input_ids == [1, 2, 3] and r.text is None


def test_batch_text_keeps_order():
    p = parse_generate({"text": ["a", "b", "c"]})
    assert p.is_batch
    assert [r.text for r in p.requests] == ["a", "b", "c"]
    assert all(r.input_ids is None for r in p.requests)


def test_batch_input_ids_keeps_order():
    p = parse_generate({"input_ids": [[1], [2, 3]]})
    assert p.is_batch
    assert [r.input_ids for r in p.requests] == [[1], [2, 3]]
    assert all(r.text is None for r in p.requests)


def test_batch_of_one_is_still_a_batch():
    assert parse_generate({"text": ["a"]}).is_batch
    assert parse_generate({"input_ids": [[1]]}).is_batch


@pytest.mark.parametrize("text", [5, 1.5, True, [], ["a", 1], ["a", None], [["a"]],
                                  {"a": 1}, [b"a"]])
def test_wrong_text_types(text):
    _bad({"text": text}, "text must be a string or a non-empty list of strings.")


@pytest.mark.parametrize("ids", [
    [], [[]], [[1], []], [True], [1, True], [[1, False]], [False], [1.0], [1, 2.5],
    ["1"], [1, [2]], [[1], 2], [[[1]]], 5, "1 2", {"0": 1}, [None], [[None]],
])
def test_wrong_input_ids_types(ids):
    _bad({"input_ids": ids}, "input_ids must be a non-empty list of integers")


@pytest.mark.parametrize("body", [None, [], "text", 5, [{"text": "a"}]])
def test_body_must_be_an_object(body):
    _bad(body, "The request body must be a JSON object.")


# ---- top-level keys ----------------------------------------------------------------------

def test_unknown_top_level_key():
    err = _bad({"text": "a", "max_tokens": 5})
    assert str(err) == "Unknown field(s) in the request: max_tokens."
    err = _bad({"text": "a", "zeta": 1, "alpha": 2})
    assert str(err) == "Unknown field(s) in the request: alpha, zeta."


@pytest.mark.parametrize("stream", [1, 0, "true", None, [], {}])
def test_stream_must_be_bool(stream):
    _bad({"text": "a", "stream": stream}, "stream must be a boolean.")


@pytest.mark.parametrize("stream", [True, False])
def test_stream_is_carried_to_every_request(stream):
    p = parse_generate({"text": ["a", "b"], "stream": stream,
                        "sampling_params": {"n": 2}})
    assert p.stream is stream
    assert [r.stream for r in p.requests] == [stream] * 4


def test_logprob_request_is_built():
    p = parse_generate({"text": "a", "return_logprob": True, "top_logprobs_num": 5,
                        "logprob_start_len": 3, "return_text_in_logprobs": True})
    assert p.requests[0].logprob == LogprobRequest(top_logprobs_num=5, start_len=3)
    assert p.text_in_logprobs is True
    # Without return_logprob the other keys change nothing.
    assert parse_generate({"text": "a", "top_logprobs_num": 5}).requests[0].logprob is None


@pytest.mark.parametrize("key, value", [
    ("return_logprob", [True]), ("return_logprob", 1), ("top_logprobs_num", -1),
    ("top_logprobs_num", 21),
    ("top_logprobs_num", 1.5), ("logprob_start_len", -2), ("logprob_start_len", "0"),
    ("return_text_in_logprobs", "yes"),
])
def test_bad_logprob_options_are_rejected(key, value):
    err = _bad({"text": "a", "return_logprob": True, key: value})
    assert key in str(err)


@pytest.mark.parametrize("key, value", [
    ("return_logprob", False), ("return_logprob", None), ("top_logprobs_num", 0),
    ("logprob_start_len", -1),
])
def test_logprob_defaults_are_accepted(key, value):
    assert len(parse_generate({"text": "a", key: value}).requests) == 1


# ---- sampling_params ---------------------------------------------------------------------

def test_sampling_params_dict_applies_to_all():
    p = parse_generate({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3,
                                                                "temperature": 0}})
    for r in p.requests:
        assert r.sampling.max_new_tokens == 3 and r.sampling.is_greedy


def test_sampling_params_list_is_per_prompt():
    p = parse_generate({"input_ids": [[1], [2]], "sampling_params": [
        {"max_new_tokens": 1}, {"max_new_tokens": 2, "stop": "x"}]})
    assert [r.sampling.max_new_tokens for r in p.requests] == [1, 2]
    assert [r.sampling.stop for r in p.requests] == [[], ["x"]]


@pytest.mark.parametrize("body", [
    {"text": ["a", "b"], "sampling_params": [{}]},
    {"text": ["a", "b"], "sampling_params": [{}, {}, {}]},
    {"text": ["a", "b"], "sampling_params": []},
    {"input_ids": [[1], [2]], "sampling_params": [{}]},
    {"text": "a", "sampling_params": [{}, {}]},
])
def test_sampling_params_list_length_mismatch(body):
    _bad(body, "sampling_params is a list of")


def test_unknown_sampling_key():
    err = _bad({"text": "a", "sampling_params": {"max_tokens": 3}})
    assert str(err) == "Unknown sampling parameter 'max_tokens'."
    err = _bad({"text": ["a", "b"], "sampling_params": [{}, {"bogus": 1}]})
    assert str(err) == "Unknown sampling parameter 'bogus'."


def test_sampling_range_errors_are_bad_requests():
    err = _bad({"text": "a", "sampling_params": {"top_p": 1.5}})
    assert str(err) == "top_p must be in (0, 1], got 1.5."
    _bad({"text": "a", "sampling_params": "greedy"}, "sampling_params must be an object")
    _bad({"text": "a", "sampling_params": {"n": 0}}, "n must be at least 1")


# ---- rid ---------------------------------------------------------------------------------

def test_default_rids_are_distinct_uuid_hex():
    p = parse_generate({"text": ["a", "b", "c"], "sampling_params": {"n": 2}})
    rids = [r.rid for r in p.requests]
    assert len(rids) == 6 and len(set(rids)) == 6
    assert all(HEX32.fullmatch(rid) for rid in rids)
    other = parse_generate({"text": "a"}).requests[0].rid
    assert HEX32.fullmatch(other) and other not in rids


def test_str_rid_on_single_prompt_is_kept():
    assert [r.rid for r in parse_generate({"text": "a", "rid": "my-id"}).requests] == ["my-id"]


def test_str_rid_on_batch_gets_index():
    p = parse_generate({"text": ["a", "b", "c"], "rid": "x"})
    assert [r.rid for r in p.requests] == ["x_0", "x_1", "x_2"]
    p = parse_generate({"text": ["a"], "rid": "x"})
    assert [r.rid for r in p.requests] == ["x_0"]


def test_str_rid_with_n_gets_index():
    p = parse_generate({"text": "a", "rid": "x", "sampling_params": {"n": 3}})
    assert [r.rid for r in p.requests] == ["x_0", "x_1", "x_2"]


def test_list_rid_is_per_prompt():
    p = parse_generate({"text": ["a", "b"], "rid": ["ra", "rb"]})
    assert [(r.rid, r.text) for r in p.requests] == [("ra", "a"), ("rb", "b")]


def test_list_rid_with_n_gets_per_sample_suffix():
    p = parse_generate({"text": ["a", "b"], "rid": ["ra", "rb"],
                        "sampling_params": [{"n": 2}, {"n": 1}]})
    assert [(r.rid, r.text) for r in p.requests] == [("ra_0", "a"), ("ra_1", "a"),
                                                     ("rb", "b")]
    p = parse_generate({"text": ["a", "b"], "rid": ["ra", "rb"], "sampling_params": {"n": 2}})
    assert [r.rid for r in p.requests] == ["ra_0", "ra_1", "rb_0", "rb_1"]


@pytest.mark.parametrize("body", [
    {"text": ["a", "b"], "rid": ["only-one"]},
    {"text": ["a", "b"], "rid": ["a", "b", "c"]},
    {"text": ["a", "b"], "rid": ["a", 2]},
    {"text": "a", "rid": 5},
    {"text": "a", "rid": {"x": 1}},
    {"text": "a", "rid": ["a", "b"]},
])
def test_bad_rid(body):
    _bad(body, "rid must be a string or a list of strings, one per prompt.")


# ---- n > 1 -------------------------------------------------------------------------------

def test_n_expands_prompt_major_with_n_reset_to_one():
    p = parse_generate({"text": ["p0", "p1"], "sampling_params": {"n": 3, "max_new_tokens": 4}})
    assert p.is_batch
    assert [r.text for r in p.requests] == ["p0"] * 3 + ["p1"] * 3
    for r in p.requests:
        assert r.sampling.n == 1 and r.sampling.max_new_tokens == 4


def test_n_per_prompt_from_a_list():
    p = parse_generate({"input_ids": [[1], [2], [3]], "sampling_params": [
        {"n": 2}, {"n": 1}, {"n": 3, "temperature": 0.5}]})
    assert [r.input_ids for r in p.requests] == [[1], [1], [2], [3], [3], [3]]
    assert all(r.sampling.n == 1 for r in p.requests)
    assert [r.sampling.temperature for r in p.requests] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]


def test_single_prompt_with_n_is_a_batch_response():
    p = parse_generate({"text": "a", "sampling_params": {"n": 2}})
    assert p.is_batch and len(p.requests) == 2
    assert all(r.text == "a" and r.sampling.n == 1 for r in p.requests)


def test_n_one_single_is_not_a_batch():
    p = parse_generate({"text": "a", "sampling_params": {"n": 1}})
    assert not p.is_batch and len(p.requests) == 1


def test_n_samples_with_a_seed_get_consecutive_seeds():
    p = parse_generate({"text": "a", "sampling_params": {"n": 3, "sampling_seed": 10}})
    assert [r.sampling.sampling_seed for r in p.requests] == [10, 11, 12]
    single = parse_generate({"text": "a", "sampling_params": {"sampling_seed": 10}})
    assert single.requests[0].sampling.sampling_seed == 10


# Every field of SGLang's GenerateReqInput with its default value, as SGLang's clients send
# them (bench_serving, the router), plus what the router adds.
SGLANG_DEFAULT_BODY = {
    "text": "hello", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}, "rid": None,
    "session_id": None, "input_ids": None, "input_embeds": None, "image_data": None,
    "video_data": None, "audio_data": None, "mm_hashes": None, "mm_content_hashes": None,
    "use_audio_in_video": False, "video_config": None, "return_logprob": None,
    "logprob_start_len": None, "top_logprobs_num": None, "token_ids_logprob": None,
    "return_sampling_mask": None, "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "stream": False, "log_metrics": True, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None,
    "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "positional_embed_overrides": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "bootstrap_pair_key": None, "decode_tp_size": None,
    "routed_dp_rank": None, "data_parallel_rank": None, "disagg_prefill_dp_rank": None,
    "kv_router_hint": None, "routing_key": None, "conversation_id": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False,
    "max_thinking_tokens": None, "priority": None, "extra_key": None, "no_logs": False,
    "custom_labels": None, "return_bytes": False, "return_entropy": False,
    "return_prompt_token_ids": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None,
    "multi_item_delimiter_indices": None, "cache_salt": None, "model": "default",
}


def test_sglang_default_fields_are_accepted():
    p = parse_generate(SGLANG_DEFAULT_BODY)
    assert len(p.requests) == 1 and p.requests[0].text == "hello"
    batch = {**SGLANG_DEFAULT_BODY, "text": ["a", "b"], "lora_path": [None, None]}
    assert len(parse_generate(batch).requests) == 2


def test_lora_path_names_each_prompts_adapter():
    [r] = parse_generate({"text": "a", "lora_path": "sql"}).requests
    assert r.lora == "sql"
    p = parse_generate({"text": ["a", "b", "c"], "lora_path": ["sql", None, "chat"],
                        "sampling_params": {"n": 2}})
    assert [r.lora for r in p.requests] == ["sql", "sql", None, None, "chat", "chat"]
    assert [w.lora for w in p.warmups] == ["sql", None, "chat"]     # their prompts' adapters
    assert {r.lora for r in parse_generate({"text": ["a", "b"],
                                            "lora_path": "sql"}).requests} == {"sql"}
    for bad in ("", 3, ["sql"], "x" * 257):
        with pytest.raises(BadRequest, match="lora_path"):
            parse_generate({"text": ["a", "b"], "lora_path": bad})


@pytest.mark.parametrize("field,value", [("lora_id", "my-adapter"),
                                         ("return_hidden_states", True),
                                         ("video_data", "http://x/cat.mp4"),
                                         ("routed_experts_start_len", 3),
                                         ("background", True)])
def test_sglang_features_we_lack_are_400_naming_the_field(field, value):
    with pytest.raises(BadRequest, match=f"not supported by zserve: {field}"):
        parse_generate({"text": "a", field: value})


# ---- constrained decoding ---------------------------------------------------------------------

def test_constraints_in_sampling_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = parse_generate({"text": ["a", "b"], "sampling_params": [
        {"json_schema": schema}, {"regex": r"\d{4}", "n": 2}]})
    assert p.requests[0].sampling.json_schema == '{"type":"object","properties":{"a":' \
                                                 '{"type":"integer"}}}'
    assert [r.sampling.regex for r in p.requests[1:]] == [r"\d{4}"] * 2
    # the n > 1 warm-up only prefills the prompt: it carries no grammar to compile
    [warmup] = p.warmups
    assert warmup.sampling.grammar is None and warmup.sampling.max_new_tokens == 0
    assert parse_generate({"text": "a", "sampling_params": {"ebnf": 'root ::= "x"'}}
                          ).requests[0].sampling.ebnf == 'root ::= "x"'


@pytest.mark.parametrize("sampling, match", [
    ({"regex": "a", "json_schema": {}}, "Only one of regex, json_schema, or ebnf can be set."),
    ({"json_schema": "not json"}, "json_schema is not valid JSON"),
    ({"regex": ""}, "sampling_params.regex must not be empty."),
    ({"stop_regex": "x"}, "Sampling parameter 'stop_regex' is not supported."),
])
def test_bad_constraints_are_400(sampling, match):
    _bad({"text": "a", "sampling_params": sampling}, match)


def test_constraints_are_sampling_params_not_top_level_fields():
    _bad({"text": "a", "regex": "x"}, "Unknown field(s) in the request: regex.")


# ---- image_data (a vision model's images; the tokenizer process loads them) ----------------

@pytest.mark.parametrize("image_data, want", [
    ("AAAA", [["AAAA"]]),                           # one image
    (["AAAA", "/x/y.png"], [["AAAA", "/x/y.png"]]),  # several in the one prompt
    ([], [None]),
    (None, [None]),
])
def test_image_data_of_one_prompt(image_data, want):
    reqs = parse_generate({"text": "a", "image_data": image_data}).requests
    assert [r.image_data for r in reqs] == want


def test_image_data_of_a_batch_is_one_entry_per_prompt():
    body = {"text": ["a", "b", "c"], "image_data": ["A", ["B", "C"], None]}
    assert [r.image_data for r in parse_generate(body).requests] == [["A"], ["B", "C"], None]
    # n > 1: every sample and the prompt's prefill-only warm-up carry the prompt's images
    parsed = parse_generate({"text": "a", "image_data": "A", "sampling_params": {"n": 2}})
    assert [r.image_data for r in parsed.requests + parsed.warmups] == [["A"]] * 3


@pytest.mark.parametrize("body, fragment", [
    ({"text": "a", "image_data": 5}, "image_data must be an image"),
    ({"text": "a", "image_data": ["A", 5]}, "image_data must be an image"),
    ({"text": "a", "image_data": [["A"]]}, "image_data must be an image"),
    ({"text": ["a", "b"], "image_data": ["A"]}, "one entry per prompt (2)"),
    ({"text": ["a", "b"], "image_data": "A"}, "one entry per prompt (2)"),
    ({"text": ["a", "b"], "image_data": ["A", {"url": "x"}]}, "image_data[1] must be"),
])
def test_bad_image_data_is_a_400(body, fragment):
    with pytest.raises(BadRequest, match=re.escape(fragment)):
        parse_generate(body)
