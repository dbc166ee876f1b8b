"""Online serving benchmark: a load generator for zserve or any server that speaks SGLang's
POST /generate or OpenAI's /v1/completions and /v1/chat/completions.

    python -m bench.serving --base-url http://127.0.0.1:30000 --backend sglang \\
        --num-prompts 200 --random-input-len 256 --random-output-len 128 \\
        --random-range-ratio 1.0 --request-rate 8 --max-concurrency 32 --output-dir results/

Flags follow SGLang's bench_serving where it has one. Every request streams (that is how
TTFT and the inter-token gaps are seen by a client) and, unless --disable-ignore-eos, asks
the server to ignore EOS so that each produces exactly its output length.

Prompts (--dataset-name):
- random: lengths drawn uniformly in [ratio * len, len] (--random-range-ratio, SGLang's
  default 0.0), for input and output separately. With a local tokenizer (--tokenizer, else
  the `tokenizer_path` the server reports in /server_info or /model_info, when that path
  exists on this machine), the sglang backend sends random non-special token ids as
  `input_ids` (exactly the drawn length), and the OpenAI backends send text made of random
  whole-word tokens of the vocabulary (" the", " name", ...), which encodes back to one
  token per word (checked: cut to the longest prefix that encodes to at most the drawn
  length; the chat template adds its own tokens). Without a tokenizer every backend sends
  random common English words, one per token drawn: about one token each in BPE
  vocabularies. Either way the token counts reported are the server's.
- sharegpt (--dataset-path): a JSON list of {"conversations": [{"from": "human", "value":
  ...}, {"from": "gpt", "value": ...}, ...]}: the first turn is the prompt and the length of
  the second (in tokens of the local tokenizer, else characters / 4) is the output length
  (--sharegpt-output-len overrides it). Entries with fewer than 2 turns, a prompt or reply
  under 2 tokens, or prompt + output over the server's context length less 64 are skipped.
- jsonl (--dataset-path): one {"prompt": "text", "output_len": N} per line (output_len may
  be left out when --sharegpt-output-len is given).
Entries are shuffled with --seed; a file with fewer usable entries than --num-prompts is
cycled (repeated prompts can hit the server's prefix cache).

Arrival: Poisson at --request-rate per second (inf: all at once), and at most
--max-concurrency requests in flight (a request that arrives while the limit is reached
waits in the client; its times start when it is sent). --warmup-requests (default 1) are
sent first and not counted.

Measured per request, on the client: start, TTFT (to the first chunk carrying output), the
inter-token gaps (ITL), the end-to-end latency, and the prompt and output token counts the
server reported (meta_info for /generate; the `usage` chunk of `stream_options:
{"include_usage": true}` for OpenAI). A chunk may hold several tokens: its gap to the
previous chunk is split evenly over its tokens (SGLang's convention), counted exactly on
/generate (meta_info.completion_tokens of each frame) and, on the OpenAI routes, whose
chunks do not say how many tokens they hold, estimated by spreading the usage count evenly
over the chunks that carried text. TPOT = (e2e - TTFT) / (output tokens - 1).

Writes to --output-dir a JSON (config, server info, summary, timeline, every request) and a
PNG (CDFs of TTFT, ITL, TPOT and e2e; output tokens/s and requests in flight over time).
bench/compare.py plots several such JSONs together. Exit status 1 if any request failed
(the results are written all the same).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

BACKENDS = {"sglang": "sglang", "openai": "openai", "openai-chat": "openai-chat",
            # SGLang's and vLLM's names for the same clients
            "sglang-native": "sglang", "sglang-oai": "openai", "sglang-oai-chat": "openai-chat",
            "vllm": "openai", "vllm-chat": "openai-chat"}
ROUTES = {"sglang": "/generate", "openai": "/v1/completions",
          "openai-chat": "/v1/chat/completions"}
PERCENTILES = (50, 90, 99)
CONTEXT_MARGIN = 64         # sharegpt: room left for a chat template and special tokens
RESULT_VERSION = 1

# Fallback prompt text when no tokenizer is at hand: common words, ~one BPE token each.
WORDS = """the of and to in is that it for was on are as with his they at be this from
have or by one had not but what all were when we there can an your which their said if do
will each about how up out them then she many some so these would other into has more her
two like him see time could no make than first been its who now people my made over did
down only way find use may water long little very after words called just where most know
get through back much go good new write our me man too any day same right look think also
around another came come work three word must because does part even place well such here
take why things help put years different away again off went old number great tell men say
small every found still between name should home big give air line set own under read last
never us left end along while might next sound below saw something thought both few those
always looked show large often together asked house world going want school important until
form food keep children feet land side without boy once animals life enough took sometimes
four head above kind began almost live page got earth need far hand high year mother light
parts country father let night following picture being study second eyes soon times story
boys since white days ever paper hard near sentence better best across during today others
however sure means knew try told young miles sun ways thing whole hear example heard several
change answer room sea against top turned learn point city play toward five using himself
usually""".split()


# ---- tokenizer --------------------------------------------------------------------------------

class LocalTokenizer:
    """encode / decode over a local tokenizer: tokenizer.json through `tokenizers` (no torch),
    else transformers' AutoTokenizer. `normal_ids`: ids that are not special or added tokens."""

    def __init__(self, path: str):
        self.path = path
        p = Path(path)
        file = p if p.is_file() and p.suffix == ".json" else p / "tokenizer.json"
        if file.is_file():
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(file))
            self.kind = "tokenizers"
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
            size = tok.get_vocab_size(with_added_tokens=True)
            special = set(tok.get_added_tokens_decoder())
        else:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.kind = "transformers"
            self._encode = lambda text: tok.encode(text, add_special_tokens=False)
            self._decode = lambda ids: tok.decode(ids)
            size = len(tok)
            special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
        self.normal_ids = [i for i in range(size) if i not in special]
        if not self.normal_ids:
            raise ValueError(f"no ordinary tokens in the tokenizer at {path}")

    def word_pieces(self) -> list[str]:
        """Whole-word tokens as text (" the", " name", ...): a string of them encodes back
        to one token each. Byte-level BPE vocabularies hold many; where single tokens decode
        without their leading space (SentencePiece), alphabetic tokens joined by spaces."""
        texts = [self.decode([i]) for i in self.normal_ids]
        spaced = [t for t in texts if t[:1] == " " and t[1:].isalpha()]
        if len(spaced) >= 20:
            return spaced
        alpha = [" " + t for t in texts if t.isalpha()]
        return alpha if len(alpha) >= 20 else [" " + w for w in WORDS]

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)


