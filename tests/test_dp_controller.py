"""The data-parallel controller without sockets (dp_controller_proc): the balance policies,
and what the Controller sends where for each message it receives."""

from __future__ import annotations

import pytest

from dp_controller_proc.policy import RoundRobin, ShortestQueue
from dp_controller_proc.process import Controller
from wire.messages import (AbortRequest, ControlReply, FlushCacheRequest, ReleaseRequest,
                           ReplicaStatus, SchedulerLoad, TokenizedRequest)
from wire.sampling import SamplingParams


def status(replica: int, tokens: int, received: int) -> ReplicaStatus:
    return ReplicaStatus(SchedulerLoad(replica=replica, queued_tokens=tokens), received)


def test_round_robin_takes_turns_whatever_the_load():
    rr = RoundRobin(3)
    rr.status(0, status(0, 10**6, 0))
    assert [rr.pick(5) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_splits_a_burst_before_any_status_arrives():
    sq = ShortestQueue(2)
    picks = [sq.pick(100) for _ in range(40)]
    assert picks.count(0) == picks.count(1) == 20


def test_shortest_queue_follows_the_reported_load():
    sq = ShortestQueue(2)
    sq.status(0, status(0, 5000, 0))
    assert [sq.pick(100) for _ in range(3)] == [1, 1, 1]
    # Replica 1 reports it has taken all three (their tokens are in its load now): the
    # unacknowledged ones are no longer counted twice.
    sq.status(1, status(1, 300, 3))
    assert sq.estimate(1) == 300 and sq.estimate(0) == 5000
    sq.status(0, status(0, 0, 0))
    assert sq.pick(100) == 0


def test_shortest_queue_counts_only_what_a_status_has_not_seen():
    sq = ShortestQueue(2)
    sq.status(1, status(1, 10**6, 0))
    for _ in range(4):
        assert sq.pick(10) == 0
    sq.status(0, status(0, 25, 2))          # took 2 of the 4: 2 x 10 tokens still in flight
    assert sq.estimate(0) == 25 + 20


class Recorder:
    def __init__(self, replicas: int = 2, method: str = "round_robin", apis: int = 2):
        self.to_replicas: list[tuple[int, object]] = []
        self.to_apis: list[tuple[int, object]] = []
        self.c = Controller(replicas, method, apis,
                            lambda r, m: self.to_replicas.append((r, m)),
                            lambda k, m: self.to_apis.append((k, m)))


def req(rid: str, n: int = 3) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_ids=[1] * n, sampling=SamplingParams())


def test_requests_go_to_one_replica_aborts_and_releases_to_all():
    rec = Recorder()
    for rid in "abc":
        rec.c.handle(req(rid))
    assert [(r, m.rid) for r, m in rec.to_replicas] == [(0, "a"), (1, "b"), (0, "c")]
    rec.to_replicas.clear()
    for msg in (AbortRequest("b"), ReleaseRequest(["a", "c"])):
        rec.c.handle(msg)
    assert rec.to_replicas == [(0, AbortRequest("b")), (1, AbortRequest("b")),
                               (0, ReleaseRequest(["a", "c"])), (1, ReleaseRequest(["a", "c"]))]


def reply(req_id: str, ok: bool, replica: int, api: int = 1) -> ControlReply:
    return ControlReply(req_id, ok, "Cache flushed." if ok else "busy",
                        [SchedulerLoad(replica=replica)], api)


@pytest.mark.parametrize("oks,ok,message", [((True, True), True, "Cache flushed."),
                                            ((True, False), False, "busy")])
def test_a_flush_is_answered_once_every_replica_has(oks, ok, message):
    rec = Recorder()
    rec.c.handle(FlushCacheRequest("f", api=1))
    assert [r for r, _ in rec.to_replicas] == [0, 1]
    rec.c.handle(reply("f", oks[0], 0))
    assert rec.to_apis == []
    rec.c.handle(reply("f", oks[1], 1))
    ((api, answer),) = rec.to_apis
    assert api == 1 and answer.ok is ok and answer.message == message
    assert [x.replica for x in answer.loads] == [0, 1]
    rec.c.handle(reply("f", True, 0))            # a late or forged reply: nobody asked
    assert len(rec.to_apis) == 1 and rec.c.dropped == 1


def test_forged_messages_are_dropped_not_fatal():
    rec = Recorder()
    rec.c.handle(FlushCacheRequest("g", api=7))        # no such API process
    rec.c.handle(status(9, 10, 0))                     # no such replica
    assert rec.to_replicas == rec.to_apis == [] and rec.c.dropped == 2


def test_replica_status_steers_shortest_queue_through_the_controller():
    rec = Recorder(method="shortest_queue")
    rec.c.handle(status(0, 10**6, 0))
    rec.c.handle(req("x"))
    assert rec.to_replicas == [(1, req("x"))]
