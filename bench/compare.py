"""Compare results of bench/serving.py: one figure, one series per result, and a table.

    python -m bench.compare A.json B.json [C.json ...] --output cmp.png [--labels a b c]

The figure has serving.py's panels (CDFs of TTFT, ITL, TPOT and e2e latency; output
tokens/s and requests in flight over time), each result one series, labeled by its file's
stem or by --labels. The table prints each result's headline numbers and, for every result
after the first, its ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):       # run as a file (python bench/compare.py): find bench/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import plot_results, rate_text  # noqa: E402
from bench.table import text_table  # noqa: E402

# (label, getter) rows of the table; getters return a number or None.
ROWS = [
    ("completed", lambda s: s["completed"]),
    ("failed", lambda s: s["failed"]),
    ("duration s", lambda s: s["duration_s"]),
    ("input tokens", lambda s: s["total_input_tokens"]),
    ("output tokens", lambda s: s["total_output_tokens"]),
    ("requests/s", lambda s: s["request_throughput"]),
    ("output tok/s", lambda s: s["output_throughput"]),
    ("total tok/s", lambda s: s["total_token_throughput"]),
    ("mean in flight", lambda s: s["concurrency"]),
    ("goodput req/s", lambda s: s["goodput"]),
    *[(f"{name} {stat} ms", (lambda key, stat: lambda s: s[key][f"{stat}_ms"])(key, stat))
      for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "E2E"))
      for stat in ("mean", "median", "p99")],
]


def labels_for(paths: list[Path]) -> list[str]:
    """File stems, or parent/stem where two stems are the same."""
    stems = [p.stem for p in paths]
    return [f"{p.parent.name}/{p.stem}" if stems.count(p.stem) > 1 else p.stem for p in paths]


def _num(x) -> str:
    if x is None:
        return "-"
    return str(x) if isinstance(x, int) else f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def table(results: list[dict], labels: list[str]) -> str:
    head = ["metric", *labels]
    rows = []
    for name, get in ROWS:
        values = [get(r["summary"]) for r in results]
        cells = [_num(values[0])]
        for v in values[1:]:
            ratio = (f" (x{v / values[0]:.2f})" if isinstance(v, (int, float)) and
                     isinstance(values[0], (int, float)) and values[0] else "")
            cells.append(_num(v) + ratio)
        rows.append([name, *cells])
    rows.insert(0, ["workload", *(f"{r['config']['backend']}, rate {rate_text(r['config'])}, "
                                  f"conc {r['config']['max_concurrency'] or '-'}"
                                  for r in results)])
    return text_table(head, rows, left={0})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot and tabulate bench/serving.py results.")
    p.add_argument("results", nargs="+", type=Path, help="result JSON files")
    p.add_argument("--output", "-o", required=True, help="the PNG to write")
    p.add_argument("--labels", nargs="+", help="one per result (default: the file stems)")
    p.add_argument("--title")
    args = p.parse_args(argv)
    if len(args.results) < 2:
        p.error("give two or more results")
    if args.labels is not None and len(args.labels) != len(args.results):
        p.error(f"{len(args.labels)} labels for {len(args.results)} results")
    results = [json.loads(path.read_text()) for path in args.results]
    labels = args.labels or labels_for(args.results)
    print(table(results, labels))
    plot_results(results, labels, args.output, title=args.title)
    print(f"# wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
