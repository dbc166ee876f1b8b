"""Unit tests for api_proc/timing.py RequestTiming (DESIGN.md section 3)."""

from __future__ import annotations

import time

import pytest

from api_proc.timing import RequestTiming


def test_latencies_are_none_until_set():
    t = RequestTiming()
    assert t.first_output_at is None and t.finished_at is None
    assert t.first_token_latency is None and t.e2e_latency is None
    assert t.created_at <= time.monotonic()


def test_created_at_is_monotonic_clock_now():
    before = time.monotonic()
    t = RequestTiming()
    after = time.monotonic()
    assert before <= t.created_at <= after


def test_first_output_is_set_once_and_finish_waits_for_terminal():
    t = RequestTiming()
    c = t.created_at
    t.mark_output(c + 1.0, terminal=False)
    assert t.first_token_latency == pytest.approx(1.0)
    assert t.e2e_latency is None
    t.mark_output(c + 2.0, terminal=False)
    assert t.first_token_latency == pytest.approx(1.0)        # not moved by later outputs
    assert t.e2e_latency is None
    t.mark_output(c + 3.5, terminal=True)
    assert t.first_token_latency == pytest.approx(1.0)
    assert t.e2e_latency == pytest.approx(3.5)


def test_finish_is_set_once():
    t = RequestTiming()
    c = t.created_at
    t.mark_output(c + 1.0, terminal=False)
    t.mark_output(c + 2.0, terminal=True)
    t.mark_output(c + 9.0, terminal=True)                     # a late duplicate terminal
    t.mark_output(c + 10.0, terminal=False)
    assert t.first_token_latency == pytest.approx(1.0)
    assert t.e2e_latency == pytest.approx(2.0)


def test_terminal_first_output_sets_both():
    t = RequestTiming()
    c = t.created_at
    t.mark_output(c + 0.75, terminal=True)
    assert t.first_output_at == t.finished_at == c + 0.75
    assert t.first_token_latency == pytest.approx(0.75)
    assert t.e2e_latency == pytest.approx(0.75)
    assert t.first_token_latency == t.e2e_latency


def test_first_token_latency_not_above_e2e_with_real_clock():
    t = RequestTiming()
    t.mark_output(time.monotonic(), terminal=False)
    t.mark_output(time.monotonic(), terminal=False)
    t.mark_output(time.monotonic(), terminal=True)
    assert t.first_token_latency is not None and t.e2e_latency is not None
    assert 0.0 <= t.first_token_latency <= t.e2e_latency


def test_latencies_are_relative_to_created_at():
    t = RequestTiming()
    t.created_at = 100.0
    t.mark_output(100.25, terminal=False)
    t.mark_output(101.0, terminal=True)
    assert t.first_token_latency == 0.25 and t.e2e_latency == 1.0


def test_no_stray_attributes():
    t = RequestTiming()
    with pytest.raises(AttributeError):
        t.first_token_at = 1.0          # __slots__: a misspelled stamp is an error, not silent


def test_inter_token_latency_is_the_mean_gap_per_token_after_the_first_output():
    t = RequestTiming()
    t.created_at = 0.0
    t.mark_output(1.0, terminal=False, tokens=1)      # the first token: no gap yet
    assert t.mean_inter_token_latency is None and t.last_gap is None
    t.mark_output(1.5, terminal=False, tokens=1)
    assert t.last_gap == (0.5, 1)
    t.mark_output(2.5, terminal=False, tokens=4)      # a bunch: 0.25 s a token
    assert t.last_gap == (1.0, 4)
    t.mark_output(2.7, terminal=True, tokens=0)       # an end without tokens: no gap
    assert t.last_gap is None
    assert t.mean_inter_token_latency == pytest.approx((2.5 - 1.0) / 5)
    assert t.e2e_latency == pytest.approx(2.7)