def load_tokenizer(path: str | None) -> LocalTokenizer | None:
    if not path or not os.path.exists(path):
        return None
    try:
        return LocalTokenizer(path)
    except Exception as e:      # a GGUF file, a SentencePiece model without transformers, ...
        print(f"# cannot load a tokenizer from {path} ({type(e).__name__}: {e}); "
              f"falling back to estimates", file=sys.stderr)
        return None


# ---- prompts ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Prompt:
    """One request to send: text, or token ids (sglang backend only), and the output length.
    prompt_len is the client's count (the tokenizer's, or an estimate); the server's count
    is what the report uses."""

    text: str | None
    ids: list[int] | None
    prompt_len: int
    output_len: int


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    low = max(1, int(length * ratio))
    return [rng.randint(low, max(low, length)) for _ in range(n)]


def random_prompts(n: int, input_len: int, output_len: int, ratio: float,
                   tok: LocalTokenizer | None, want_ids: bool, rng: random.Random) -> list[Prompt]:
    out = []
    pieces = None
    for in_len, out_len in zip(_lengths(rng, n, input_len, ratio),
                               _lengths(rng, n, output_len, ratio)):
        if tok is not None and want_ids:
            out.append(Prompt(None, [rng.choice(tok.normal_ids) for _ in range(in_len)],
                              in_len, out_len))
            continue
        if pieces is None:
            pieces = tok.word_pieces() if tok is not None else [" " + w for w in WORDS]
        words = [rng.choice(pieces) for _ in range(in_len)]
        text = "".join(words)
        if tok is None:
            out.append(Prompt(text, None, in_len, out_len))
            continue
        # The longest prefix that encodes to at most in_len tokens (almost always all of it).
        cut, length = in_len, len(tok.encode(text))
        while length > in_len and cut > 1:
            cut -= max(1, length - in_len)
            text = "".join(words[:cut])
            length = len(tok.encode(text))
        out.append(Prompt(text, None, length, out_len))
    return out


