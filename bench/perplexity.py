"""Perplexity through zserve's /generate, per server configuration, on one model file.

    python -m bench.perplexity [--model-path DIR|FILE.gguf] [--dtype float32|bfloat16]
        [--configs LABEL=FLAGS ...] [--server-args "..."] [--ctx 512]
        [--score-from all|half|N] [--max-windows N] [--concurrency 4]
        [--text bench/ppl_text.txt] [--transformers] [--llama-perplexity BIN]
        [--json PATH]

What it measures: how well the served model predicts a fixed English text (bench/ppl_text.txt,
~3,300 words of original prose shipped with the repo), so that server configurations that
should compute the same model (a GGUF's quantized weights served natively or dequantized at
load, another dtype, another attention path) can be compared on the same token ids.

--configs LABEL=FLAGS ...: one zserve server per entry, one after another, each launched on
a free port with --model-path, --dtype and those launch.py flags (after --server-args, so a
config's own --dtype wins). Default: "native=--quantization gguf" "dequantized=--quantization
none". An entry whose server does not start is reported as failed (exit status 1) and the
others still run.

Per server: the text is tokenized by the server's own POST /tokenize (add_special_tokens true,
as llama.cpp's llama-perplexity tokenizes with the model's add_bos; a text longer than the
server's context, which /tokenize refuses, by the server's tokenizer files, /server_info's
tokenizer_path, loaded here with the class its tokenizer workers use), and the ids are split
into non-overlapping windows of --ctx tokens (a partial last window is dropped, as llama.cpp
does). If the tokenizer adds a BOS token, every window's first token is replaced by it (again
as llama.cpp does). Each window is one POST /generate {"input_ids": window, "sampling_params":
{"max_new_tokens": 0}, "return_logprob": true, "logprob_start_len": 0} (prefill only; --ctx
must be under the server's context length), --concurrency at a time; meta_info's
input_token_logprobs gives log p(token | the window's tokens before it) for every position
but the first. Scored positions (--score-from):
  all  (default): every token after the first of each window: ctx - 1 tokens a window;
  half: llama-perplexity's choice, positions ctx//2 + 1 .. ctx - 1 of each window, so every
        scored token has at least half a window of context: ctx - 1 - ctx//2 tokens a window;
  N:    positions N .. ctx - 1 (1 <= N < ctx).
Perplexity = exp(mean negative log-likelihood over the scored tokens); "+/-" is
PPL * stderr(NLL), the spread over this text (llama.cpp's convention), not the noise of a
difference between configs, which are scored on the same tokens: the per-token |delta logprob|
columns compare each row with the first, position by position.

--transformers: a reference row computed in this process with transformers in float32 on the
same model (a GGUF with gguf_file=), the same windows and the same scoring (the token ids the
first working server produced). --llama-perplexity BIN: runs llama.cpp's
`BIN -m FILE.gguf -f TEXT -c CTX -t 2 [--chunks N]` (-t: --llama-threads) on the same file and
text and reports its "Final estimate"; llama.cpp tokenizes on its own and scores only the second half of each
window, so compare it with --score-from half.

The table gives each row's tokens scored, mean NLL, perplexity, its difference from the first
row (a percentage of the first row's perplexity) and the time its scoring took (server
startup and model loading excluded); --json also writes the
configuration, each server's /server_info and the per-window NLLs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import httpx

from bench.table import text_table
from bench.throughput import gguf_file, hf_load, launch_server, parse_config, same_model

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_TEXT = REPO / "bench" / "ppl_text.txt"
DEFAULT_CONFIGS = ["native=--quantization gguf", "dequantized=--quantization none"]
LLAMA_FINAL = re.compile(r"Final estimate:\s*PPL\s*=\s*([0-9.eE+-]+)\s*\+/-\s*([0-9.eE+-]+)")
LLAMA_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


# ---------------------------------------------------------------------------------------
# Windows and scoring (pure)


def first_scored(ctx: int, score_from: str) -> int:
    """The first window position whose token is scored: "all" 1, "half" ctx//2 + 1
    (llama-perplexity's), or an integer N in [1, ctx)."""
    if score_from == "all":
        return 1
    if score_from == "half":
        return ctx // 2 + 1
    try:
        n = int(score_from)
    except ValueError:
        raise ValueError(f"--score-from: all, half or an integer, got {score_from!r}") from None
    if not 1 <= n < ctx:
        raise ValueError(f"--score-from {n}: must be in [1, ctx={ctx})")
    return n


def split_windows(ids: list[int], ctx: int, max_windows: int | None = None,
                  bos: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of exactly ctx ids (the partial tail is dropped), at most
    max_windows of them; with bos, each window's first id is replaced by it."""
    n = len(ids) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    windows = [list(ids[i * ctx:(i + 1) * ctx]) for i in range(n)]
    if bos is not None:
        for w in windows:
            w[0] = bos
    return windows


def scored_count(num_ids: int, ctx: int, score_from: str, max_windows: int | None = None) -> int:
    """How many tokens split_windows + first_scored score."""
    return len(split_windows(list(range(num_ids)), ctx, max_windows)) * \
        (ctx - first_scored(ctx, score_from))


def window_nlls(logprobs: list[float | None], start: int) -> list[float]:
    """Negative logprobs of positions start.. of one window (position 0 has none)."""
    if start < 1 or any(lp is None for lp in logprobs[start:]):
        raise ValueError("a scored position has no logprob")
    return [-lp for lp in logprobs[start:]]


def summarize(nlls: list[float]) -> dict:
    """Mean NLL, perplexity and llama.cpp's uncertainty (PPL * stderr of the mean NLL)."""
    n = len(nlls)
    mean = sum(nlls) / n
    var = sum((x - mean) ** 2 for x in nlls) / (n - 1) if n > 1 else 0.0
    ppl = math.exp(mean)
    return {"tokens_scored": n, "mean_nll": mean, "ppl": ppl,
            "ppl_err": ppl * math.sqrt(var / n)}


def logprob_deltas(a: list[float], b: list[float]) -> dict:
    """Per-token |NLL difference| between two rows scored on the same tokens."""
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"mean_abs_dlogprob": sum(d) / len(d), "max_abs_dlogprob": max(d)}


# ---------------------------------------------------------------------------------------
# zserve


def tokenize(url: str, text: str, tokenizer_path: str | None) -> tuple[list[int], int | None, str]:
    """The server's ids for text (its special tokens added), the BOS it adds (None if it adds
    none) and how they were obtained: POST /tokenize, or, for a text longer than the
    server's context (which /tokenize refuses), the server's tokenizer files (its
    /server_info tokenizer_path) through the class its tokenizer workers use."""
    with httpx.Client(base_url=url, timeout=120) as c:
        def post(prompt):
            return c.post("/tokenize", json={"prompt": prompt, "add_special_tokens": True})
        r, empty = post(text), post("")
    if empty.status_code != 200 or r.status_code not in (200, 400):
        bad = empty if empty.status_code != 200 else r
        raise RuntimeError(f"/tokenize returned {bad.status_code}: {bad.text[:300]}")
    special = empty.json()["tokens"]
    if r.status_code == 200:
        ids, how = r.json()["tokens"], "/tokenize"
    elif "longer than the model's context length" in r.text and tokenizer_path:
        from tokenization.hf_tokenizer import HFTokenizer
        tok = HFTokenizer.from_dir(tokenizer_path)
        if tok.encode("", add_special_tokens=True) != special:
            raise RuntimeError(f"the tokenizer at {tokenizer_path} is not the server's")
        ids, how = tok.encode(text, add_special_tokens=True), f"{tokenizer_path} (local)"
    else:
        raise RuntimeError(f"/tokenize returned {r.status_code}: {r.text[:300]}")
    bos = special[0] if len(special) == 1 and ids[:1] == special else None
    return ids, bos, how


async def _score_windows(url: str, windows: list[list[int]], start: int,
                         concurrency: int) -> list[list[float]]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30)) as c:
        async def one(w: list[int]) -> list[float]:
            body = {"input_ids": w, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                    "return_logprob": True, "logprob_start_len": 0}
            async with sem:
                r = await c.post("/generate", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"/generate returned {r.status_code}: {r.text[:300]}")
            triples = r.json()["meta_info"]["input_token_logprobs"]
            if [t[1] for t in triples] != w:
                raise RuntimeError(f"input_token_logprobs does not cover the window: "
                                   f"{len(triples)} entries for {len(w)} ids")
            return window_nlls([t[0] for t in triples], start)
        return await asyncio.gather(*(one(w) for w in windows))


