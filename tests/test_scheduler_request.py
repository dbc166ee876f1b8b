"""Unit tests for scheduler_proc/request.py Req: state derived from lists."""

from __future__ import annotations

import pytest
import torch

from scheduler_proc.request import Req
from wire.codec import decode, encode
from wire.messages import DecodeParams, TokenizedRequest
from wire.sampling import SamplingParams


def _req(input_ids=(10, 11, 12, 13), output_ids=(), **sampling) -> Req:
    msg = TokenizedRequest(rid="r1", input_ids=list(input_ids),
                           sampling=SamplingParams(**sampling), stream=True)
    req = Req(decode(encode(msg)))          # as the scheduler gets it: off the wire
    req.output_ids.extend(output_ids)
    return req


def test_fresh_req_from_tokenized_request():
    req = _req(max_new_tokens=5)
    assert req.rid == "r1" and req.stream is True
    assert req.input_ids == [10, 11, 12, 13] and req.output_ids == []
    assert req.slots == [] and req.row is None and req.finish is None
    assert req.queue_time is None and not req.announced
    assert req.num_computed == 0 and req.seq_len == 4
    assert req.sampling.max_new_tokens == 5
    assert req.generator is None


@pytest.mark.parametrize("start, end, want", [
    (0, 4, [10, 11, 12, 13]),           # the whole prompt
    (1, 3, [11, 12]),                   # inside the prompt
    (0, 0, []),
    (4, 4, []),                         # empty at the boundary
    (0, 6, [10, 11, 12, 13, 20, 21]),   # everything
    (2, 5, [12, 13, 20]),               # across the boundary
    (3, 6, [13, 20, 21]),
    (4, 5, [20]),                       # starts exactly at the boundary
    (4, 6, [20, 21]),
    (5, 6, [21]),                       # inside the output
    (6, 6, []),
])
def test_token_ids_across_the_prompt_output_boundary(start, end, want):
    req = _req(output_ids=[20, 21])
    assert req.token_ids(start, end) == want
    full = req.input_ids + req.output_ids
    assert req.token_ids(start, end) == full[start:end]


def test_token_ids_returns_a_copy():
    req = _req(output_ids=[20])
    got = req.token_ids(0, 5)
    got.append(99)
    got2 = req.token_ids(0, 4)
    got2[0] = -1
    assert req.input_ids == [10, 11, 12, 13] and req.output_ids == [20]


def test_token_ids_every_window_matches_concatenation():
    req = _req(input_ids=[1, 2, 3], output_ids=[4, 5, 6, 7])
    full = [1, 2, 3, 4, 5, 6, 7]
    for start in range(len(full) + 1):
        for end in range(start, len(full) + 1):
            assert req.token_ids(start, end) == full[start:end], (start, end)


@pytest.mark.parametrize("prompt_len, max_new, want", [
    (4, 1, 4), (4, 2, 5), (4, 128, 131), (4, 0, 4), (1, 10, 10),
])
def test_max_total_tokens(prompt_len, max_new, want):
    # The last sampled token's KV is never computed.
    req = _req(input_ids=range(prompt_len), max_new_tokens=max_new)
    assert req.max_total_tokens == want


def test_num_computed_and_seq_len_are_derived():
    req = _req()
    req.slots.extend([7, 8, 9])
    assert req.num_computed == 3
    req.output_ids.append(30)
    req.slots.extend([1, 2])
    assert req.num_computed == 5 and req.seq_len == 5
    req.slots = []                          # retracted: KV released
    assert req.num_computed == 0 and req.seq_len == 5


def test_seeded_request_gets_its_own_generator():
    a, b = _req(sampling_seed=42), _req(sampling_seed=42)
    assert isinstance(a.generator, torch.Generator) and a.generator is not b.generator
    assert a.generator.initial_seed() == 42
    x = torch.rand(4, generator=a.generator)
    y = torch.rand(4, generator=b.generator)
    assert torch.equal(x, y)


def test_decode_params_copy_the_sampling_fields():
    req = _req(stop=["###", "\n"], skip_special_tokens=False,
               spaces_between_special_tokens=False, no_stop_trim=True)
    dp = req.decode_params()
    assert dp == DecodeParams(skip_special_tokens=False, spaces_between_special_tokens=False,
                              stop=["###", "\n"], no_stop_trim=True)
    dp.stop.append("x")
    assert req.sampling.stop == ["###", "\n"]
    assert _req().decode_params() == DecodeParams()
