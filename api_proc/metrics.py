"""Prometheus metrics (GET /metrics) and the request and throughput log lines.

Who measures what (README, "Metrics"):
- The API processes measure each request they took in, on their own monotonic clock, from
  the moment the request was accepted (api_proc/timing.py): time to first token, inter-token
  latency (per token: the gap between two outputs divided by the tokens the later one
  brought), end-to-end latency; and count requests (by route and finish reason), prompt,
  generated and cached tokens, aborted and rejected requests. With --api-server-count N > 1
  these are prometheus_client's multiprocess metrics: each process writes its own files in
  one directory (`metrics` in the server's private ipc directory) and /metrics, in
  whichever process answers, adds them all up. With one API process they are ordinary
  in-memory metrics.
- The scheduler measures, on its clock, each request's queue time (arrival at the
  scheduler to its first forward), prefill time (first forward to first token) and decode
  time (first token to the end); they reach the API in the request's last output
  (meta_info) and are observed there.
- The scheduler's state (running and queued requests, KV pool, token counters) rides on
  every output batch (wire.messages.SchedulerLoad, one per replica); /metrics reads the
  newest at scrape time, so no process runs a metrics server of its own.

Only requests that came through a route count (route set on their state): internal ones
(/health_generate probes, n > 1 prompt warm-ups) do not.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from wire.messages import SchedulerLoad, TextOutput

log = logging.getLogger("zserve.requests")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0, 640.0)
THROUGHPUT_WINDOW = 10.0    # seconds of load snapshots behind zserve:gen_throughput
LOG_INTERVAL = 10.0         # seconds between throughput lines while busy
LOG_TEXT_CHARS = 300        # --log-requests: characters of a prompt or output logged


def use_multiprocess_dir(ipc_dir: str) -> str:
    """The launcher, before any API process imports prometheus_client: every API process
    (they inherit the environment) writes its metrics under ipc_dir/metrics."""
    path = os.path.join(ipc_dir, "metrics")
    os.makedirs(path, exist_ok=True)
    os.environ[MULTIPROC_ENV] = path
    return path


class Metrics:
    """This process's metric objects (one per process: prometheus_client registers each
    name once). `finished(state, out, route)` and `output(...)` record; `render(loads)`
    is /metrics' body."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram
        multi = MULTIPROC_ENV in os.environ

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"zserve:{name}", doc, buckets=LATENCY_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds",
                         "API process: request accepted -> first output received.")
        self.itl = hist("inter_token_latency_seconds",
                        "API process: gap between outputs / tokens in the later one.")
        self.e2e = hist("e2e_request_latency_seconds",
                        "API process: request accepted -> last output received.")
        self.queue = hist("queue_time_seconds",
                          "Scheduler: arrival at the scheduler -> first forward.")
        self.prefill = hist("prefill_time_seconds",
                            "Scheduler: first forward -> first token sampled.")
        self.decode = hist("decode_time_seconds",
                           "Scheduler: first token sampled -> the end.")
        self.requests = Counter("zserve:requests", "Finished requests.",
                                ["route", "finish_reason"])
        self.prompt_tokens = Counter("zserve:prompt_tokens", "Prompt tokens of finished "
                                     "requests.")
        self.generation_tokens = Counter("zserve:generation_tokens", "Tokens generated "
                                         "for finished requests.")
        self.cached_tokens = Counter("zserve:cached_prompt_tokens", "Prompt tokens found "
                                     "in the prefix cache, of finished requests.")
        self.aborted = Counter("zserve:aborted_requests", "Requests that ended aborted "
                               "(by the client, a timeout, shutdown or an error).")
        self.rejected = Counter("zserve:rejected_requests", "Requests refused before "
                                "running (invalid, or the queue was full).", ["reason"])
        self.adapter_requests = Counter("zserve:lora_requests", "Finished requests run under "
                                        "a LoRA adapter (--enable-lora).", ["adapter"])
        self.priority_requests = Counter("zserve:priority_requests", "Finished requests by "
                                         "the sign of their priority.", ["priority_class"])
        self.in_flight = Gauge("zserve:requests_in_flight", "Requests the API processes "
                               "hold.", multiprocess_mode="livesum") if multi else \
            Gauge("zserve:requests_in_flight", "Requests the API processes hold.")

    def output(self, gap: tuple[float, int] | None) -> None:
        """An output that brought tokens `gap[0]` seconds after the previous one."""
        if gap is not None:
            seconds, tokens = gap
            for _ in range(tokens):
                self.itl.observe(seconds / tokens)

    def finished(self, out: TextOutput, route: str, ttft: float | None,
                 e2e: float | None, lora: str | None = None, priority: int = 0) -> None:
        f = out.finish
        kind = f.type if f is not None else "abort"
        self.requests.labels(route, kind).inc()
        self.priority_requests.labels(priority_class(priority)).inc()
        if lora is not None and f is not None and f.status_code is None:
            # Only requests that ran: a refused name (404) never makes a label, so clients
            # cannot grow the label set; loaded names are the admin's.
            self.adapter_requests.labels(lora).inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.cached_tokens.inc(out.cached_tokens)
        if kind == "abort":
            if f is not None and f.status_code == 400:
                self.rejected.labels("invalid").inc()
            else:
                self.aborted.inc()
        for hist, value in ((self.ttft, ttft), (self.e2e, e2e), (self.queue, out.queue_time),
                            (self.prefill, out.prefill_time), (self.decode, out.decode_time)):
            if value is not None:
                hist.observe(value)

    def render(self, loads: dict[int, SchedulerLoad], throughput: float) -> tuple[bytes, str]:
        """/metrics: this process's metrics (all API processes' in multiprocess mode) and
        the scheduler's gauges from the newest loads."""
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, \
            generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        ours = REGISTRY
        if MULTIPROC_ENV in os.environ:
            ours = CollectorRegistry()
            MultiProcessCollector(ours)
        scheduler = CollectorRegistry()
        scheduler.register(LoadCollector(loads, throughput))
        return generate_latest(ours) + generate_latest(scheduler), CONTENT_TYPE_LATEST


