"""Speculative decoding at batch 1 (issue 25): n-gram drafts against no speculation, on the
workloads where users' answers repeat their prompts, and on one where they do not.

    python -m bench.speculative                       # the default model, 3 rounds
    python -m bench.speculative --rounds 5 --max-tokens 256
    python -m bench.speculative --llama-server ~/.cache/llama-cpp/build/bin/llama-server

Two zserve servers run side by side on the same model (the default Q4_1 file unless
--model-path): one plain, one with `--speculative-algorithm NGRAM` (default flags). An idle
server takes no CPU, and requests alternate between them (plain, ngram, plain, ...), one at a
time, so drift on a shared machine hits both; both are flushed (/flush_cache: the prefix
cache and the n-gram store) before each request, so that no request drafts an earlier
round's answer to the same prompt. Each workload is one chat prompt (SmolLM2's
template written out, so llama-server gets the same text), greedy, up to --max-tokens.
Per request: tokens/s = completion tokens / wall time at the client (prefill included);
the table shows medians over the rounds, the speed-up, and the n-gram server's acceptance
(meta_info: tokens a verify step made on average, drafts kept / drafted). The two servers'
outputs must be the same ids (greedy: speculation does not change them); a difference is
reported.

With --draft-model-path DIR the second server speculates with that draft model
(`--speculative-algorithm STANDALONE`) instead of n-grams, and the table adds what the
measured acceptance would give if drafting cost nothing ("ideal": tokens a verify step
made / the cost of a step of that many rows, models/quant_linear.py's cpu_step_cost). For the
issue's setting, a SmolLM2-135M-shaped target with random weights and a 4-layer draft
of the same seed (its embeddings, first 4 layers and head are the target's):

    python -m bench.make_checkpoint --out /tmp/smollm-135m
    python -m bench.make_checkpoint --out /tmp/smollm-4l --layers 4
    python -m bench.speculative --model-path /tmp/smollm-135m --draft-model-path /tmp/smollm-4l

With --llama-server, llama.cpp's server on the same GGUF runs each workload the same way,
plain and with each n-gram speculation type given in --llama-spec-types (its
`--spec-type`), one llama-server at a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import httpx

from tests.server import Server

PARAGRAPH = (
    "The river town of Ashford grew up around a stone bridge built in 1732. For two "
    "centuries the bridge carried wool carts to the market square, where traders from "
    "the northern valleys sold fleece, cheese and timber. When the railway arrived in "
    "1868 the market moved to the station yard, and the old square became a garden "
    "with a fountain and a bandstand. Today the bridge is closed to cars, the station "
    "is a museum, and the garden hosts a summer festival that draws visitors from "
    "across the county.")
CODE = '''def merge_orders(orders, returns):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0) + order["amount"]
    for item in returns:
        totals[item["customer"]] = totals.get(item["customer"], 0) - item["amount"]
    return {customer: amount for customer, amount in totals.items() if amount > 0}'''
RECORDS = (
    "Order 1041 was placed by Maria Lopez on 3 March for 2 desk lamps at 24.50 each. "
    "Order 1042 was placed by John Smith on 4 March for 1 office chair at 189.00. "
    "Order 1043 was placed by Maria Lopez on 6 March for 5 notebooks at 3.20 each.")
WORKLOADS = {
    "edit": "Rewrite this paragraph exactly, but in the present tense:\n\n" + PARAGRAPH,
    "quote": PARAGRAPH + "\n\nQuote, word for word, the two sentences about the bridge.",
    "code": "Add type hints and a docstring to this Python function, keeping its code:\n\n"
            + CODE,
    "json": "Extract every order as a JSON list of objects with keys order, customer, "
            "date, item, quantity and price:\n\n" + RECORDS,
    "free": "Write a short story about a lighthouse keeper who finds a message in a "
            "bottle.",           # not repetitive: the answer repeats nothing given
}


def chat_prompt(content: str) -> str:
    """SmolLM2-Instruct's chat template, written out (its default system prompt)."""
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n<|im_start|>user\n" + content +
            "<|im_end|>\n<|im_start|>assistant\n")


def zserve_run(server: Server, prompt: str, max_tokens: int) -> dict:
    # Unseen by the server: no prefix-cache hit, and the n-gram store holds no earlier
    # round's answer to draft (that would measure a repeat, not the workload).
    assert server.client.post("/flush_cache").status_code == 200
    t0 = time.monotonic()
    out = server.generate_ok(text=prompt, sampling_params={"temperature": 0,
                                                           "max_new_tokens": max_tokens})
    wall = time.monotonic() - t0
    meta = out["meta_info"]
    span = meta["e2e_latency"] - meta["first_token_latency"]
    return {"ids": out["output_ids"], "tokens": meta["completion_tokens"], "wall": wall,
            "decode": (meta["completion_tokens"] - 1) / span if span > 0 else None,
            "accept_length": meta.get("spec_accept_length"),
            "drafts_per_step": meta["spec_draft_token_num"] / meta["spec_verify_ct"]
            if meta.get("spec_verify_ct") else None,
            "accept_rate": meta.get("spec_accept_rate")}