def _count(tok: LocalTokenizer | None, text: str) -> int:
    return len(tok.encode(text)) if tok is not None else max(1, len(text) // 4)


def sharegpt_prompts(path: str, tok: LocalTokenizer | None, output_len: int | None,
                     context_len: int | None) -> list[Prompt]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise SystemExit(f"{path}: a ShareGPT file is a JSON list of {{'conversations': ...}}")
    limit = (context_len or 2048) - CONTEXT_MARGIN
    out = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        p_len = _count(tok, prompt)
        o_len = output_len if output_len is not None else _count(tok, reply)
        if p_len < 2 or o_len < 2 or p_len + o_len > limit:
            continue
        out.append(Prompt(prompt, None, p_len, o_len))
    return out


def jsonl_prompts(path: str, tok: LocalTokenizer | None, output_len: int | None) -> list[Prompt]:
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        text, o_len = row.get("prompt"), row.get("output_len", output_len)
        if output_len is not None:
            o_len = output_len
        if not isinstance(text, str) or not text:
            raise SystemExit(f"{path}:{number}: 'prompt' must be a non-empty string")
        if type(o_len) is not int or o_len < 1:
            raise SystemExit(f"{path}:{number}: 'output_len' must be a positive integer "
                             f"(or pass --sharegpt-output-len)")
        out.append(Prompt(text, None, _count(tok, text), o_len))
    return out


def sample(prompts: list[Prompt], n: int, rng: random.Random, path: str) -> list[Prompt]:
    if not prompts:
        raise SystemExit(f"{path}: no usable entries")
    rng.shuffle(prompts)
    if len(prompts) < n:
        print(f"# {path}: {len(prompts)} usable entries for {n} prompts: cycling them",
              file=sys.stderr)
    return [prompts[i % len(prompts)] for i in range(n)]


# ---- one request ------------------------------------------------------------------------------

@dataclass(slots=True)
class Record:
    """One request as the client saw it. Times in seconds: `start` from the benchmark's
    start, the others from the request's own start. chunk_tokens: tokens per output chunk
    (exact on /generate; spread from the usage count on the OpenAI routes)."""

    index: int
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None          # for a failed request: until it failed
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    requested_output_len: int = 0
    client_prompt_len: int = 0
    tokens_from: str = "server"       # "server" or "chunks" (no usage was sent)
    success: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.success or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def finish(self) -> None:
        """Fill in the token counts of unknown chunks, the ITLs and TTFT."""
        if self.output_tokens is None:
            self.tokens_from = "chunks"
            self.output_tokens = sum(k if k is not None else 1 for k in self.chunk_tokens)
        if any(k is None for k in self.chunk_tokens):
            n, total = len(self.chunk_tokens), self.output_tokens
            self.chunk_tokens = [total // n + (1 if i >= n - total % n else 0)
                                 for i in range(n)]
        if self.chunk_times:
            self.ttft = self.chunk_times[0]
        elif self.success:                  # output with no text at all: it ended at once
            self.ttft = self.e2e
        self.itl = []
        for i in range(1, len(self.chunk_times)):
            gap, k = self.chunk_times[i] - self.chunk_times[i - 1], self.chunk_tokens[i]
            self.itl.extend([gap / k] * k if k > 0 else [gap])

    def to_json(self) -> dict:
        d = asdict(self)
        for key in ("start", "ttft", "e2e"):
            d[key] = None if d[key] is None else round(d[key], 6)
        d["itl"] = [round(x, 6) for x in self.itl]
        d["chunk_times"] = [round(x, 6) for x in self.chunk_times]
        d["tpot"] = None if self.tpot is None else round(self.tpot, 6)
        return d


class Client:
    """Sends one Prompt over the chosen backend and records what came back."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, backend: str, model: str | None,
                 ignore_eos: bool, extra: dict, headers: dict):
        self.http, self.backend, self.model = http, backend, model
        self.url = base_url + ROUTES[backend]
        self.ignore_eos, self.extra, self.headers = ignore_eos, extra, headers

    def body(self, p: Prompt) -> dict:
        if self.backend == "sglang":
            sampling = {"max_new_tokens": p.output_len, "temperature": 0.0}
            if self.ignore_eos:
                sampling["ignore_eos"] = True
            body = {"stream": True, **self.extra,
                    "sampling_params": {**sampling, **self.extra.get("sampling_params", {})}}
            if p.ids is not None:
                body["input_ids"] = p.ids
            else:
                body["text"] = p.text
            return body
        body = {"max_tokens": p.output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.backend == "openai":
            body["prompt"] = p.text
        else:
            body["messages"] = [{"role": "user", "content": p.text}]
        return {**body, **self.extra}

    async def send(self, index: int, p: Prompt, t0: float) -> Record:
        rec = Record(index, requested_output_len=p.output_len, client_prompt_len=p.prompt_len)
        start = time.perf_counter()
        rec.start = start - t0
        try:
            done = await self._stream(p, rec, start)
            if rec.error is None and not done:
                rec.error = "the stream ended without data: [DONE]"
        except Exception as e:      # connection refused or reset, bad JSON, ...
            rec.error = f"{type(e).__name__}: {e}"
        rec.e2e = time.perf_counter() - start
        rec.success = rec.error is None
        rec.finish()
        return rec

    async def _stream(self, p: Prompt, rec: Record, start: float) -> bool:
        async with self.http.stream("POST", self.url, json=self.body(p),
                                    headers=self.headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {r.status_code}: {text[:500]}"
                return False
            seen = 0        # sglang: completion_tokens so far
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return True
                now = time.perf_counter() - start
                obj = json.loads(data)
                if isinstance(obj, dict) and obj.get("error") is not None:
                    err = obj["error"]
                    rec.error = err.get("message", str(err)) if isinstance(err, dict) \
                        else str(err)
                    return False
                if self.backend == "sglang":
                    meta = obj.get("meta_info") or {}
                    rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
                    n = meta.get("completion_tokens")
                    if n is None:           # not SGLang-shaped: count the frame as one
                        n, rec.tokens_from = seen + 1, "chunks"
                    if n > seen:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(n - seen)
                        seen = n
                    rec.output_tokens = seen
                    continue
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                    rec.output_tokens = obj["usage"].get("completion_tokens")
                for choice in obj.get("choices") or []:
                    text = choice.get("text") if self.backend == "openai" else \
                        (choice.get("delta") or {}).get("content")
                    if text:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(None)
            return False


# ---- the run ----------------------------------------------------------------------------------

async def _gather_limited(coros, limit: int | None):
    sem = asyncio.Semaphore(limit) if limit else None

    async def run(c):
        if sem is None:
            return await c
        async with sem:
            return await c
    return await asyncio.gather(*(run(c) for c in coros))


async def run_benchmark(client: Client, prompts: list[Prompt], warm: list[Prompt], args):
    """The warm-up prompts, then every prompt on its arrival schedule. Returns the records,
    the warm-up's summary, the duration (first arrival to last completion) and the CPU time
    this process used in it."""
    t = time.perf_counter()
    warm_recs = await _gather_limited([client.send(-1 - i, p, t) for i, p in enumerate(warm)],
                                      args.max_concurrency)
    warmup = {"requests": len(warm_recs), "failed": sum(not r.success for r in warm_recs),
              "output_tokens": sum(r.output_tokens or 0 for r in warm_recs if r.success),
              "prompt_tokens": sum(r.prompt_tokens or 0 for r in warm_recs if r.success),
              "errors": sorted({r.error for r in warm_recs if r.error})[:5]}
    if warm_recs and warmup["failed"] == len(warm_recs):
        raise SystemExit(f"every warm-up request failed: {warmup['errors'][0]}")

    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), file=sys.stderr, desc="requests")

    async def one(i: int, p: Prompt, t0: float) -> Record:
        if sem is None:
            rec = await client.send(i, p, t0)
        else:
            async with sem:
                rec = await client.send(i, p, t0)
        if bar is not None:
            bar.update(1)
        return rec

    t0, cpu0 = time.perf_counter(), time.process_time()
    tasks, arrival = [], 0.0
    for i, p in enumerate(prompts):
        if i > 0 and math.isfinite(args.request_rate):
            arrival += rng.expovariate(args.request_rate)
            if (wait := t0 + arrival - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(i, p, t0)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    if bar is not None:
        bar.close()
    return list(records), warmup, duration, cpu


# ---- metrics ----------------------------------------------------------------------------------

def stats(values: list[float]) -> dict:
    """mean, median, p90, p99, max in milliseconds (None when there are no values)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p90_ms": None, "p99_ms": None,
                "max_ms": None, "count": 0}
    a = np.asarray(values, dtype=float) * 1000
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)),
            "p90_ms": float(np.percentile(a, 90)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "count": int(a.size)}


