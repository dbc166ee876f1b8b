"""A bounded soak: a mixed workload at a chosen concurrency, then checks that the server
ended where it started.

    python -m bench.soak (--model-path DIR | --base-url URL) [--duration 60] [--requests N]
        [--concurrency 16] [--max-new-tokens 32] [--server-args "..."]
        [--max-rss-growth-mb 200] [--warmup SECONDS] [--mix unary=30,batch=15,...]
        [--seed 0] [--drain-timeout 60] [--deadline SECONDS] [--json PATH]

With --model-path, launch.py is started on a free port (tests/server.py's harness) and
stopped with SIGTERM at the end (it must exit 0); with --base-url, a running server is used
and its processes are found by the port it listens on (RSS is skipped if they cannot be).

Workload: `concurrency` clients, each looping until --duration seconds have passed or
--requests requests were started, whichever comes first, over a seeded random mix (weights
from --mix; by default 30/15/25/15/15) of
- unary:      one /generate, checked: 200, completion_tokens == max_new_tokens (ignore_eos);
- batch:      a /generate of 2..4 prompts, checked the same way, answers in input order;
- stream:     a streaming /generate read to `data: [DONE]`, the last frame checked;
- abort:      a streaming request that would run to the context's end, aborted with
              POST /abort_request {rid} after its first frame; its stream must end with an
              abort finish reason and `data: [DONE]`, or, where the abort found nothing
              (`aborted: 0`: on a fast model the request can run to its end before the abort
              is read), with the request's full length; those are counted as late aborts;
- disconnect: a streaming request that would run to the context's end, whose client hangs
              up after 0..8 frames.
Prompts are random token ids in [10, 700) (valid for the tiny test tokenizer too).

Connections: a client holds one connection at a time (the workload's pool has one per
client, so it never waits on the pool); /abort_request goes through a client of its own,
since the stream it aborts still holds its connection, unread, until the abort ends it (with
one pool of `concurrency` connections, `concurrency` aborts at once each waited for a
connection the others held: a deadlock until the 300 s pool timeout).

Bounded time: each phase stops starting requests at its deadline; requests still running
--drain-timeout seconds later are cancelled and counted as failed ("still running at the
deadline"). --deadline (default: the sum of the phases' bounds) caps the whole run from the
first request to the last check; a run that reaches it fails.

Checks at the end (any failure: exit status 1):
- every request got what its kind expects (errors are counted by kind, first few printed);
- the server goes idle: running, queued and in-flight requests all reach 0;
- the KV pool is back at its idle invariant: free + evictable == total;
- no server process grew its RSS by more than --max-rss-growth-mb since the baseline,
  taken after a warm-up (one request of each kind, then --warmup seconds of the same load;
  the warm-up's requests are checked too, but not counted in the summary's table);
- the run ended within --deadline;
- a launched server exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
import psutil

from tests.server import Server     # the one harness for launching zserve as a subprocess

TOKEN_LOW, TOKEN_HIGH = 10, 700
KINDS = {"unary": 30, "batch": 15, "stream": 25, "abort": 15, "disconnect": 15}   # weights
MB = 1024 * 1024


class Failed(Exception):
    """A request did not get what its kind expects."""


@dataclass
class Tally:
    started: Counter = field(default_factory=Counter)
    ok: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    first_errors: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    late_aborts: int = 0        # aborts that came after their request's end (see abort)


# ---------------------------------------------------------------------------------------
# The workload


class Workload:
    """The kinds of request. `client` carries the requests themselves, one at a time per
    client loop; `control` carries the side requests a kind makes while its own request
    still holds a connection (/abort_request), so those never wait for that pool."""

    def __init__(self, client: httpx.AsyncClient, control: httpx.AsyncClient, context: int,
                 max_new: int, rng: random.Random, tally: Tally):
        self.client, self.control = client, control
        self.context, self.max_new, self.rng, self.tally = context, max_new, rng, tally

    def prompt(self) -> list[int]:
        return [self.rng.randrange(TOKEN_LOW, TOKEN_HIGH)
                for _ in range(self.rng.randrange(4, 33))]

    def sampling(self, max_new: int) -> dict:
        return {"max_new_tokens": max_new, "ignore_eos": True,
                "temperature": self.rng.choice((0.0, 0.8))}

    def long_sampling(self, prompt: list[int]) -> dict:
        """A request that would run to the end of the context."""
        return {"max_new_tokens": self.context - len(prompt) - 1, "ignore_eos": True}

    async def run(self, kind: str) -> None:
        await getattr(self, kind)()

    async def unary(self) -> None:
        n = self.rng.randrange(1, self.max_new + 1)
        r = await self.client.post("/generate", json={"input_ids": self.prompt(),
                                                      "sampling_params": self.sampling(n)})
        expect(r.status_code == 200, f"unary: {r.status_code} {r.text[:200]}")
        check_length(r.json(), n, "unary")

    async def batch(self) -> None:
        ns = [self.rng.randrange(1, self.max_new + 1) for _ in range(self.rng.randrange(2, 5))]
        r = await self.client.post("/generate", json={
            "input_ids": [self.prompt() for _ in ns],
            "sampling_params": [self.sampling(n) for n in ns]})
        expect(r.status_code == 200, f"batch: {r.status_code} {r.text[:200]}")
        outs = r.json()
        expect(isinstance(outs, list) and len(outs) == len(ns), f"batch: {str(outs)[:200]}")
        for out, n in zip(outs, ns):
            check_length(out, n, "batch")

    async def stream(self) -> None:
        n = self.rng.randrange(1, self.max_new + 1)
        frames = await self.read_stream({"input_ids": self.prompt(),
                                         "sampling_params": self.sampling(n)})
        expect(bool(frames), "stream: no frames")
        check_length(frames[-1], n, "stream")

    async def abort(self) -> None:
        prompt = self.prompt()
        rid = f"soak-abort-{uuid.uuid4().hex}"
        aborted = []

        async def on_first_frame():
            r = await self.control.post("/abort_request", json={"rid": rid})
            expect(r.status_code == 200, f"abort_request: {r.status_code} {r.text[:200]}")
            aborted.append(r.json().get("aborted"))
        sampling = self.long_sampling(prompt)
        frames = await self.read_stream({"input_ids": prompt, "rid": rid,
                                         "sampling_params": sampling},
                                        on_first_frame=on_first_frame)
        if aborted == [0]:      # it had ended when the abort was read: it must be whole
            check_length(frames[-1], sampling["max_new_tokens"], "abort (late)")
            self.tally.late_aborts += 1
            return
        reason = frames[-1]["meta_info"]["finish_reason"]
        expect(aborted == [1] and reason is not None and reason["type"] == "abort",
               f"abort: /abort_request answered {aborted} after the first frame; the "
               f"stream ended after {len(frames)} frames with {reason}")

    async def disconnect(self) -> None:
        prompt = self.prompt()
        await self.read_stream({"input_ids": prompt,
                                "sampling_params": self.long_sampling(prompt)},
                               hang_up_after=self.rng.randrange(0, 9))

    async def read_stream(self, body: dict, hang_up_after: int | None = None,
                          on_first_frame=None) -> list[dict]:
        frames: list[dict] = []
        async with self.client.stream("POST", "/generate",
                                      json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise Failed(f"stream: {r.status_code} {(await r.aread())[:200]!r}")
            if hang_up_after == 0:
                return frames
            async for line in r.aiter_lines():
                if not line or line.startswith(":"):      # an SSE comment: keep-alive
                    continue
                expect(line.startswith("data: "), f"stream: bad line {line[:100]!r}")
                if line == "data: [DONE]":
                    expect(hang_up_after is None, "disconnect: the request ended first")
                    return frames
                frames.append(json.loads(line[len("data: "):]))
                if len(frames) == 1 and on_first_frame is not None:
                    await on_first_frame()
                if len(frames) == hang_up_after:
                    return frames
        raise Failed("stream: ended without data: [DONE]")


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise Failed(message)


def check_length(out: dict, n: int, kind: str) -> None:
    meta = out["meta_info"]
    expect(meta["finish_reason"] == {"type": "length", "length": n} and
           meta["completion_tokens"] == n == len(out["output_ids"]),
           f"{kind}: wanted {n} tokens, got {meta}")


async def soak(base_url: str, args, context: int, tally: Tally, deadline: float,
               budget: list[int], hard_deadline: float,
               kinds: list[str] | None = None) -> None:
    """Clients loop until the deadline or the request budget (a shared countdown); with
    `kinds`, a single round: one request of each kind, in parallel. At hard_deadline the
    requests still running are cancelled and counted as failed."""
    rng = random.Random(args.seed)
    clients = len(kinds) if kinds is not None else args.concurrency
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout,
                                 limits=limits) as client, \
            httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout) as control:
        work = Workload(client, control, context, args.max_new_tokens, rng, tally)
        running: Counter = Counter()

        def failed(kind: str, why: str) -> None:
            tally.errors[kind] += 1
            if len(tally.first_errors) < 5:
                tally.first_errors.append(f"{kind}: {why}")

        async def one(kind: str) -> None:
            tally.started[kind] += 1
            running[kind] += 1
            t0 = time.monotonic()
            try:
                await work.run(kind)
            except Exception as e:      # any failure is the request's, not the soak's
                failed(kind, f"{type(e).__name__}: {e}")
                return
            finally:
                running[kind] -= 1
            tally.ok[kind] += 1
            tally.latencies[kind].append(time.monotonic() - t0)

        async def client_loop() -> None:
            names, weights = list(args.mix), list(args.mix.values())
            while time.monotonic() < deadline and budget[0] > 0:
                budget[0] -= 1
                await one(rng.choices(names, weights)[0])

        tasks = [asyncio.ensure_future(one(k)) for k in kinds] if kinds is not None else \
            [asyncio.ensure_future(client_loop()) for _ in range(args.concurrency)]
        _, late = await asyncio.wait(tasks, timeout=max(0.0, hard_deadline - time.monotonic()))
        if late:
            stuck = +running                # what the cancelled tasks were running
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            for kind, n in stuck.items():
                for _ in range(n):
                    failed(kind, f"still running at the deadline ({args.drain_timeout:g} s "
                                 f"after the phase's end)")


# ---------------------------------------------------------------------------------------
# The server: its state and its processes


def server_processes(pid: int | None, port: int) -> list[psutil.Process]:
    """The launcher (the API process) and its children; found by the port if no pid."""
    if pid is None:
        try:
            pid = next(c.pid for c in psutil.net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)
        except (StopIteration, psutil.AccessDenied):
            return []
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def label(p: psutil.Process) -> str:
    """zserve's children carry titles (zserve::scheduler); others are named by what runs."""
    try:
        cmdline = p.cmdline()
    except psutil.Error:
        cmdline = []
    if cmdline and cmdline[0].startswith("zserve::"):
        name = cmdline[0].removeprefix("zserve::")
    elif "resource_tracker" in " ".join(cmdline):
        name = "resource_tracker"
    else:
        name = p.name()
    return f"{name}[{p.pid}]"


