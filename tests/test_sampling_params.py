"""SamplingParams.from_json: the HTTP boundary for sampling_params (SGLang's defaults/messages)."""

import json

import msgspec
import pytest

from wire.sampling import SamplingError, SamplingParams


def test_defaults_match_sglang():
    for p in (SamplingParams.from_json(None), SamplingParams.from_json({}), SamplingParams()):
        assert p == SamplingParams(
            max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
            frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
            min_new_tokens=0, stop=[], stop_token_ids=[], ignore_eos=False,
            skip_special_tokens=True, spaces_between_special_tokens=True, no_stop_trim=False,
            n=1, sampling_seed=None, logit_bias=None, json_schema=None, regex=None,
            ebnf=None)
        assert not p.is_greedy


def test_valid_values_are_kept():
    p = SamplingParams.from_json({
        "max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "frequency_penalty": -2, "presence_penalty": 2, "repetition_penalty": 1.2,
        "min_new_tokens": 7, "stop": ["\n", "END"], "stop_token_ids": [2, 5, 2],
        "ignore_eos": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "no_stop_trim": True, "n": 3,
        "sampling_seed": 42, "logit_bias": {"11": 5, "007": -1.5},
    })
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.7, 0.9, 40, 0.05)
    assert type(p.frequency_penalty) is float and p.frequency_penalty == -2.0
    assert p.stop == ["\n", "END"] and p.stop_token_ids == [2, 5]
    assert p.logit_bias == {"11": 5.0, "7": -1.5}
    assert (p.ignore_eos, p.skip_special_tokens, p.no_stop_trim, p.n, p.sampling_seed) == (
        True, False, True, 3, 42)


def test_int_for_float_and_str_stop_and_nulls():
    p = SamplingParams.from_json({"temperature": 1, "top_p": 1, "stop": "###",
                                  "top_k": None, "logit_bias": {}})
    assert type(p.temperature) is float and type(p.top_p) is float
    assert p.stop == ["###"] and p.logit_bias is None
    # null means the default, as in SGLang
    assert SamplingParams.from_json({k: None for k in ("temperature", "top_p", "top_k", "n",
                                     "stop", "stop_token_ids", "ignore_eos", "sampling_seed",
                                     "logit_bias")}) == SamplingParams()
    # SGLang parameters we do not implement are tolerated when null, and so are the
    # constraints
    assert SamplingParams.from_json({"regex": None, "json_schema": None, "ebnf": None,
                                     "stop_regex": None, "structural_tag": None}) == \
        SamplingParams()


def test_greedy():
    assert SamplingParams.from_json({"temperature": 0}).is_greedy
    assert SamplingParams.from_json({"temperature": 1e-7}).is_greedy
    assert SamplingParams.from_json({"top_k": 1}).is_greedy
    assert not SamplingParams.from_json({"temperature": 1e-5}).is_greedy
    # As in SGLang, a greedy temperature overrides top_k (which is then not checked).
    assert SamplingParams.from_json({"temperature": 0, "top_k": 0}).top_k == 1