def slo_met(r: Record, slo: dict) -> bool:
    ms = lambda x: x * 1000
    return r.success and all((
        slo.get("ttft_ms") is None or ms(r.ttft) <= slo["ttft_ms"],
        slo.get("itl_ms") is None or not r.itl or ms(max(r.itl)) <= slo["itl_ms"],
        slo.get("tpot_ms") is None or r.tpot is None or ms(r.tpot) <= slo["tpot_ms"],
        slo.get("e2e_ms") is None or ms(r.e2e) <= slo["e2e_ms"]))


def summarize(records: list[Record], duration: float, slo: dict, client_cpu_s: float) -> dict:
    ok = [r for r in records if r.success]
    inp = sum(r.prompt_tokens or 0 for r in ok)
    out = sum(r.output_tokens or 0 for r in ok)
    per_s = lambda x: x / duration if duration > 0 else None
    good = sum(slo_met(r, slo) for r in ok) if any(v is not None for v in slo.values()) else None
    return {
        "duration_s": duration, "num_requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "total_input_tokens": inp, "total_output_tokens": out,
        "total_tokens": inp + out,
        "request_throughput": per_s(len(ok)), "input_throughput": per_s(inp),
        "output_throughput": per_s(out), "total_token_throughput": per_s(inp + out),
        # Little's law: time in flight of every request (failed ones too) / duration.
        "concurrency": per_s(sum(r.e2e or 0 for r in records)),
        "goodput": None if good is None else per_s(good), "slo_met": good, "slo": slo,
        "output_len_mismatch": sum(r.output_tokens != r.requested_output_len for r in ok),
        "tokens_from_chunks": sum(r.tokens_from == "chunks" for r in ok),
        # Near 1 (a whole core): the client itself may be what limits the measured rates.
        "client_cpu_fraction": per_s(client_cpu_s),
        "ttft": stats([r.ttft for r in ok]),
        "itl": stats([x for r in ok for x in r.itl]),
        "tpot": stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e": stats([r.e2e for r in ok]),
    }


