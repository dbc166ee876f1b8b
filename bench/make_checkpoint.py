"""A random-weight Hugging Face checkpoint of the SmolLM2-135M shape, for speed benchmarks.

LlamaForCausalLM, hidden 576, 30 layers, 9 heads / 3 kv heads (head_dim 64), intermediate
1536, tied embeddings, vocab 49152, 8192 positions, rope_theta 1e5, rms_norm_eps 1e-5:
about 134.5M parameters. Weights are seeded normal(0, 0.02) (transformers' own init for
the config's initializer_range), saved as safetensors in --dtype. The tokenizer is the
small byte-level BPE of checkpoints/tiny.py (754 tokens, ids 0..4 special: <s>=0,
</s>=1, <pad>=2): enough for the server to start; benchmarks send input_ids in [10, 700).
Output ids past the tokenizer's vocabulary decode to nothing, which costs the detokenizer
the same as any other id.

Speed is what this checkpoint is for; its text is meaningless.

CLI: python -m bench.make_checkpoint --out /tmp/smollm-135m [--dtype float32|bfloat16]
     [--layers N] [--seed S] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

DTYPES = ("float32", "bfloat16")


def _weight_files(d: pathlib.Path) -> list[pathlib.Path]:
    return sorted(d.glob("*.safetensors"))


def is_complete(d: pathlib.Path) -> bool:
    """config.json, tokenizer files and every safetensors shard the index names are there."""
    if not (d / "config.json").is_file() or not (d / "tokenizer.json").is_file():
        return False
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError):
            return False
        return all((d / s).is_file() for s in shards)
    return (d / "model.safetensors").is_file()


def _existing_matches(d: pathlib.Path, dtype: str, layers: int) -> str | None:
    """None if the checkpoint in d has this dtype and layer count, else why not."""
    cfg = json.loads((d / "config.json").read_text())
    have_dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    if have_dtype != dtype:
        return f"dtype {have_dtype} != requested {dtype}"
    if cfg.get("num_hidden_layers") != layers:
        return f"num_hidden_layers {cfg.get('num_hidden_layers')} != requested {layers}"
    return None


def build(out_dir: pathlib.Path, dtype: str = "float32", layers: int = 30,
          seed: int = 0) -> pathlib.Path:
    """Write the checkpoint to out_dir (which must not exist or be empty-able)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from checkpoints.tiny import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=SMOLLM2_135M["bos_token_id"],
        eos_token_id=SMOLLM2_135M["eos_token_id"],
        pad_token_id=SMOLLM2_135M["pad_token_id"],
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def ensure(out: str | os.PathLike, dtype: str = "float32", layers: int = 30, seed: int = 0,
           force: bool = False) -> pathlib.Path:
    """Build the checkpoint into out unless a complete one is there already.

    The build happens in a temporary sibling directory renamed into place, so an
    interrupted build never leaves a directory that looks complete."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}")
    final = pathlib.Path(out).expanduser().absolute()
    if final.is_dir() and is_complete(final) and not force:
        why = _existing_matches(final, dtype, layers)
        if why is not None:
            raise SystemExit(f"{final} holds a different checkpoint ({why}); "
                             "use another --out or --force")
        print(f"{final}: complete checkpoint already there, skipping", file=sys.stderr)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        build(tmp, dtype=dtype, layers=layers, seed=seed)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build a random-weight SmolLM2-135M-shaped "
                                "Llama checkpoint for benchmarks.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype the weights are saved in")
    p.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"],
                   help="override the layer count (e.g. 2 for a quick smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = p.parse_args(argv)
    print(ensure(args.out, args.dtype, args.layers, args.seed, args.force))


if __name__ == "__main__":
    main()