@pytest.mark.parametrize("obj, message", [
    ([{"top_p": 0.5}], "sampling_params must be an object, got list."),
    ("x", "sampling_params must be an object, got str."),
    ({"foo": 1}, "Unknown sampling parameter 'foo'."),
    ({"max_tokens": 1}, "Unknown sampling parameter 'max_tokens'."),
    ({"stop_regex": "a+"}, "Sampling parameter 'stop_regex' is not supported."),
    ({"structural_tag": "{}"}, "Sampling parameter 'structural_tag' is not supported."),
    ({"regex": 1}, "sampling_params.regex must be a string, got int."),
    ({"regex": ""}, "sampling_params.regex must not be empty."),
    ({"ebnf": ["root ::= x"]}, "sampling_params.ebnf must be a string, got list."),
    ({"regex": "a" * 1_000_001}, "sampling_params.regex may be at most 1000000 characters "
                                 "long, got 1000001."),
    ({"json_schema": 3}, "json_schema must be a JSON object (a JSON Schema), got int."),
    ({"json_schema": "[1]"}, "json_schema must be a JSON object (a JSON Schema), got list."),
    ({"json_schema": "{"}, "json_schema is not valid JSON: Expecting property name enclosed "
                           "in double quotes: line 1 column 2 (char 1)."),
    ({"json_schema": {"maximum": float("nan")}},
     "json_schema is not valid JSON: Out of range float values are not JSON compliant."),
    ({"regex": "a", "ebnf": "root ::= \"a\""},
     "Only one of regex, json_schema, or ebnf can be set."),
    ({"json_schema": {}, "regex": "a"}, "Only one of regex, json_schema, or ebnf can be set."),
    ({"top_p": "0.5"}, "sampling_params.top_p must be a number, got str."),
    ({"temperature": True}, "sampling_params.temperature must be a number, got bool."),
    ({"max_new_tokens": 1.0}, "sampling_params.max_new_tokens must be an integer, got float."),
    ({"top_k": True}, "sampling_params.top_k must be an integer, got bool."),
    ({"n": "2"}, "sampling_params.n must be an integer, got str."),
    ({"ignore_eos": 1}, "sampling_params.ignore_eos must be a boolean, got int."),
    ({"sampling_seed": 1.5}, "sampling_params.sampling_seed must be an integer, got float."),
    ({"stop": 3}, "sampling_params.stop must be a string or a list of strings."),
    ({"stop": ["a", 1]}, "sampling_params.stop must be a string or a list of strings."),
    ({"stop": [str(i) for i in range(33)]},
     "sampling_params.stop may have at most 32 entries, got 33."),
    ({"stop": ""}, "sampling_params.stop must not contain an empty string."),
    ({"stop_token_ids": 2}, "sampling_params.stop_token_ids must be a list of non-negative "
                            "integers."),
    ({"stop_token_ids": [1, True]}, "sampling_params.stop_token_ids must be a list of "
                                    "non-negative integers."),
    ({"stop_token_ids": [-1]}, "sampling_params.stop_token_ids must be a list of "
                               "non-negative integers."),
    ({"logit_bias": [1]}, "sampling_params.logit_bias must be an object mapping token ids "
                          "to numbers, got list."),
    ({"logit_bias": {"a": 1}}, "sampling_params.logit_bias keys must be token ids, got 'a'."),
    ({"logit_bias": {"-1": 1}}, "sampling_params.logit_bias keys must be token ids, got '-1'."),
    ({"logit_bias": {"1": "x"}}, "sampling_params.logit_bias['1'] must be a number, got str."),
    ({"max_new_tokens": None}, "sampling_params.max_new_tokens=null (until the context "
                               "length) is not supported; pass an integer."),
])
def test_rejects_bad_shapes(obj, message):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_json(obj)
    assert str(e.value) == message


@pytest.mark.parametrize("obj, message", [
    # SGLang's SamplingParams.verify messages, word for word.
    ({"temperature": -0.1}, "temperature must be a non-negative finite number, got -0.1."),
    ({"temperature": float("inf")}, "temperature must be a non-negative finite number, got inf."),
    ({"temperature": float("nan")}, "temperature must be a non-negative finite number, got nan."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan."),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
    ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5."),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3.0."),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                                "got 0.0."),
    ({"repetition_penalty": 2.01}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                                   "got 2.01."),
    ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    ({"max_new_tokens": 4, "min_new_tokens": 5},
     "min_new_tokens must be in [0, max_new_tokens(4)], got 5."),
    ({"n": 0}, "n must be at least 1, got 0."),
    ({"sampling_seed": 2**64}, f"sampling_seed must fit in 64 bits, got {2**64}."),
    ({"logit_bias": {"3": float("inf")}}, "logit_bias values must be finite, got inf for "
                                          "token 3."),
])
def test_rejects_out_of_range_with_sglang_messages(obj, message):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_json(obj)
    assert str(e.value) == message


def test_boundaries_are_accepted():
    SamplingParams.from_json({"top_p": 1.0, "min_p": 1.0, "top_k": -1, "max_new_tokens": 0,
                              "frequency_penalty": 2.0, "presence_penalty": -2.0,
                              "repetition_penalty": 2.0, "temperature": 0.0})
    SamplingParams.from_json({"top_p": 1e-9, "min_p": 0.0, "top_k": 1, "min_new_tokens": 5,
                              "max_new_tokens": 5, "sampling_seed": -(2**63)})


def test_verify_vocab():
    p = SamplingParams.from_json({"logit_bias": {"9": 1.0}})
    p.verify_vocab(10)
    with pytest.raises(ValueError, match=r"^logit_bias must has keys in \[0, 8\], got 9\.$"):
        p.verify_vocab(9)


def test_annotations_are_wire_types():
    # The codec rebuilds SamplingParams from these annotations.
    allowed = [int, float, str, bool, list[int], list[str], dict[str, float], int | None,
               dict[str, float] | None, str | None]
    for f in msgspec.structs.fields(SamplingParams):
        assert f.type in allowed, f.name