class LoadCollector:
    """The scheduler replicas' state, from their newest loads, labelled by dp_rank."""

    def __init__(self, loads: dict[int, SchedulerLoad], throughput: float):
        self.loads, self.throughput = loads, throughput

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"zserve:{name}", doc, labels=["dp_rank"])
            for r, x in sorted(self.loads.items()):
                g.add_metric([str(r)], value(x))
            return g
        yield gauge("num_running_reqs", "Requests in the running batch.", lambda x: x.running)
        yield gauge("num_queued_reqs", "Requests waiting to run.", lambda x: x.queued)
        yield gauge("kv_pool_total_tokens", "KV pool size in tokens.", lambda x: x.kv_total)
        yield gauge("kv_pool_usage", "Share of the KV pool held by requests (not free, not "
                    "an evictable cached prefix).",
                    lambda x: x.kv_used / x.kv_total if x.kv_total else 0.0)
        yield gauge("kv_pool_cached_share", "Share of the KV pool holding evictable cached "
                    "prefixes.", lambda x: x.kv_evictable / x.kv_total if x.kv_total else 0.0)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / "
                    "prompt tokens, since start.",
                    lambda x: x.cached_tokens_total / x.prompt_tokens_total
                    if x.prompt_tokens_total else 0.0)
        retracted = CounterMetricFamily("zserve:retracted_requests", "Requests retracted "
                                        "to free KV memory (the scheduler's count).",
                                        labels=["dp_rank"])
        preempted = CounterMetricFamily("zserve:preempted_requests", "Of those, retracted "
                                        "for a request of higher priority "
                                        "(--enable-priority-scheduling).", labels=["dp_rank"])
        for r, x in sorted(self.loads.items()):
            retracted.add_metric([str(r)], x.retracted_total)
            preempted.add_metric([str(r)], x.preempted_total)
        yield retracted
        yield preempted
        yield GaugeMetricFamily("zserve:gen_throughput", "Generated tokens per second over "
                                f"the last {THROUGHPUT_WINDOW:g} s (all replicas).",
                                value=self.throughput)
        yield from self.speculative()

    def speculative(self):
        """Speculative decoding's counters (where the server speculates): drafts verified
        and kept, and the tokens each verify step kept (SGLang's spec_accept_length is
        their mean)."""
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        loads = sorted((r, x) for r, x in self.loads.items() if x.spec_accept_hist)
        if not loads:
            return
        drafted = CounterMetricFamily("zserve:spec_draft_tokens", "Draft tokens verified.",
                                      labels=["dp_rank"])
        kept = CounterMetricFamily("zserve:spec_accepted_tokens", "Draft tokens kept.",
                                   labels=["dp_rank"])
        rate = GaugeMetricFamily("zserve:spec_accept_rate", "Draft tokens kept / verified, "
                                 "since start.", labels=["dp_rank"])
        length = GaugeMetricFamily("zserve:spec_accept_length", "Tokens a verify step made "
                                   "on average (the drafts kept and its own), since "
                                   "start.", labels=["dp_rank"])
        hist = HistogramMetricFamily("zserve:spec_verify_step_tokens", "Tokens each verify "
                                     "step kept.", labels=["dp_rank"])
        for r, x in loads:
            verify, accepted = x.spec_verify_total, x.spec_accepted_total
            drafted.add_metric([str(r)], x.spec_draft_total)
            kept.add_metric([str(r)], accepted)
            rate.add_metric([str(r)], accepted / x.spec_draft_total if x.spec_draft_total
                            else 0.0)
            length.add_metric([str(r)], x.spec_accept_length or 0.0)
            counts, buckets = 0, []
            for m, n in enumerate(x.spec_accept_hist):
                if m:
                    counts += n
                    buckets.append((str(m), counts))
            hist.add_metric([str(r)], buckets + [("+Inf", counts)], accepted + verify)
        yield from (drafted, kept, rate, length, hist)