def timeline_bin(duration: float) -> float:
    """1 s bins, finer for short runs (at most ~40 bins for runs under 40 s)."""
    for b in (0.05, 0.1, 0.2, 0.5):
        if duration / b <= 40:
            return b
    return 1.0


def timeline(records: list[Record], duration: float, bin_s: float) -> dict:
    """Per bin: output tokens/s (each chunk's tokens at its arrival), requests in flight
    (time-averaged over the bin), requests started and finished."""
    n = max(1, math.ceil(duration / bin_s))
    tokens, inflight = np.zeros(n), np.zeros(n)
    started, finished = np.zeros(n, dtype=int), np.zeros(n, dtype=int)
    edge = lambda t: min(n - 1, max(0, int(t / bin_s)))
    for r in records:
        end = r.start + (r.e2e or 0)
        for t, k in zip(r.chunk_times, r.chunk_tokens):
            tokens[edge(r.start + t)] += k or 0
        started[edge(r.start)] += 1
        finished[edge(end)] += 1
        for b in range(edge(r.start), edge(end) + 1):
            lo, hi = b * bin_s, (b + 1) * bin_s
            inflight[b] += max(0.0, min(hi, end) - max(lo, r.start))
    return {"bin_s": bin_s, "t": [round(i * bin_s, 6) for i in range(n)],
            "output_tokens_per_s": (tokens / bin_s).tolist(),
            "requests_in_flight": (inflight / bin_s).tolist(),
            "requests_started": started.tolist(), "requests_finished": finished.tolist()}


# ---- report -----------------------------------------------------------------------------------

def rate_text(config: dict) -> str:
    r = config["request_rate"]
    return "inf" if r == "inf" else f"{r:g}/s"


