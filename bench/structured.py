"""What constrained decoding costs: the same load with and without a JSON schema, against one
server, and the ratio of their throughputs (issue 13's check 5: a grammar-heavy load of 32
concurrent JSON-schema requests should keep at least 85% of the unconstrained throughput).

    python -m bench.structured                                   # launches the default model
    python -m bench.structured --url http://127.0.0.1:30000      # a server already running
    python -m bench.structured --distinct-schemas                # 32 schemas: 32 compiles

A round is two loads of `--concurrency` requests at once (one POST /generate each):
1. constrained: each asks for JSON that validates against SCHEMA (a list of people), greedy
   (or `--temperature`); every output must parse and validate and end by its grammar;
2. free: the same prompts, the same sampling, no schema, EOS ignored and max_new_tokens set
   to the length the constrained output of that prompt had: the same number of tokens per
   request, so the two loads differ only in the grammar's work (compile, mask, advance).
Throughput = output tokens / wall time (first send to last answer). Rounds alternate
(constrained, free, constrained, free, ...) so drift on a shared machine hits both; the
ratio reported is of the median rates. One warm-up request first (it builds the grammar
tokenizer and, without --distinct-schemas, compiles the schema).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import httpx

from tests.server import Server     # the one harness for launching zserve as a subprocess

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["people"],
    "properties": {"people": {
        "type": "array", "minItems": 4, "maxItems": 4,
        "items": {"type": "object", "additionalProperties": False,
                  "required": ["name", "age", "city", "role"],
                  "properties": {"name": {"type": "string", "maxLength": 24},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "city": {"type": "string", "maxLength": 24},
                                 "role": {"enum": ["admin", "user", "guest"]}}}}}}


def schema_for(i: int, distinct: bool) -> dict:
    """SCHEMA, or (distinct) a copy only request i uses: its own compile, no cache hit."""
    if not distinct:
        return SCHEMA
    return {**SCHEMA, "properties": {**SCHEMA["properties"], "batch": {"const": i}}}


async def run_load(http: httpx.AsyncClient, bodies: list[dict]) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    replies = await asyncio.gather(*(http.post("/generate", json=b) for b in bodies))
    wall = time.perf_counter() - start
    for r in replies:
        r.raise_for_status()
    return wall, [r.json() for r in replies]


async def bench(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        prompts = [f"Request {i}: list four people as JSON (name, age, city, role)."
                   for i in range(args.concurrency)]
        base = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
        if args.temperature > 0:
            base["sampling_seed"] = 1
        await run_load(http, [{"text": "warm up", "sampling_params": {
            **base, "json_schema": SCHEMA}}])
        rates: dict[str, list[float]] = {"constrained": [], "free": []}
        tokens = 0
        for round_ in range(args.rounds):
            bodies = [{"text": p, "sampling_params": {
                **base, "json_schema": schema_for(round_ * args.concurrency + i,
                                                  args.distinct_schemas)}}
                      for i, p in enumerate(prompts)]
            wall, outs = await run_load(http, bodies)
            lengths = [len(o["output_ids"]) for o in outs]
            for o in outs:
                assert o["meta_info"]["finish_reason"]["type"] == "stop", o["meta_info"]
                people = json.loads(o["text"])["people"]
                assert len(people) == 4, o["text"]
            tokens = sum(lengths)
            rates["constrained"].append(tokens / wall)
            free = [{"text": p, "sampling_params": {**base, "max_new_tokens": n,
                                                    "ignore_eos": True}}
                    for p, n in zip(prompts, lengths)]
            wall_free, outs_free = await run_load(http, free)
            assert [len(o["output_ids"]) for o in outs_free] == lengths
            rates["free"].append(tokens / wall_free)
            print(f"round {round_ + 1}: {tokens} tokens; constrained {tokens / wall:.1f} "
                  f"tok/s ({wall:.2f} s), free {tokens / wall_free:.1f} tok/s "
                  f"({wall_free:.2f} s)", flush=True)
        info = (await http.get("/server_info")).json()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"concurrency": args.concurrency, "rounds": args.rounds,
            "distinct_schemas": args.distinct_schemas, "temperature": args.temperature,
            "tokens_per_round": tokens, "rates": rates, "median_tok_s": med,
            "ratio": med["constrained"] / med["free"],
            "model": info.get("model_path"), "dtype": info.get("dtype"),
            "load_avg": os.getloadavg()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: launch one)")
    p.add_argument("--model-path", help="for the launched server (default: the default model)")
    p.add_argument("--server-args", default="", help="extra launch.py flags")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--distinct-schemas", action="store_true",
                   help="every request its own schema (a compile each)")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    server = None
    if args.url is None:
        server = Server(args.model_path, *args.server_args.split(),
                        tmpdir=tempfile.gettempdir(), one_thread=False)
    try:
        result = asyncio.run(bench(args.url or server.url, args))
    finally:
        if server is not None:
            server.terminate()
    med = result["median_tok_s"]
    print(f"\n{args.concurrency} concurrent requests x {args.rounds} rounds, "
          f"{result['tokens_per_round']} output tokens a round"
          f"{', distinct schemas' if args.distinct_schemas else ''}: "
          f"constrained {med['constrained']:.1f} tok/s, free {med['free']:.1f} tok/s, "
          f"ratio {result['ratio']:.3f} (load average {result['load_avg'][0]:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