class Throughput:
    """Tokens per second from the loads' counters: the newest snapshots of the last
    THROUGHPUT_WINDOW seconds (every API process sees every load, so all agree)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int]] = deque()   # (time, prompt, generated)

    def add(self, total: SchedulerLoad, now: float) -> None:
        s = self.samples
        if s and now - s[-1][0] >= THROUGHPUT_WINDOW:
            s.clear()                           # after an idle gap: start a new span
        if s and now - s[-1][0] < 0.2:          # at most 5 a second
            s[-1] = (s[-1][0], total.prompt_tokens_total, total.generated_tokens_total)
            return
        s.append((now, total.prompt_tokens_total, total.generated_tokens_total))
        while len(s) > 2 and now - s[1][0] >= THROUGHPUT_WINDOW:
            s.popleft()

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """(prompt, generated) tokens per second from the oldest kept snapshot to now; 0
        when there is not yet a span, or nothing arrived for a whole window (idle)."""
        now = time.monotonic() if now is None else now
        s = self.samples
        if len(s) < 2 or now - s[-1][0] >= THROUGHPUT_WINDOW:
            return 0.0, 0.0
        (t0, p0, g0), (_, p1, g1) = s[0], s[-1]
        return (p1 - p0) / (now - t0), (g1 - g0) / (now - t0)


_METRICS: Metrics | None = None


def metrics() -> Metrics:
    """This process's Metrics (made on first use)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = Metrics()
    return _METRICS


def priority_class(priority: int) -> str:
    """A priority as a bounded label (any integer is a priority): its sign."""
    return "above_zero" if priority > 0 else "below_zero" if priority < 0 else "zero"


def request_line(rid: str, route: str, out: TextOutput, ttft: float | None,
                 e2e: float | None, priority: int = 0, lora: str | None = None) -> str:
    f = out.finish
    reason = f.type if f is not None else "abort"
    if f is not None and f.status_code is not None:
        reason += f" {f.status_code}"
    if priority:
        reason += f"; priority {priority}"
    if lora is not None:
        reason += f"; adapter {lora}"

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"
    return (f"request {rid} {route}: prompt {out.prompt_tokens}, completion "
            f"{out.completion_tokens}, cached {out.cached_tokens} tokens; ttft "
            f"{secs(ttft)} s, e2e {secs(e2e)} s; {reason}")


def throughput_line(total: SchedulerLoad, rates: tuple[float, float]) -> str:
    used = total.kv_used
    hit = total.cached_tokens_total / total.prompt_tokens_total \
        if total.prompt_tokens_total else 0.0
    return (f"running {total.running}, queued {total.queued}; {rates[0]:.1f} tok/s in, "
            f"{rates[1]:.1f} tok/s out; KV pool {used / max(total.kv_total, 1):.0%} used, "
            f"{total.kv_evictable / max(total.kv_total, 1):.0%} cached; prefix cache hit "
            f"rate {hit:.0%}")


def clip(text: str) -> str:
    return text if len(text) <= LOG_TEXT_CHARS else text[:LOG_TEXT_CHARS] + "..."