def _f(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(result: dict) -> None:
    c, s = result["config"], result["summary"]
    rate = rate_text(c)
    print()
    print(f"serving benchmark: {c['backend']} {c['base_url']}{ROUTES[c['backend']]}")
    print(f"  workload: {s['num_requests']} prompts ({c['dataset_desc']}), request rate "
          f"{rate}, max concurrency {c['max_concurrency'] or 'none'}, ignore_eos "
          f"{not c['disable_ignore_eos']}, warm-up {result['warmup']['requests']}")
    print(f"  duration {s['duration_s']:.2f} s   completed {s['completed']}   failed "
          f"{s['failed']}   mean in flight {_f(s['concurrency'], '.2f')}")
    print(f"  tokens (as the server reported them): input {s['total_input_tokens']}, output "
          f"{s['total_output_tokens']}, total {s['total_tokens']}")
    print(f"  throughput: {_f(s['request_throughput'], '.2f')} req/s, input "
          f"{_f(s['input_throughput'])} tok/s, output {_f(s['output_throughput'])} tok/s, "
          f"total {_f(s['total_token_throughput'])} tok/s")
    if s["goodput"] is not None:
        slo = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in s["slo"].items() if v is not None)
        print(f"  goodput: {s['goodput']:.2f} req/s ({s['slo_met']} of {s['completed']} "
              f"requests met {slo})")
    print(f"  {'ms':<6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "E2E")):
        m = s[key]
        print(f"  {name:<6}" + "".join(f"{_f(m[k]):>10}" for k in
                                       ("mean_ms", "median_ms", "p90_ms", "p99_ms", "max_ms")))
    if s["output_len_mismatch"]:
        print(f"  note: {s['output_len_mismatch']} requests did not produce their requested "
              f"output length (EOS or a stop without ignore_eos?)")
    if s["tokens_from_chunks"]:
        print(f"  note: {s['tokens_from_chunks']} responses had no usage: their output "
              f"tokens are a count of chunks")
    for e in s["errors"][:3]:
        print(f"  error: {e}")
    print(f"  measured by one client process (it used {_f(s['client_cpu_fraction'], '.0%')} "
          f"of a core): TTFT/ITL/e2e include its HTTP and event-loop time")


# ---- figure -----------------------------------------------------------------------------------

LATENCY_PANELS = (("ttft", "TTFT"), ("itl", "ITL (inter-token gap)"), ("tpot", "TPOT"),
                  ("e2e", "end-to-end latency"))


def latencies_ms(result: dict, key: str) -> np.ndarray:
    ok = [r for r in result["requests"] if r["success"]]
    if key == "itl":
        values = [x for r in ok for x in r["itl"]]
    else:
        values = [r[key] for r in ok if r[key] is not None]
    return np.sort(np.asarray(values, dtype=float)) * 1000


def plot_results(results: list[dict], labels: list[str], path: str | Path,
                 title: str | None = None) -> None:
    """CDFs of TTFT, ITL, TPOT and e2e, and the timelines of output tokens/s and requests in
    flight: one series per result."""
    from matplotlib.figure import Figure     # no pyplot: no global state, no display

    fig = Figure(figsize=(16, 9))
    # Fixed margins: a constrained layout would draw the figure twice (seconds on a busy CPU).
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.065, top=0.92, wspace=0.2, hspace=0.3)
    axes = fig.subplots(2, 3)
    cells = [axes[0, 0], axes[0, 1], axes[0, 2], axes[1, 0]]
    for ax, (key, name) in zip(cells, LATENCY_PANELS):
        spans = []
        for res, label in zip(results, labels):
            x = latencies_ms(res, key)
            if x.size == 0:
                ax.plot([], [], label=f"{label}: no data")
                continue
            y = np.arange(1, x.size + 1) / x.size
            ax.step(x, y, where="post", label=f"{label}: p50 {np.median(x):.1f}, "
                                               f"p99 {np.percentile(x, 99):.1f} ms")
            spans.append((x[x > 0].min() if (x > 0).any() else 1.0, x.max()))
        if spans and max(hi for _, hi in spans) > 100 * min(lo for lo, _ in spans):
            ax.set_xscale("log")
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    for ax, key, name in ((axes[1, 1], "output_tokens_per_s", "output tokens/s"),
                          (axes[1, 2], "requests_in_flight", "requests in flight")):
        for res, label in zip(results, labels):
            tl = res["timeline"]
            mid = np.asarray(tl["t"]) + tl["bin_s"] / 2
            line, = ax.plot(mid, tl[key], drawstyle="steps-mid",
                            label=f"{label} ({tl['bin_s']:g} s bins)")
            mean = res["summary"]["output_throughput" if key == "output_tokens_per_s"
                                  else "concurrency"]
            if mean is not None:        # the run's mean, dashed
                ax.axhline(mean, color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_title(f"{name} over time (dashed: the run's mean)")
        ax.set_xlabel("seconds since the first request")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title is None and len(results) == 1:
        c, s = results[0]["config"], results[0]["summary"]
        title = (f"{labels[0]}: {c['backend']}, {s['num_requests']} prompts "
                 f"({c['dataset_desc']}), rate {rate_text(c)}, max concurrency "
                 f"{c['max_concurrency'] or 'none'}; {_f(s['request_throughput'], '.2f')} req/s, "
                 f"{_f(s['output_throughput'])} output tok/s, {s['failed']} failed")
    fig.suptitle(title or "serving benchmark: " + " vs ".join(labels))
    fig.savefig(path, dpi=90)


# ---- main -------------------------------------------------------------------------------------

def get_json(http: httpx.Client, url: str, headers: dict) -> dict | None:
    try:
        r = http.get(url, headers=headers)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Online serving benchmark (SGLang bench_serving "
                                            "style).")
    a = p.add_argument
    a("--backend", default="sglang", choices=sorted(BACKENDS),
      help="sglang: POST /generate; openai: /v1/completions; openai-chat: /v1/chat/completions")
    a("--base-url", help="the server's URL (default http://HOST:PORT)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--model", help="the model field of OpenAI requests (default: the first of /v1/models)")
    a("--api-key", help="sent as Authorization: Bearer KEY")
    a("--tokenizer", help="a local tokenizer directory or tokenizer.json (default: the "
                          "server's tokenizer_path, when it exists here)")
    a("--dataset-name", default="random", choices=["random", "sharegpt", "jsonl"])
    a("--dataset-path", help="the sharegpt JSON or the JSONL file")
    a("--num-prompts", type=int, default=100)
    a("--random-input-len", type=int, default=256)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0,
      help="random lengths are drawn in [ratio * len, len]")
    a("--sharegpt-output-len", type=int, help="output length of every file prompt")
    a("--request-rate", type=float, default=float("inf"),
      help="Poisson arrivals per second (inf: all at once)")
    a("--max-concurrency", type=int, help="most requests in flight at once")
    a("--warmup-requests", type=int, default=1, help="sent first, not counted")
    a("--flush-cache", action="store_true",
      help="POST /flush_cache first (empties the server's prefix cache)")
    a("--disable-ignore-eos", action="store_true",
      help="do not send ignore_eos (servers that reject it)")
    a("--extra-request-body", default="{}", metavar="JSON",
      help="merged into each request's body (a sampling_params object into ours)")
    a("--slo-ttft-ms", type=float)
    a("--slo-itl-ms", type=float, help="the largest inter-token gap of a request")
    a("--slo-tpot-ms", type=float)
    a("--slo-e2e-ms", type=float)
    a("--seed", type=int, default=1)
    a("--output-dir", default=".", help="where the JSON and the PNG go")
    a("--output-file", help="the JSON's name (the PNG takes its stem); default "
                            "serving_BACKEND_TIME_N.json")
    a("--timeline-bin", type=float, help="seconds (default: 1, finer for short runs)")
    a("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    args.backend = BACKENDS[args.backend]
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        p.error("--num-prompts and the random lengths must be positive")
    if not 0 <= args.random_range_ratio <= 1:
        p.error("--random-range-ratio must be in [0, 1]")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive (inf: all at once)")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be positive")
    if args.dataset_name != "random" and not args.dataset_path:
        p.error(f"--dataset-name {args.dataset_name} needs --dataset-path")
    try:
        args.extra = json.loads(args.extra_request_body)
        assert isinstance(args.extra, dict)
        assert isinstance(args.extra.get("sampling_params", {}), dict)
    except (ValueError, AssertionError):
        p.error("--extra-request-body must be a JSON object")
    return args