def rss(procs: list[psutil.Process]) -> dict[str, int]:
    out = {}
    for p in procs:
        try:
            out[label(p)] = p.memory_info().rss
        except psutil.NoSuchProcess:
            out[label(p)] = -1
    return out


def wait_idle(client: httpx.Client, timeout: float) -> tuple[bool, dict]:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/server_info").json()
        if info["running_requests"] == info["queued_requests"] == \
                info["requests_in_flight"] == 0:
            return True, info
        if time.monotonic() > deadline:
            return False, info
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ---------------------------------------------------------------------------------------
# Main


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        kind, _, weight = part.partition("=")
        if kind.strip() not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        mix[kind.strip()] = float(weight or 1)
    if not any(w > 0 for w in mix.values()):
        raise argparse.ArgumentTypeError("no kind has a positive weight")
    return mix


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="A bounded soak of a zserve server.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model-path", help="launch a server on this checkpoint")
    where.add_argument("--base-url", help="soak a running server, e.g. http://127.0.0.1:30000")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--requests", type=int, default=1_000_000,
                   help="most requests to start after the warm-up (default: no practical "
                        "limit)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="upper bound of the normal requests' lengths")
    p.add_argument("--server-args", default="", help="extra launch.py flags (one string)")
    p.add_argument("--max-rss-growth-mb", type=float, default=200.0,
                   help="fail if any server process grew more than this (default 200)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of the same load before the RSS baseline (default: a "
                        "sixth of --duration); its requests are checked too")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds the server may take to go idle after the load")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds the requests still running at a phase's end may take "
                        "before they are cancelled and counted as failed (default 60)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds the whole run may take, from the first request to the "
                        "last check (default: the sum of the phases' bounds, warm-up + "
                        "duration + 3 drain timeouts + 2 idle timeouts); reaching it fails")
    p.add_argument("--mix", type=parse_mix, default=dict(KINDS),
                   help="kind=weight pairs, comma-separated (default "
                        + ",".join(f"{k}={w}" for k, w in KINDS.items()) + "); kinds left "
                        "out are not sent (after the warm-up's one of each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the summary here as JSON")
    args = p.parse_args(argv)
    warmup = args.duration / 6 if args.warmup is None else args.warmup
    if args.deadline is None:
        args.deadline = warmup + args.duration + 3 * args.drain_timeout + 2 * args.idle_timeout

    server = None
    if args.model_path:
        server = Server(args.model_path, *shlex.split(args.server_args),
                        tmpdir=tempfile.mkdtemp(prefix="zserve-soak-"), one_thread=False)
        base_url = server.url
    else:
        base_url = args.base_url.rstrip("/")
    checks: dict[str, tuple[bool, str]] = {}
    try:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            info = client.get("/server_info").json()
            context = info["context_length"]
            port = httpx.URL(base_url).port
            procs = server_processes(server.proc.pid if server else None, port)

            # Every phase ends by its own bound, and by the run's deadline.
            end_of_run = time.monotonic() + args.deadline

            def phase(tally: Tally, seconds: float, budget: int, kinds=None) -> None:
                now = time.monotonic()
                stop = min(now + seconds, end_of_run)
                asyncio.run(soak(base_url, args, context, tally, stop, [budget],
                                 min(stop + args.drain_timeout, end_of_run), kinds=kinds))

            def idle_wait() -> tuple[bool, dict]:
                return wait_idle(client, max(0.0, min(args.idle_timeout,
                                                      end_of_run - time.monotonic())))

            # Warm-up at full concurrency (one of each kind first), then the RSS baseline.
            warm = Tally()
            phase(warm, 0, 0, kinds=list(KINDS))
            phase(warm, warmup, args.requests)
            idle_wait()
            rss_start = rss(procs)
            before = client.get("/server_info").json()

            tally = Tally()
            t0 = time.monotonic()
            stop = threading.Event()        # RSS along the way: a leak climbs, a cache levels
            trail: list[dict[str, int]] = []

            def sample_rss() -> None:
                while not stop.wait(max(args.duration / 6, 1.0)):
                    trail.append(rss(procs))
            sampler = threading.Thread(target=sample_rss)
            sampler.start()
            try:
                phase(tally, args.duration, args.requests)
            finally:
                stop.set()
                sampler.join()
            elapsed = time.monotonic() - t0

            idle, after = idle_wait()
            rss_end = rss(procs)
            in_time = time.monotonic() <= end_of_run
    finally:
        code = server.terminate() if server else 0

    total, errors = sum(tally.started.values()), sum(tally.errors.values())
    warm_total, warm_errors = sum(warm.started.values()), sum(warm.errors.values())
    checks["requests"] = (errors == 0 and warm_errors == 0,
                          f"{total} started, {errors} failed (warm-up: {warm_total} started, "
                          f"{warm_errors} failed)")
    checks["idle"] = (idle, f"running {after['running_requests']}, queued "
                            f"{after['queued_requests']}, in flight "
                            f"{after['requests_in_flight']}")
    kv = after["kv_pool"]
    checks["kv pool"] = (kv["free"] + kv["evictable"] == kv["total"],
                         f"free {kv['free']} + evictable {kv['evictable']} vs total "
                         f"{kv['total']}")
    if procs:
        growth = {k: (rss_end[k] - rss_start[k]) / MB for k in rss_start}
        worst = max(growth.values())
        checks["rss"] = (worst <= args.max_rss_growth_mb and min(rss_end.values()) >= 0,
                         f"largest growth {worst:+.1f} MB; limit +{args.max_rss_growth_mb:g} "
                         f"MB")
    else:
        checks["rss"] = (True, "not measured: the server's processes were not found")
    checks["deadline"] = (in_time, f"finished within --deadline {args.deadline:.0f} s"
                          if in_time else f"reached --deadline {args.deadline:.0f} s")
    if server:
        checks["exit"] = (code == 0, f"SIGTERM -> exit code {code}")

    print(f"soak: {elapsed:.1f} s, {total} requests at concurrency {args.concurrency} "
          f"({total / max(elapsed, 1e-9):.1f}/s), max_new_tokens <= {args.max_new_tokens}, "
          f"context {context}")
    for kind in args.mix:
        lat = tally.latencies[kind]
        print(f"  {kind:<10} {tally.started[kind]:>6} started {tally.ok[kind]:>6} ok "
              f"{tally.errors[kind]:>4} failed   latency p50 {percentile(lat, .5):6.2f} s "
              f"p99 {percentile(lat, .99):6.2f} s")
    if tally.late_aborts:
        print(f"  aborts that found their request ended (it ran to its length first): "
              f"{tally.late_aborts}")
    for e in warm.first_errors + tally.first_errors:
        print(f"  error: {e}")
    moved = {k: after[k] - before[k] for k in ("generated_tokens_total", "prompt_tokens_total",
                                                 "retracted_total")}
    print(f"  server: generated {moved['generated_tokens_total']} tokens, prompts "
          f"{moved['prompt_tokens_total']} tokens, retracted {moved['retracted_total']}")
    if procs:
        print("  rss MB (baseline, every sixth of the run, end):")
        for k in rss_start:
            steps = " ".join(f"{t.get(k, -1) / MB:.0f}" for t in trail)
            print(f"    {k:<28} {rss_start[k] / MB:.0f} | {steps} | {rss_end[k] / MB:.0f}"
                  f"  ({growth[k]:+.1f})")
    for name, (ok, detail) in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if server:
        print(f"  server log: {server.log_path}")
    passed = all(ok for ok, _ in checks.values())
    print("PASS" if passed else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"elapsed": elapsed, "started": tally.started, "ok": tally.ok,
                       "errors": tally.errors, "first_errors": tally.first_errors,
                       "late_aborts": tally.late_aborts,
                       "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()},
                       "before": before, "after": after}, f, indent=2)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
