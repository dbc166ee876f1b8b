"""Priority scheduling (--enable-priority-scheduling; scheduler.py's `rank`, `enqueue`,
`preempt`): with test_scheduler_unit's fake runner, requests queued behind a running one
start in priority order (higher first, or lower with --schedule-low-priority-values-first;
arrival order without the flag); a waiting request preempts a running one whose priority is
at least the threshold lower, which resumes later with its output intact; memory pressure
retracts the worst-ranked request, not the newest. Served: `priority` reaches the scheduler
from /generate and the OpenAI routes, and a bad one is a 400."""

from __future__ import annotations

import re
import threading

import pytest

from test_scheduler_unit import finishes, make, request, run_until_idle, token_after
from tests.server import serving, wait_running, wait_until
from wire.messages import replace


def first_tokens(batches) -> list[str]:
    """The rids in the order their first token came out."""
    order: list[str] = []
    for b in batches:
        for o in b.outputs:
            if o.new_ids and o.rid not in order:
                order.append(o.rid)
    return order


def queued(priorities: dict[str, int], **flags) -> list[str]:
    """One request running (max_running 1) while the others queue with these priorities;
    the order the queued ones start in."""
    s, batches, _ = make(max_running=1, **flags)
    s.step([request("first", max_new_tokens=3, ignore_eos=True)])
    run_until_idle(s, [_with_priority(request(rid, max_new_tokens=2, ignore_eos=True), p)
                       for rid, p in priorities.items()])
    assert set(finishes(batches)) == {"first", *priorities}
    return [rid for rid in first_tokens(batches) if rid != "first"]


def _with_priority(msg, priority: int):
    return replace(msg, priority=priority)


PRIORITIES = {"a": 0, "b": 5, "c": 1, "d": 5}


def test_the_queue_starts_in_priority_order():
    assert queued(PRIORITIES, enable_priority_scheduling=True) == ["b", "d", "c", "a"]
    assert queued(PRIORITIES, enable_priority_scheduling=True,
                  schedule_low_priority_values_first=True) == ["a", "c", "b", "d"]
    assert queued(PRIORITIES) == ["a", "b", "c", "d"]          # without the flag: arrival


def test_a_much_higher_priority_preempts_and_the_preempted_resumes_intact():
    for gap, preempts in ((20, True), (5, False)):
        s, batches, _ = make(max_running=1, enable_priority_scheduling=True)
        s.step([request("low", max_new_tokens=30, ignore_eos=True)])
        for _ in range(3):
            s.step([])
        run_until_idle(s, [_with_priority(request("high", max_new_tokens=4, ignore_eos=True),
                                          gap)])
        ends = finishes(batches)
        assert ends["low"].type == ends["high"].type == "length"
        order = [o.rid for b in batches for o in b.outputs if o.finish is not None]
        assert order == (["high", "low"] if preempts else ["low", "high"]), (gap, order)
        assert s.preempted_total == (1 if preempts else 0)
        low = [i for b in batches for o in b.outputs if o.rid == "low" for i in o.new_ids]
        assert low == [token_after(3 + i) for i in range(30)]     # nothing lost or repeated
        assert s.kv.pool.num_free + s.kv.evictable == s.kv.pool.size


def test_a_better_priority_gets_the_step_that_admits_it_to_itself():
    """Its first chunk runs alone (the running rows wait that step), then everyone shares
    steps again; an equal priority, or a request already running before, shares at once."""
    for priority, alone in ((3, True), (0, False)):
        s, batches, _ = make(max_running=4, enable_priority_scheduling=True)
        s.step([request("a", max_new_tokens=20, ignore_eos=True),
                request("b", max_new_tokens=20, ignore_eos=True)])
        s.step([])
        s.runner.steps.clear()
        s.step([_with_priority(request("new", max_new_tokens=3, ignore_eos=True), priority)])
        first = [seg.req.rid for seg in s.runner.steps[0]]
        assert first == (["new"] if alone else ["a", "b", "new"]), (priority, first)
        s.step([])
        assert {seg.req.rid for seg in s.runner.steps[1]} == {"a", "b", "new"}
        run_until_idle(s)
        assert all(f.type == "length" for f in finishes(batches).values())
        a = [i for b in batches for o in b.outputs if o.rid == "a" for i in o.new_ids]
        assert a == [token_after(3 + i) for i in range(20)]       # nothing lost