def llama_run(url: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.monotonic()
    r = httpx.post(url + "/completion", timeout=600,
                   json={"prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                         "top_k": 1, "repeat_penalty": 1.0, "cache_prompt": False})
    wall = time.monotonic() - t0
    r.raise_for_status()
    body = r.json()
    timings = body.get("timings") or {}
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    return {"ids": None, "tokens": body["tokens_predicted"], "wall": wall,
            "decode": timings.get("predicted_per_second"),
            "accept_length": None,
            "accept_rate": accepted / drafted if drafted else None}


def ideal(runs: list[dict]) -> float | None:
    """The decode speed-up the measured acceptance gives when drafting costs nothing: tokens
    a verify step made over the cost of a verify step's rows (1 + drafts), in one-row
    steps (models/quant_linear.py's cpu_step_cost)."""
    from models.quant_linear import cpu_step_cost
    length, drafts = median([x["accept_length"] for x in runs]), \
        median([x["drafts_per_step"] for x in runs])
    if length is None or drafts is None:
        return None
    return length / cpu_step_cost(1 + round(drafts))


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the built-in model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--spec-flags", default="",
                    help="more launch.py flags for the speculating server (one string)")
    ap.add_argument("--draft-model-path", default=None,
                    help="speculate with this draft model (STANDALONE) instead of n-grams")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--llama-spec-types", default="ngram-simple,ngram-map-k,ngram-mod",
                    help="llama-server --spec-type values to run")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    names = args.workloads.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    tmp = tempfile.mkdtemp()
    plain = Server(args.model_path, tmpdir=tmp, one_thread=False)
    how = ["--speculative-algorithm", "NGRAM"] if args.draft_model_path is None else \
        ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
         args.draft_model_path]
    spec = Server(args.model_path, *how, *args.spec_flags.split(), tmpdir=tmp,
                  one_thread=False)
    try:
        model_file = plain.server_info()["model_path"]
        for name in names:                       # warm-up: each server, each workload once
            for s in (plain, spec):
                zserve_run(s, chat_prompt(WORKLOADS[name][:40]), 8)
        for r in range(args.rounds):
            for name in names:
                prompt = chat_prompt(WORKLOADS[name])
                a = zserve_run(plain, prompt, args.max_tokens)
                b = zserve_run(spec, prompt, args.max_tokens)
                if a["ids"] != b["ids"]:
                    print(f"# {name}: the outputs differ (plain {len(a['ids'])} ids, ngram "
                          f"{len(b['ids'])})", file=sys.stderr)
                results.setdefault((name, "zserve"), []).append(a)
                results.setdefault((name, "zserve ngram"), []).append(b)
                print(f"# round {r + 1} {name}: {a['tokens'] / a['wall']:.1f} -> "
                      f"{b['tokens'] / b['wall']:.1f} tok/s", file=sys.stderr)
    finally:
        plain.terminate()
        spec.terminate()
    systems = ["zserve", "zserve ngram"]     # (the second: the draft model's, if given)
    if args.llama_server:
        from bench.throughput import LlamaServer, gguf_file
        gguf = gguf_file(model_file) if args.model_path is None else gguf_file(args.model_path)
        for kind in ["none", *args.llama_spec_types.split(",")]:
            extra = () if kind == "none" else ("--spec-type", kind)
            system = "llama.cpp" if kind == "none" else f"llama.cpp {kind}"
            systems.append(system)
            llama = LlamaServer(args.llama_server, str(gguf), slots=1, ctx=4096,
                                threads=args.threads, extra=extra)
            try:
                llama_run(llama.url, chat_prompt("Hello"), 8)
                for _ in range(args.rounds):
                    for name in names:
                        results.setdefault((name, system), []).append(
                            llama_run(llama.url, chat_prompt(WORKLOADS[name]),
                                      args.max_tokens))
            finally:
                llama.stop()
    print(f"batch 1, greedy, up to {args.max_tokens} tokens, medians of {args.rounds} "
          f"rounds; tok/s = completion tokens / wall time at the client (prefill "
          f"included); decode = (n - 1) / (e2e - first token)")
    print("| workload | tokens | " + " | ".join(systems) +
          " | ngram / zserve | decode: zserve | ngram | ratio | accept length | "
          "accept rate | ideal |")
    print("|---" * (len(systems) + 9) + "|")
    for name in names:
        rates = {s: median([x["tokens"] / x["wall"] for x in results.get((name, s), [])])
                 for s in systems}
        ng = results[(name, "zserve ngram")]
        speedup = rates["zserve ngram"] / rates["zserve"]
        dec = [median([x["decode"] for x in results[(name, s)]])
               for s in ("zserve", "zserve ngram")]
        print(f"| {name} | {ng[0]['tokens']} | " +
              " | ".join(fmt(rates[s], ".1f") for s in systems) +
              f" | **{speedup:.2f}** | {fmt(dec[0], '.1f')} | {fmt(dec[1], '.1f')} | "
              f"{dec[1] / dec[0]:.2f} | {fmt(median([x['accept_length'] for x in ng]))} | "
              f"{fmt(median([x['accept_rate'] for x in ng]))} | {fmt(ideal(ng))} |")


if __name__ == "__main__":
    main()
