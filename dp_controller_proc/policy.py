"""Which scheduler replica gets a request (--load-balance-method): pure policies, no sockets.

`pick(tokens)` chooses a replica for a request whose prompt is `tokens` tokens long and
counts it as sent there; `status(replica, msg)` takes a replica's
ReplicaStatus. Ties go to the lowest index after the last pick, so equal replicas take
turns.
"""

from __future__ import annotations

from collections import deque

from wire.messages import ReplicaStatus


class RoundRobin:
    """Replicas in turn, whatever their load (SGLang's round_robin)."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.next = 0

    def pick(self, tokens: int) -> int:
        r = self.next
        self.next = (r + 1) % self.replicas
        return r

    def status(self, replica: int, msg: ReplicaStatus) -> None:
        pass


class ShortestQueue:
    """The replica with the fewest tokens in its requests: queued + running tokens of its
    newest status (each request's current length: prompt + tokens so far), plus the
    prompts of the requests sent to it that the status did not yet count (sent after it
    was taken). Without that last term a burst of requests, all picked before any replica
    reports again, would all go to the same replica.

    Invariant: unacked[r] holds the prompt lengths of the requests sent to replica r after
    the first `acked[r]` ones, oldest first (ZeroMQ keeps one sender's order, so replica r
    receives them in this order), and unacked_sum[r] is their sum."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.base = [0] * replicas              # queued + running tokens, newest status
        self.acked = [0] * replicas             # requests counted in that status
        self.unacked: list[deque[int]] = [deque() for _ in range(replicas)]
        self.unacked_sum = [0] * replicas
        self.last = -1

    def estimate(self, replica: int) -> int:
        return self.base[replica] + self.unacked_sum[replica]

    def pick(self, tokens: int) -> int:
        order = [(self.last + 1 + i) % self.replicas for i in range(self.replicas)]
        r = min(order, key=self.estimate)       # min keeps the first of equals
        self.unacked[r].append(tokens)
        self.unacked_sum[r] += tokens
        self.last = r
        return r

    def status(self, replica: int, msg: ReplicaStatus) -> None:
        self.base[replica] = msg.load.queued_tokens + msg.load.running_tokens
        pending = self.unacked[replica]
        while self.acked[replica] < msg.received and pending:
            self.unacked_sum[replica] -= pending.popleft()
            self.acked[replica] += 1
        self.acked[replica] = max(self.acked[replica], msg.received)


POLICIES = {"round_robin": RoundRobin, "shortest_queue": ShortestQueue}