def run_config(args, model_path: str, text: str, label: str, flags: str) -> tuple[dict, dict]:
    """One server: launch, tokenize, score every window, stop. Returns the row and the
    token ids it scored ({"windows", "bos", "num_ids"}) for the rows that follow."""
    row = {"label": label, "kind": "zserve", "flags": flags}
    server = None
    try:
        extra = shlex.split(args.server_args) + shlex.split(flags)
        server, row["startup_s"] = launch_server(model_path, args.dtype, extra)
        url = server.url
        info = httpx.get(url + "/server_info", timeout=10).json()
        row["server_info"] = info
        if info.get("model_path") and not same_model(info["model_path"], model_path):
            print(f"# warning: the server serves {info['model_path']}, not {model_path}",
                  file=sys.stderr)
        ids, bos, row["tokenized_by"] = tokenize(url, text, info.get("tokenizer_path"))
        context = info["context_length"]
        if args.ctx >= context:
            raise RuntimeError(f"--ctx {args.ctx} does not fit the server's context length "
                               f"{context} (a window must be shorter than it)")
        windows = split_windows(ids, args.ctx, args.max_windows, bos)
        if not windows:
            raise RuntimeError(f"the text is {len(ids)} tokens, under one window of {args.ctx}")
        start = first_scored(args.ctx, args.score_from)
        print(f"# [{label}] scoring {len(windows)} windows of {args.ctx} tokens ...",
              file=sys.stderr)
        t0 = time.perf_counter()
        per_window = asyncio.run(_score_windows(url, windows, start, args.concurrency))
        row["wall_s"] = time.perf_counter() - t0
        row["nlls"] = [x for w in per_window for x in w]
        row["window_mean_nll"] = [sum(w) / len(w) for w in per_window]
        row.update(summarize(row["nlls"]))
        return row, {"windows": windows, "bos": bos, "num_ids": len(ids),
                     "tokenized_by": row["tokenized_by"],
                     "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        log = server.logs() if server is not None else str(e)
        print(f"# [{label}] failed: {_brief(row['error'])}\n# log tail:\n{log[-3000:]}",
              file=sys.stderr)
        return row, {}
    finally:
        if server is not None:
            rc = server.terminate()
            print(f"# [{label}] server stopped (exit {rc})", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# References


def run_transformers(model_path: str, windows: list[list[int]], start: int) -> dict:
    """The same windows and scoring in this process: transformers, float32."""
    import torch

    row = {"label": "transformers", "kind": "transformers", "flags": "float32, in process"}
    print("# transformers: loading ...", file=sys.stderr)
    t0 = time.perf_counter()
    model = hf_load(model_path, "float32")
    row["startup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    per_window = []
    with torch.inference_mode():
        for w in windows:
            x = torch.tensor([w], dtype=torch.long)
            logits = model(input_ids=x).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, x[0, 1:, None])[:, 0]
            per_window.append(window_nlls([None, *lp.tolist()], start))
    row["wall_s"] = time.perf_counter() - t0
    row["nlls"] = [x for w in per_window for x in w]
    row["window_mean_nll"] = [sum(w) / len(w) for w in per_window]
    row.update(summarize(row["nlls"]))
    del model
    return row


def parse_llama_perplexity(output: str) -> tuple[float, float, int | None]:
    """(PPL, +/-, chunks) from llama-perplexity's output."""
    final = LLAMA_FINAL.findall(output)
    if not final:
        raise ValueError("no 'Final estimate: PPL = X +/- Y' line in llama-perplexity's output")
    chunks = LLAMA_CHUNKS.search(output)
    return float(final[-1][0]), float(final[-1][1]), int(chunks[1]) if chunks else None


def run_llama(binary: str, model_path: str, text_path: str, ctx: int, threads: int,
              max_windows: int | None) -> dict:
    row = {"label": "llama.cpp", "kind": "llama.cpp", "flags": "scores the 2nd half"}
    gguf = gguf_file(model_path)
    if gguf is None:
        row["error"] = "llama-perplexity needs a GGUF file, the model is an HF directory"
        return row
    cmd = [binary, "-m", str(gguf), "-f", text_path, "-c", str(ctx), "-t", str(threads)]
    if max_windows is not None:
        cmd += ["--chunks", str(max_windows)]
    row["command"] = shlex.join(cmd)
    print(f"# llama.cpp: {row['command']}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        row["wall_s"] = time.perf_counter() - t0
        out = p.stdout + p.stderr
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {out[-1500:]}")
        ppl, err, chunks = parse_llama_perplexity(out)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        print(f"# llama.cpp failed: {row['error']}", file=sys.stderr)
        return row
    row.update(ppl=ppl, ppl_err=err, mean_nll=math.log(ppl), chunks=chunks,
               tokens_scored=chunks * (ctx - 1 - ctx // 2) if chunks is not None else None)
    return row


# ---------------------------------------------------------------------------------------
# Report


def compare_rows(rows: list[dict]) -> None:
    """Each row's difference from the first working row: relative perplexity, and per token
    when both scored the same token ids."""
    ok = [r for r in rows if "ppl" in r]
    if not ok:
        return
    base = ok[0]
    base["base"] = True
    for r in ok:
        r["rel_diff"] = r["ppl"] / base["ppl"] - 1
        if r is not base and "nlls" in r and len(r["nlls"]) == len(base["nlls"]) and \
                r.get("ids_sha256", base.get("ids_sha256")) == base.get("ids_sha256"):
            r.update(logprob_deltas(r["nlls"], base["nlls"]))


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _num(x) -> str:
    """A perplexity: fixed point, or exponent notation for a random-weight model's."""
    return "-" if x is None else format(x, ".4f" if abs(x) < 1e6 else ".4e")


def _brief(error: str) -> str:
    """An error's first line, and its last when there are more (a server's exit message)."""
    lines = [x for x in error.splitlines() if x.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"


def print_table(report: dict) -> None:
    c = report["config"]
    print()
    print(f"model {c['model_path']}  dtype {c['dtype']}  text {c['text']} "
          f"({report['text_words']} words, {report.get('num_ids', '?')} tokens)")
    if report.get("tokenized_by"):
        print(f"tokenized by {report['tokenized_by']}")
    print(f"windows: {report.get('num_windows', '?')} x {c['ctx']} tokens, non-overlapping; "
          f"scored: window positions {report['first_scored']}..{c['ctx'] - 1} "
          f"(--score-from {c['score_from']})"
          + (f"; BOS {report['bos']} replaces each window's first token"
             if report.get("bos") is not None else ""))
    head = ["config", "tokens", "mean NLL", "PPL", "+/-", "vs first", "mean|dlp|", "max|dlp|",
            "wall s", "flags"]
    table = []
    for r in report["rows"]:
        if "error" in r:
            table.append([r["label"], "-", "-", "failed", "-", "-", "-", "-", "-",
                          r.get("flags") or "-"])
            continue
        vs = "base" if r.get("base") else _f(100 * r["rel_diff"], "+.2f") + "%"
        table.append([r["label"], _f(r.get("tokens_scored"), "d"), _f(r["mean_nll"], ".5f"),
                      _num(r["ppl"]), _num(r.get("ppl_err")), vs,
                      _f(r.get("mean_abs_dlogprob"), ".2e"), _f(r.get("max_abs_dlogprob"), ".2e"),
                      _f(r.get("wall_s"), ".1f"), r.get("flags") or "-"])
    print()
    print(text_table(head, table, left={0, len(head) - 1}))
    print()
    print("PPL = exp(mean NLL); +/- = PPL * stderr(NLL) over this text. vs first: PPL relative "
          "to the first row. |dlp|: per-token |logprob difference| from the first row (same "
          "token ids only).")
    for r in report["rows"]:
        if r["kind"] == "llama.cpp":
            print("llama.cpp tokenizes the text itself and scores only the second half of each "
                  "window: compare it with --score-from half"
                  + ("" if c["score_from"] == "half" else
                     f" (this run used --score-from {c['score_from']})") + ".")
        if "error" in r:
            print(f"{r['label']} failed: {_brief(r['error'])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Perplexity through zserve's /generate, per "
                                "server configuration.")
    p.add_argument("--model-path", help="an HF checkpoint directory or a GGUF file "
                   "(default: the model launch.py serves without one)")
    p.add_argument("--dtype", default="float32", help="launch.py --dtype (default float32)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="LABEL=FLAGS",
                   help="one server per entry, one after another, with these launch.py flags "
                   f"(default: {' '.join(map(repr, DEFAULT_CONFIGS))})")
    p.add_argument("--server-args", default="", help="launch.py flags for every config")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="the text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--score-from", default="all", metavar="all|half|N",
                   help="all: every token after a window's first (default); half: positions "
                   "ctx//2+1 on, as llama-perplexity; N: positions N on")
    p.add_argument("--max-windows", type=int, help="score only the first N windows")
    p.add_argument("--concurrency", type=int, default=4, help="windows in flight at once")
    p.add_argument("--transformers", action="store_true",
                   help="add a reference row: transformers float32 in this process")
    p.add_argument("--llama-perplexity", metavar="BIN", help="llama.cpp's llama-perplexity "
                   "binary: add its estimate on the same GGUF file and text")
    p.add_argument("--llama-threads", type=int, default=2, help="llama-perplexity -t")
    p.add_argument("--json", help="also write everything here as JSON")
    args = p.parse_args(argv)
    if args.ctx < 2 or args.concurrency < 1 or (args.max_windows is not None and
                                                 args.max_windows < 1):
        p.error("--ctx must be at least 2, --concurrency and --max-windows at least 1")
    try:
        start = first_scored(args.ctx, args.score_from)
    except ValueError as e:
        p.error(str(e))
    configs = [parse_config(c) for c in args.configs]

    if args.model_path is None:
        from launch import default_model
        args.model_path = default_model()
    model_path = str(pathlib.Path(args.model_path).expanduser().absolute())
    text_path = str(pathlib.Path(args.text).expanduser().absolute())
    text = pathlib.Path(text_path).read_text()
    report = {"config": {**{k: v for k, v in vars(args).items() if k != "json"},
                         "model_path": model_path, "text": text_path},
              "text_words": len(text.split()), "first_scored": start,
              "load1_at_start": os.getloadavg()[0], "rows": []}

    tokens = {}                 # the first working server's windows, for the transformers row
    for label, flags in configs:
        row, toks = run_config(args, model_path, text, label, flags)
        report["rows"].append(row)
        if toks:
            row["ids_sha256"] = toks["ids_sha256"]
            if tokens and toks["ids_sha256"] != tokens["ids_sha256"]:
                print(f"# warning: [{label}] tokenized the text differently from the first "
                      f"server", file=sys.stderr)
            tokens = tokens or toks
            print(f"# [{label}] PPL {_num(row['ppl'])} over {row['tokens_scored']} tokens",
                  file=sys.stderr)
    if tokens:
        report.update(num_ids=tokens["num_ids"], num_windows=len(tokens["windows"]),
                      bos=tokens["bos"], tokenized_by=tokens["tokenized_by"])
    if args.transformers:
        if tokens:
            row = run_transformers(model_path, tokens["windows"], start)
            row["ids_sha256"] = tokens["ids_sha256"]
        else:
            row = {"label": "transformers", "kind": "transformers", "flags": "float32",
                   "error": "no server tokenized the text (every config failed)"}
        report["rows"].append(row)
    if args.llama_perplexity:
        row = run_llama(args.llama_perplexity, model_path, text_path, args.ctx,
                        args.llama_threads, args.max_windows)
        if row.get("chunks") not in (None, report.get("num_windows", row["chunks"])):
            print(f"# warning: llama.cpp scored {row['chunks']} windows, zserve "
                  f"{report['num_windows']}: the two tokenized the text differently",
                  file=sys.stderr)
        report["rows"].append(row)

    compare_rows(report["rows"])
    print_table(report)
    if args.json:
        out = {**report, "rows": [{k: v for k, v in r.items() if k != "nlls"}
                                  for r in report["rows"]]}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"# wrote {args.json}", file=sys.stderr)
    return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