def make_prompts(args, tok: LocalTokenizer | None, context_len: int | None) -> tuple[list[Prompt],
                                                                                    str]:
    """The measured prompts, then the warm-up's (random: prompts of their own, so that the
    warm-up leaves nothing in the prefix cache for the measured ones; a file: its first)."""
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        prompts = random_prompts(args.num_prompts + args.warmup_requests, args.random_input_len,
                                 args.random_output_len, args.random_range_ratio, tok,
                                 args.backend == "sglang", rng)
        low = lambda n: max(1, int(n * args.random_range_ratio))
        desc = (f"random {low(args.random_input_len)}-{args.random_input_len} in, "
                f"{low(args.random_output_len)}-{args.random_output_len} out, "
                f"{'token ids' if tok and args.backend == 'sglang' else 'text'}")
        return prompts, desc
    if args.dataset_name == "sharegpt":
        pool = sharegpt_prompts(args.dataset_path, tok, args.sharegpt_output_len, context_len)
    else:
        pool = jsonl_prompts(args.dataset_path, tok, args.sharegpt_output_len)
    prompts = sample(pool, args.num_prompts, rng, args.dataset_path)
    return (prompts + [prompts[i % len(prompts)] for i in range(args.warmup_requests)],
            f"{args.dataset_name} {Path(args.dataset_path).name}")