def test_memory_pressure_retracts_the_lowest_priority_first():
    """Two requests overcommit a small pool (test_scheduler_unit's case); the one retracted
    is the lower priority, here the earlier arrival (without priorities, the newer)."""
    for flags, victim in (({"enable_priority_scheduling": True}, "old-low"),
                          ({}, "new-high")):
        s, batches, _ = make(pool=50, max_running=2, **flags)     # as test_scheduler_unit's
        s.step([_with_priority(request("old-low", max_new_tokens=30, ignore_eos=True), 0),
                _with_priority(request("new-high", max_new_tokens=30, ignore_eos=True), 9)])
        retracted = []
        for _ in range(200):
            running = {r.rid for r in s.running}
            s.step([])
            retracted += [rid for rid in running - {r.rid for r in s.running}
                          if rid not in finishes(batches)]
            if s.idle:
                break
        assert retracted and retracted[0] == victim, (flags, retracted)
        assert finishes(batches)["old-low"].type == finishes(batches)["new-high"].type \
            == "length"


@pytest.mark.e2e
def test_priority_reaches_the_scheduler_over_http(tiny_model, tmp_path):
    """One request at a time: while a long one runs, three of priorities 1, 7 and 3 queue;
    the long one is aborted and they run in priority order (the API's request log lines,
    written as each request ends, in the order the scheduler ended them: the clients'
    threads may see their answers in another order on a loaded machine). The OpenAI
    routes take the field too; one that is not an integer in range is a 400 on each."""
    with serving(tiny_model("llama"), "--enable-priority-scheduling",
                 "--max-running-requests", "1", "--log-level", "info", tmpdir=tmp_path) as s:
        def ask(name: str, priority: int, n: int) -> None:
            s.generate_ok(text=name, rid=name, priority=priority, sampling_params={
                "max_new_tokens": n, "ignore_eos": True})
        blocker = threading.Thread(target=ask, args=("blocker", 0, 480))
        blocker.start()
        wait_running(s)
        waiters = [threading.Thread(target=ask, args=(f"p{p}", p, 4)) for p in (1, 7, 3)]
        for t in waiters:
            t.start()
        wait_until(lambda: s.server_info()["queued_requests"] == 3,
                   what="three requests queued behind the long one")
        assert s.client.post("/abort_request", json={"rid": "blocker"}).json()["aborted"] == 1
        for t in [blocker, *waiters]:
            t.join(timeout=120)
        assert "zserve:preempted_requests_total" in s.client.get("/metrics").text
        assert s.server_info()["preempted_total"] == 0       # no gap above the threshold
        ended = re.findall(r"request (blocker|p\d) generate:", s.logs())
        assert ended == ["blocker", "p7", "p3", "p1"], ended
        assert re.search(r"request p7 generate: .*; length; priority 7", s.logs())
        r = s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                   "priority": 5})
        assert r.status_code == 200, r.text
        for path, body in (("/generate", {"text": "x", "priority": "high"}),
                           ("/v1/completions", {"prompt": "x", "priority": 1.5}),
                           ("/v1/chat/completions", {"messages": [
                               {"role": "user", "content": "x"}], "priority": 2**40})):
            r = s.client.post(path, json=body)
            assert r.status_code == 400 and "priority" in r.text, (path, r.text)


def test_preemption_only_when_it_lets_the_request_in():
    """A high priority that would still not fit after retracting every request it may
    (one: the other is within the threshold) retracts none; one that fits after the
    retraction gets in, and the memory estimate is not raised by it."""
    s, batches, _ = make(pool=60, max_running=2, enable_priority_scheduling=True)
    s.step([_with_priority(request("keep", max_new_tokens=30, ignore_eos=True), 25),
            _with_priority(request("low", max_new_tokens=5, ignore_eos=True), 0)])
    s.step([_with_priority(request("big", list(range(1, 41)), max_new_tokens=10,
                                   ignore_eos=True), 30)])
    assert s.preempted_total == 0 and {r.rid for r in s.running} == {"keep", "low"}
    run_until_idle(s)
    assert set(finishes(batches)) == {"keep", "low", "big"}

    s, batches, _ = make(pool=400, max_running=2, enable_priority_scheduling=True)
    s.step([request("a", max_new_tokens=30, ignore_eos=True),
            request("b", max_new_tokens=30, ignore_eos=True)])
    ratio = s.new_token_ratio
    s.step([_with_priority(request("urgent", max_new_tokens=3, ignore_eos=True), 11)])
    assert s.preempted_total == 1 and "urgent" in {r.rid for r in s.running}
    assert s.new_token_ratio <= ratio < 1.0
    run_until_idle(s)
    assert all(f.type == "length" for f in finishes(batches).values())
