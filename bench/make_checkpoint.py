"""Random-weight Hugging Face checkpoints of real model shapes, for speed benchmarks.

--shape (default smollm2-135m):
- smollm2-135m: LlamaForCausalLM, hidden 576, 30 layers, 9 heads / 3 kv heads (head_dim
  64), intermediate 1536, tied embeddings, vocab 49152, 8192 positions, rope_theta 1e5,
  rms_norm_eps 1e-5: about 134.5M parameters.
- gemma3-270m: Gemma3ForCausalLM with google/gemma-3-270m's config: hidden 640, 18 layers,
  4 heads / 1 kv head of head_dim 256, intermediate 2048 (GeGLU), tied embeddings, the
  real vocab of 262144 (the tied embedding is 167.8M of the 268.1M parameters, and the LM
  head 63% of a token's matmul work, as in the real model), sliding window 512 on five
  layers in six (layer_types), query_pre_attn_scalar 256, RoPE bases 1e6 (global) and
  1e4 (local), 32768 positions, q/k norms.
- qwen3-moe: Qwen3MoeForCausalLM with Qwen3-30B-A3B's per-layer ratios scaled to hidden
  1024 (that model has hidden 2048, 48 layers: 30.5B parameters, 122 GB in float32):
  4 layers, 16 heads / 2 kv heads of head_dim 128 (q is 2x hidden, 8 q heads per kv head,
  as there), 128 experts, top 8 renormalized (norm_topk_prob), moe_intermediate_size 384
  (0.375 x hidden, as 768 / 2048), every layer sparse, untied embeddings, the real vocab of
  151936, rope_theta 1e6, 32768 positions: 935M parameters (3.7 GB float32, 1.9 GB
  bfloat16), 57M of them used in a token's layers (attention and 8 experts) plus the
  155.6M of the LM head. Each layer is the real model's layer at half the width; there
  are only 4 so that a float32 copy fits next to transformers' on a 24 GB machine, so the
  LM head weighs more in a token (73% of batch-1 matmul work) than in the real model
  (~10%); at 32 at once a step touches ~112 of each layer's 128 experts and the experts
  dominate. --layers raises the depth where memory allows.

Weights are seeded normal(0, 0.02) (transformers' own init for the config's
initializer_range; Gemma's (1 + weight) norms start at 0, i.e. a gain of 1), saved as
safetensors in --dtype. The tokenizer is the
small byte-level BPE of checkpoints/tiny.py (754 tokens, ids 0..4 special: <s>=0,
</s>=1, <pad>=2): enough for the server to start; benchmarks send input_ids in [10, 700).
Output ids past the tokenizer's vocabulary decode to nothing, which costs the detokenizer
the same as any other id.

Speed is what this checkpoint is for; its text is meaningless.

CLI: python -m bench.make_checkpoint --out /tmp/smollm-135m [--dtype float32|bfloat16]
     [--shape smollm2-135m|gemma3-270m|qwen3-moe] [--layers N] [--seed S] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

# The tiny tokenizer's special ids (checkpoints/tiny.py), for every shape.
_SPECIAL = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)

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
    **_SPECIAL,
)


# google/gemma-3-270m's config.json (transformers 5 names: rope_parameters per layer type).
GEMMA3_270M = dict(
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    max_position_embeddings=32768,
    sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(18)],
    query_pre_attn_scalar=256,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    attention_bias=False,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    use_bidirectional_attention=False,
    initializer_range=0.02,
    **_SPECIAL,
)

# Qwen3-30B-A3B's layer at half its width (hidden 2048 -> 1024), 4 layers (module docstring).
QWEN3_MOE_SMALL = dict(
    hidden_size=1024,
    intermediate_size=3072,          # unused: every layer is sparse (mlp_only_layers empty)
    moe_intermediate_size=384,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    output_router_logits=False,
    initializer_range=0.02,
    **_SPECIAL,
)

# --shape -> (transformers config class name, its fields).
SHAPES = {
    "smollm2-135m": ("LlamaConfig", SMOLLM2_135M),
    "gemma3-270m": ("Gemma3TextConfig", GEMMA3_270M),
    "qwen3-moe": ("Qwen3MoeConfig", QWEN3_MOE_SMALL),
}

DTYPES = ("float32", "bfloat16")


def shape_config(shape: str, layers: int | None = None, **overrides):
    """The transformers config of `shape`, with `layers` layers if given (Gemma 3's
    layer_types cut or extended by its one-global-in-six pattern) and `overrides` replacing
    its fields (the tests' small vocabularies and widths)."""
    import transformers

    cls_name, fields = SHAPES[shape]
    fields = {**fields, **overrides}
    if layers is not None:
        fields["num_hidden_layers"] = layers
        if "layer_types" in fields:
            fields["layer_types"] = ["full_attention" if (i + 1) % 6 == 0
                                     else "sliding_attention" for i in range(layers)]
    return getattr(transformers, cls_name)(**fields)


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


def _existing_matches(d: pathlib.Path, dtype: str, layers: int,
                      shape: str = "smollm2-135m") -> str | None:
    """None if the checkpoint in d has this shape, dtype and layer count, else why not."""
    cfg = json.loads((d / "config.json").read_text())
    want_model_type = shape_config(shape).model_type
    if cfg.get("model_type") != want_model_type:
        return f"model_type {cfg.get('model_type')} != {want_model_type} ({shape})"
    have_dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    if have_dtype != dtype:
        return f"dtype {have_dtype} != requested {dtype}"
    if cfg.get("num_hidden_layers") != layers:
        return f"num_hidden_layers {cfg.get('num_hidden_layers')} != requested {layers}"
    return None


def build(out_dir: pathlib.Path, dtype: str = "float32", layers: int | None = None,
          seed: int = 0, shape: str = "smollm2-135m", **overrides) -> pathlib.Path:
    """Write the checkpoint to out_dir (which must not exist or be empty-able); layers
    None: the shape's own count; overrides: config fields (shape_config)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from checkpoints.tiny import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    config = shape_config(shape, layers, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(**_SPECIAL)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # The launcher warns when it serves a directory marked so (wire/model_path.py).
    (out_dir / "RANDOM_WEIGHTS.txt").write_text(
        f"zserve's {shape}-shaped benchmark checkpoint: seeded random weights, its text is "
        "gibberish.\n")
    return out_dir


def ensure(out: str | os.PathLike, dtype: str = "float32", layers: int | None = None,
           seed: int = 0, force: bool = False, shape: str = "smollm2-135m") -> pathlib.Path:
    """Build the checkpoint into out unless a complete one is there already.

    The build happens in a temporary sibling directory renamed into place, so an
    interrupted build never leaves a directory that looks complete."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}")
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}")
    if layers is None:
        layers = SHAPES[shape][1]["num_hidden_layers"]
    final = pathlib.Path(out).expanduser().absolute()
    if final.is_dir() and is_complete(final) and not force:
        why = _existing_matches(final, dtype, layers, shape)
        if why is not None:
            raise SystemExit(f"{final} holds a different checkpoint ({why}); "
                             "use another --out or --force")
        print(f"{final}: complete checkpoint already there, skipping", file=sys.stderr)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        build(tmp, dtype=dtype, layers=layers, seed=seed, shape=shape)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build a random-weight checkpoint of a real "
                                "model's shape (SmolLM2-135M, Gemma-3-270M, a scaled "
                                "Qwen3-30B-A3B) for benchmarks.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype the weights are saved in")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m",
                   help="the model shape (module docstring)")
    p.add_argument("--layers", type=int,
                   help="override the shape's layer count (e.g. 2 for a quick smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = p.parse_args(argv)
    print(ensure(args.out, args.dtype, args.layers, args.seed, args.force, args.shape))


if __name__ == "__main__":
    main()