def main(argv=None) -> int:
    args = parse_args(argv)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    with httpx.Client(timeout=30.0) as http:
        server_info = get_json(http, base_url + "/server_info", headers) or \
            get_json(http, base_url + "/get_server_info", headers)
        model_info = get_json(http, base_url + "/model_info", headers) or \
            get_json(http, base_url + "/get_model_info", headers) or {}
        model = args.model
        if model is None and args.backend != "sglang":
            models = get_json(http, base_url + "/v1/models", headers) or {}
            model = next((m.get("id") for m in models.get("data") or []), None)
    info = server_info or {}
    tok_path = args.tokenizer or info.get("tokenizer_path") or model_info.get("tokenizer_path")
    tok = load_tokenizer(tok_path)
    if args.tokenizer and tok is None:
        raise SystemExit(f"--tokenizer {args.tokenizer}: cannot load it")
    context_len = info.get("context_length") or info.get("context_len")
    prompts, desc = make_prompts(args, tok, context_len)
    prompts, warm = prompts[:args.num_prompts], prompts[args.num_prompts:]
    if args.flush_cache:
        with httpx.Client(timeout=30.0) as http:
            r = http.post(base_url + "/flush_cache", json={}, headers=headers)
        if r.status_code != 200:
            raise SystemExit(f"--flush-cache: /flush_cache answered {r.status_code}: "
                             f"{r.text[:300]}")

    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "extra")}
    if not math.isfinite(args.request_rate):
        config["request_rate"] = "inf"          # JSON has no infinity
    config.update(base_url=base_url, model=model, dataset_desc=desc,
                  tokenizer={"path": tok_path if tok else None,
                             "kind": tok.kind if tok else "none (word estimates)"},
                  client={"python": platform.python_version(), "platform": platform.platform(),
                          "cpus": os.cpu_count(), "httpx": httpx.__version__})
    print(f"# {args.backend} at {base_url}: {len(prompts)} prompts ({desc}); tokenizer "
          f"{config['tokenizer']['kind']} {tok_path if tok else ''}", file=sys.stderr)

    async def go():
        limit = args.max_concurrency or len(prompts)
        limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                                     limits=limits) as http:
            client = Client(http, base_url, args.backend, model, not args.disable_ignore_eos,
                            args.extra, headers)
            return await run_benchmark(client, prompts, warm, args)

    started_at = datetime.datetime.now()
    records, warmup, duration, cpu = asyncio.run(go())
    slo = {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms,
           "tpot_ms": args.slo_tpot_ms, "e2e_ms": args.slo_e2e_ms}
    with httpx.Client(timeout=30.0) as http:
        after = get_json(http, base_url + "/server_info", headers)
    result = {
        "version": RESULT_VERSION, "started_at": started_at.isoformat(timespec="seconds"),
        "config": config, "server_info": server_info, "server_info_after": after,
        "warmup": warmup, "summary": summarize(records, duration, slo, cpu),
        "timeline": timeline(records, duration, args.timeline_bin or timeline_bin(duration)),
        "requests": [r.to_json() for r in records],
    }
    print_report(result)

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.output_file or (f"serving_{args.backend}_{started_at:%Y%m%d-%H%M%S}_"
                                f"{args.num_prompts}.json")
    json_path = out_dir / name
    png_path = json_path.with_suffix(".png")
    json_path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    plot_results([result], [json_path.stem], png_path)
    print(f"# wrote {json_path} and {png_path}", file=sys.stderr)
    return 1 if result["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