@pytest.mark.parametrize("obj, message", [
    # What float32 (the scheduler's sampling dtype) cannot carry.
    ({"temperature": 1e39}, "temperature must be at most 3.4028234663852886e+38 (the float32 "
                            "maximum), got 1e+39."),
    ({"temperature": 3.5e38, "min_new_tokens": 2},
     "temperature must be at most 3.4028234663852886e+38 (the float32 maximum), got 3.5e+38."),
    ({"top_p": 1e-300}, "top_p must be at least 1.1754943508222875e-38 (the smallest normal "
                        "float32), got 1e-300."),
    ({"top_p": 1e-46}, "top_p must be at least 1.1754943508222875e-38 (the smallest normal "
                       "float32), got 1e-46."),
    ({"repetition_penalty": 1e-300}, "repetition_penalty must be at least "
                                     "1.1754943508222875e-38 (the smallest normal float32), "
                                     "got 1e-300."),
])
def test_rejects_what_float32_cannot_carry(obj, message):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_json(obj)
    assert str(e.value) == message


def test_float32_extremes_that_fit_are_accepted():
    SamplingParams.from_json({"temperature": 3.4e38, "top_p": 1.2e-38,
                              "repetition_penalty": 1.2e-38})


@pytest.mark.parametrize("params, message", [
    (SamplingParams(top_p=1e-300), "top_p must be at least"),
    (SamplingParams(temperature=float("nan")), "temperature must be a non-negative finite"),
    (SamplingParams(max_new_tokens=-5), "max_new_tokens must be at least 0"),
    (SamplingParams(stop=[""]), "must not contain an empty string"),
    (SamplingParams(stop=["x"] * 33), "at most 32 entries"),
    (SamplingParams(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative"),
    (SamplingParams(stop_token_ids=[10]), "stop_token_ids contains 10, outside the "
                                          "vocabulary [0, 10)."),
    (SamplingParams(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
    (SamplingParams(logit_bias={"10": 1.0}), "logit_bias must has keys in [0, 9], got 10."),
    (SamplingParams(logit_bias={"1": float("nan")}), "logit_bias values must be finite"),
    (SamplingParams(sampling_seed=-(2**63) - 1), "sampling_seed must fit in 64 bits"),
    (SamplingParams(regex=""), "sampling_params.regex must not be empty."),
    (SamplingParams(json_schema="[]"), "json_schema must be a JSON object"),
    (SamplingParams(json_schema="{"), "json_schema is not valid JSON"),
    (SamplingParams(regex="a", ebnf="b"), "Only one of regex, json_schema, or ebnf"),
], ids=str)
def test_verify_checks_params_that_skipped_from_json(params, message):
    # A TokenizedRequest decoded off the scheduler's socket carries SamplingParams built by
    # the codec, not by from_json: verify() repeats every check.
    with pytest.raises(ValueError) as e:
        params.verify(vocab_size=10)
    assert message in str(e.value)


def test_verify_accepts_what_from_json_builds():
    p = SamplingParams.from_json({"stop": ["a"], "stop_token_ids": [9], "logit_bias": {"3": 2},
                                  "temperature": 0.5, "sampling_seed": 7})
    p.verify(vocab_size=10)
    SamplingParams().verify()


# ---- constraints --------------------------------------------------------------------------

def test_constraints_are_kept_and_the_schema_travels_as_compact_json():
    schema = {"type": "object", "properties": {"b": {"enum": ["é", 1]}, "a": {}}}
    p = SamplingParams.from_json({"json_schema": schema})
    assert p.json_schema == '{"type":"object","properties":{"b":{"enum":["\\u00e9",1]},"a":{}}}'
    assert json.loads(p.json_schema) == schema            # key order kept: it is output order
    assert p.grammar == ("json_schema", p.json_schema)
    # a string holding the schema (SGLang's form) is the same constraint: one cache entry
    assert SamplingParams.from_json({"json_schema": json.dumps(schema, indent=2)}) == p
    with pytest.raises(SamplingError, match="must be a JSON object"):
        SamplingParams.from_json({"json_schema": True})
    assert SamplingParams.from_json({"regex": r"\d+"}).grammar == ("regex", r"\d+")
    assert SamplingParams.from_json({"ebnf": 'root ::= "a"'}).grammar == ("ebnf", 'root ::= "a"')
    assert SamplingParams().grammar is None
    p.verify(vocab_size=10)


def test_with_json_schema_is_the_internal_way_to_constrain():
    p = SamplingParams.from_json({"regex": "a+", "temperature": 0})
    q = p.with_json_schema({"type": "integer"})
    assert q.grammar == ("json_schema", '{"type":"integer"}') and q.regex is None
    assert q.temperature == 0 and p.regex == "a+"          # a copy
    with pytest.raises(SamplingError, match="must be a JSON object") as e:
        p.with_json_schema([1])
    assert e.value.key == "json_schema"
