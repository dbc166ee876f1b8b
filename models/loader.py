"""load_model: a Hugging Face checkpoint directory or a GGUF file -> CausalLM on a device,
in a dtype.

The module is built on `meta` (no memory, no random init); each parameter is then allocated
once on the target device and every checkpoint tensor is copied straight into its rows of
it, so fusing q/k/v and gate/up costs no extra copy and peak host memory stays one tensor.
Any checkpoint tensor we cannot place, or parameter left unfilled, is an error listing them.
A GGUF file (or a directory holding one, or its sidecar from gguf.materialize) is read by
gguf.py: config from its metadata, each tensor dequantized into the same parameters; a
GGUF pair's sidecar (a text model with a vision projector file, --mmproj) has its config
in config.json, and the encoder's tensors come from the projector (vision/mmproj.py).

Tensor parallelism (`tp` with size > 1): the module is built with this rank's config
(models/tp.py: Shard) and each checkpoint tensor contributes only this rank's rows or
columns (`Shard.select`): safetensors reads just that slice, a GGUF tensor is dequantized
whole and then cut. The full tensor's shape is still checked against the whole model's.
The vocabulary block's padding rows (last rank) are zero.

Quantization (--quantization; one rank, CPU with kernels.avx2_available): "gguf" keeps a
GGUF file's linear layers in their blocks wherever every part is of a type it keeps
(quant_linear.py: KEPT_TYPES; the parts of a fused layer may differ in type), and its
embedding too when that is of such a type (QuantEmbedding): they are never dequantized,
their parameters never allocated; a mixture of experts' stacks likewise, layer by layer,
where its three stacked tensors are of those types (QuantExperts). "int8" quantizes a float
checkpoint's linear layers to Q8_0 blocks once loaded; "none" dequantizes (or keeps)
floats. Norms, the routers, and any layer of another type, stay in the dtype; so do the
expert stacks under "int8" (moe.py: they are not nn.Linear modules).

A mixture of experts (Qwen3-MoE, Mixtral) comes from safetensors in either layout
transformers 5 reads: one tensor per expert (the Hub's, and save_pretrained's) or the
experts stacked (`_EXPERT_PARTS`); each expert's tensors fill its slice of the stacks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from torch import nn

from .config import ModelConfig
from .llama import ROW_BIASES, CausalLM
from .moe import Experts
from models import kernels
from models.distributed import SOLO
from .cpu_linear import CpuExperts, CpuLinear
from .fast_decode import FastDecode
from .packed import PackedLinear, can_pack
from .quant_linear import KEPT_TYPES, QuantEmbedding, QuantExperts, QuantLinear, quantize_q8_0
from .rope import cos_sin_table
from wire.proc import return_freed_heap
from wire.server_args import INT8_BATCH, QUANTIZATIONS, quantization_refusal
from .tp import VOCAB_PARTS, Selection, Shard
from .vision import checkpoint_names
from .vision import mmproj as projector

log = logging.getLogger(__name__)

# Our fused projection -> its checkpoint parts, stacked in this order along the output dim.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Families whose checkpoints hold those fused tensors themselves, under our names and in the
# same order (Phi-3's qkv_proj, gate_up_proj): each is read straight into our parameter.
_FUSED_IN_CHECKPOINT = ("phi3",)

# A mixture of experts' checkpoint names (moe.py), per family: the block's module, then
# each expert's gate, up and down projections, as Hub checkpoints and transformers 5's
# save_pretrained write them: one 2-D tensor per expert ("model.layers.3.mlp.experts.7.
# gate_proj.weight"; Mixtral's "block_sparse_moe.experts.7.w1.weight"), the router
# "<block>.gate.weight". Or stacked, as transformers 5's modules hold them (save_pretrained
# with save_original_format=False), for both families: "mlp.experts.gate_up_proj",
# "mlp.experts.down_proj" and the router "mlp.gate.weight": our own parameters' names.
_EXPERT_PARTS = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_STACKED = "experts.gate_up_proj"           # a checkpoint that has it holds its experts stacked

# A checkpoint tensor's destination: our parameter, the part of it the tensor fills (rows,
# or an index such as (expert, rows)), and which part of the tensor this rank takes (None:
# all of it).
Target = tuple[str, slice | tuple, Selection | None]


def load_model(model_path: str | Path, dtype: torch.dtype, device: str | torch.device,
               pack: bool | None = None, tp=SOLO, quantization: str = "none",
               int8_batch: int = INT8_BATCH) -> CausalLM:
    """model_path: an HF directory (config.json + *.safetensors), a .gguf file, a directory
    holding exactly one .gguf (and no config.json), or a GGUF sidecar directory.
    pack: lay the linear weights out for a CPU kernel (cpu_linear.py, else oneDNN's:
    packed.py); None: wherever one is available; False: keep plain nn.Linear.
    tp: the tensor-parallel group (models/distributed.py): load only this rank's share.
    quantization: one of QUANTIZATIONS (module docstring). int8_batch: where layers in
    blocks (all types but Q2_K and Q3_K) round activations to int8
    (--int8-activation-batch; quant_linear.py)."""
    from . import gguf

    gguf_path = gguf.find_gguf(model_path)
    header = gguf.read_header(gguf_path) if gguf_path is not None else None
    # The first touch of the CPU kernels (kernels.avx2_available): they compile here on a
    # first start after an install or an update (kernels.build_library says so in the log).
    _check_quantization(quantization, header is not None, torch.device(device), tp)
    mmproj = gguf.find_mmproj(model_path) if header is not None else None
    if mmproj is not None:              # a GGUF pair's sidecar: its config.json has both
        config = ModelConfig.from_path(model_path)
    elif header is not None:
        config = ModelConfig.from_dict(gguf.config_dict(header), gguf.generation_dict(header))
    else:
        config = ModelConfig.from_dir(model_path)
    with torch.device("meta"), _skip_init():
        model = CausalLM(config, tp)
    native = (_keep_gguf_blocks(model, header, dtype, int8_batch) if quantization == "gguf"
              else frozenset())
    params = {name: torch.empty(p.shape, dtype=dtype, device=device)
              for name, p in model.named_parameters()}
    rope_freqs = None
    if header is not None:
        rope_freqs = gguf.load_weights(header, config, params, model.shard, native)
        if mmproj is not None:
            projector.load(gguf.read_header(mmproj), params)
    else:
        _load_safetensors(Path(model_path), config, params, model.shard)
    if model.shard is not None:
        _zero_vocab_padding(params, model.shard)

    model.load_state_dict(params, strict=True, assign=True)
    if rope_freqs is not None:          # a GGUF's Llama 3 rope scaling, as llama.cpp applies it
        model.cos_sin = cos_sin_table(config, divisors=rope_freqs)
    model.cos_sin = model.cos_sin.to(device=device, dtype=dtype)  # HF casts cos/sin to the dtype too
    if model.cos_sin_local is not None:
        model.cos_sin_local = model.cos_sin_local.to(device=device, dtype=dtype)
    model.requires_grad_(False).eval()
    layer = _cpu_linear_class(torch.device(device), dtype) if pack is not False else None
    if pack and layer is None:
        raise ValueError(f"no packed CPU linear layer for {dtype} on {device}")
    if quantization == "int8":
        layer = functools.partial(_quantize_int8, fallback=layer, int8_batch=int8_batch)
    if layer is not None:
        if model.lm_head is None:           # tied: the head gets its own (packed) copy
            rows, hidden = model.embed_tokens.weight.shape     # this rank's vocabulary block
            model.lm_head = nn.Linear(hidden, rows, bias=False, device=device, dtype=dtype)
            model.lm_head.weight.data = model.embed_tokens.weight.data
        _replace_linears(model, layer, skip=("vision",))    # the encoder keeps torch's
    if pack is not False and kernels.linear_available(torch.device(device), dtype):
        _replace_experts(model)             # float experts on the linear kernel too
    model.fast = FastDecode.of(model)
    return_freed_heap()        # the temporaries' pages: ~24 MB of the default model's
    return model


def describe_weights(model: nn.Module) -> dict:
    """What /server_info says of the loaded weights: each linear layer's form (its block
    types, e.g. "Q4_K+Q6_K" for a fused layer kept in two, or the dtype it was dequantized
    or loaded in) with how many layers have it, the embedding's, and the bytes the weights
    hold: the parameters and the blocks (a table shared by the embedding and a tied head
    once); for a mixture of experts, how many layers hold expert stacks, the dtype of those
    held in floats ("dtype") and how many are held in GGUF blocks ("blocks": by form,
    "Q4_K / Q6_K": the gate and up stacks' type, then the down stack's; QuantExperts)."""
    def form(module) -> str:             # block types, or the dtype
        return (module.qtype if isinstance(module, (QuantLinear, QuantEmbedding))
                else str(module.weight.dtype).removeprefix("torch."))

    forms: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantLinear, nn.Linear, CpuLinear, PackedLinear)):
            forms[form(module)] = forms.get(form(module), 0) + 1
    blocks = [b for m in model.modules()
              if isinstance(m, (QuantLinear, QuantEmbedding, QuantExperts))
              for b in m.buffers(recurse=False)]
    held = {}
    for t in (*model.parameters(), *blocks):             # not the RoPE table (a buffer too)
        try:                            # a tied head shares the embedding: counted once
            held[t.data_ptr()] = t.numel() * t.element_size()
        except RuntimeError:            # a layout with no plain storage (oneDNN's)
            held[id(t)] = t.numel() * t.element_size()
    out = {"linear_layers": dict(sorted(forms.items())), "embedding": form(model.embed_tokens),
           "bytes": sum(held.values())}
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if experts:     # a mixture of experts' stacks (moe.py)
        out["experts"] = {"layers": len(experts)}
        floats = [m for m in experts if not isinstance(m, QuantExperts)]
        if floats:
            out["experts"]["dtype"] = str(floats[0].down_proj.dtype).removeprefix("torch.")
        in_blocks: dict[str, int] = {}
        for m in experts:
            if isinstance(m, QuantExperts):
                in_blocks[m.qtype] = in_blocks.get(m.qtype, 0) + 1
        if in_blocks:
            out["experts"]["blocks"] = dict(sorted(in_blocks.items()))
    return out


def _check_quantization(quantization: str, is_gguf: bool, device: torch.device, tp) -> None:
    """A ValueError (one line for the user) if `quantization` cannot apply here."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    blocker = (f"device {device}" if device.type != "cpu" else
               "tensor parallelism" if tp.size > 1 else
               None if kernels.avx2_available(device) else
               "this CPU or compiler (the kernels need AVX2, FMA, F16C and a C compiler)")
    if (problem := quantization_refusal(quantization, is_gguf, blocker)) is not None:
        raise ValueError(problem)


def _keep_gguf_blocks(model: CausalLM, header, dtype: torch.dtype,
                      int8_batch: int) -> frozenset[str]:
    """Swap every linear layer that the file stores in a native block type for a QuantLinear
    holding those blocks (on the model still on `meta`: its parameters are not allocated);
    returns the GGUF tensors so consumed. The embedding, in a block type, becomes a
    QuantEmbedding: on the tied LM head's blocks, or on its own."""
    from . import gguf

    used, kept = set(), {}
    for name, (qtypes, blocks, keys) in gguf.native_linears(header, model.config).items():
        old = None if name == "lm_head" and model.lm_head is None else model.get_submodule(name)
        out_features = old.out_features if old is not None else model.config.vocab_size
        in_features = old.in_features if old is not None else model.config.hidden_size
        widths = {header.tensors[key].shape[-1] for key in keys}
        if sum(b.shape[0] for b in blocks) != out_features or widths != {in_features}:
            raise ValueError(f"{header.path.name}: {', '.join(keys)} have shapes "
                             f"{[header.tensors[key].shape for key in keys]}, expected "
                             f"{out_features} rows of {in_features} in all for {name}")
        bias = None if old is None or old.bias is None else old.bias      # still on meta
        # np.array: a writable copy of the mapped file's read-only bytes, for torch
        quant = QuantLinear(qtypes, [torch.from_numpy(np.array(b)) for b in blocks],
                            in_features, bias, int8_batch)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, quant)
        kept[quant.qtype] = kept.get(quant.qtype, 0) + 1
        if name != "lm_head" or not model.config.tie_word_embeddings:
            used.update(keys)
    experts: dict[str, int] = {}
    for name, (qtypes, blocks, keys) in gguf.native_experts(header, model.config).items():
        # np.array: a writable copy of the mapped file's read-only bytes, for torch
        quant = QuantExperts(*zip(qtypes, (torch.from_numpy(np.array(b)) for b in blocks)),
                             hidden_size=model.config.hidden_size, int8_batch=int8_batch)
        want = tuple(model.get_submodule(name).gate_up_proj.shape)      # still on meta
        if (quant.num_experts, 2 * quant.intermediate_size) != want[:2]:
            raise ValueError(f"{header.path.name}: {keys[0]} has shape "
                             f"{header.tensors[keys[0]].shape}, expected {want[0]} experts "
                             f"of {want[1] // 2} rows")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, quant)
        experts[quant.qtype] = experts.get(quant.qtype, 0) + 1
        used.update(keys)
    embed = header.tensors.get("token_embd.weight")
    if embed is not None and embed.type_name in KEPT_TYPES and model.shard is None:
        head = model.lm_head
        if model.config.tie_word_embeddings and isinstance(head, QuantLinear) \
                and len(head.parts) == 1:
            model.embed_tokens = QuantEmbedding.of_head(head, dtype)
        else:
            model.embed_tokens = QuantEmbedding(
                embed.type_name, torch.from_numpy(np.array(header.raw(embed))),
                model.config.hidden_size, dtype)
        used.add("token_embd.weight")
        log.info("quantization gguf: the embedding's lookups read its %s blocks%s",
                 embed.type_name, " (the tied LM head's)" if model.config.tie_word_embeddings
                 else "")
    c = model.config
    sparse = sum(c.sparse(i) for i in range(c.num_layers))
    total = 2 * c.num_layers + 2 * (c.num_layers - sparse) + 1   # attention, dense MLPs, head
    if sparse:
        log.info("quantization gguf: the experts of %d of %d sparse layers kept in their "
                 "blocks%s", sum(experts.values()), sparse,
                 f" ({', '.join(f'{n} {t}' for t, n in experts.items())})" if experts else "")
    if kept:
        log.info("quantization gguf: %d of %d linear layers kept in their blocks (%s)",
                 sum(kept.values()), total, ", ".join(f"{n} {t}" for t, n in kept.items()))
    else:
        log.warning("quantization gguf: none of %s's linear layers is of a block type "
                    "zserve runs on (%s); all are dequantized (this file needs "
                    "--quantization none's memory)", header.path.name, ", ".join(KEPT_TYPES))
    return frozenset(used)


def _quantize_int8(weight: torch.Tensor, bias: torch.Tensor | None,
                   fallback: type[nn.Module] | None, int8_batch: int) -> nn.Module | None:
    """--quantization int8: a loaded float linear layer as Q8_0 blocks (one scale per 32
    weights). A layer whose input width is not a multiple of 32 gets `fallback` (the float
    layer it would have had), or stays as it is (None)."""
    if weight.shape[1] % 32:
        return fallback(weight, bias) if fallback is not None else None
    return QuantLinear("Q8_0", quantize_q8_0(weight), weight.shape[1],
                       None if bias is None else bias.detach(), int8_batch)


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _skip_init():
    """No random init for modules built on `meta`: every value is loaded afterwards, and
    nn.Embedding's normal_ on meta imports torch._dynamo (seconds on a busy machine).
    nn.init is global: one thread at a time patches and restores it (ranks that are threads
    of one process, models/distributed.py ThreadGroup, would otherwise save each other's
    no-ops as the originals and leave them in place for good)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    with _INIT_LOCK:
        saved = {name: getattr(nn.init, name) for name in names}
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def _zero_vocab_padding(params: dict[str, torch.Tensor], shard: Shard) -> None:
    """The rows of the last vocabulary block past the real vocabulary: no checkpoint fills
    them and nothing they give reaches an output (the embedding masks them, the logits are
    trimmed), but the matmuls still read them: zeros, not uninitialized memory."""
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in params:
            params[name][shard.real_vocab_rows:].zero_()


def _load_safetensors(model_dir: Path, config: ModelConfig, params: dict[str, torch.Tensor],
                      shard: Shard | None = None) -> None:
    """Copy every tensor of the directory's safetensors files (this rank's part of each,
    under tensor parallelism) into its rows of params."""
    files = _safetensors_files(model_dir)
    stacked = config.num_experts > 0 and any(_holds(path, _STACKED) for path in files)
    targets = _checkpoint_targets(shard.config if shard is not None else config, params, shard,
                                  stacked)
    names = checkpoint_names(config)
    filled, unexpected = set(), []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for stored in f.keys():
                key = names.canonical(stored)
                if key.endswith("rotary_emb.inv_freq"):        # recomputed, not loaded
                    continue
                if key == f"{names.head}.weight" and config.tie_word_embeddings:
                    continue                                    # a redundant copy of the embedding
                if key not in targets:
                    unexpected.append(stored)
                    continue
                name, rows, sel = targets[key]
                dst, src = params[name][rows], f.get_slice(stored)
                want = tuple(dst.shape) if sel is None else sel.full_shape(tuple(dst.shape))
                if want != tuple(src.get_shape()):
                    raise ValueError(f"{path.name}: {key} has shape {tuple(src.get_shape())}, "
                                     f"expected {want} for {config.architecture}")
                # copy_ casts to the dtype and moves to the device
                dst.copy_(f.get_tensor(stored) if sel is None else _read_selection(src, sel))
                filled.add(key)
    missing = sorted(targets.keys() - filled)
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not match {config.architecture}: "
                         f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected tensors {sorted(unexpected)[:8]}"
                         f"{'...' if len(unexpected) > 8 else ''}")


def _cpu_linear_class(device: torch.device, dtype: torch.dtype) -> type[nn.Module] | None:
    """The fastest linear layer for this device and dtype: ours, else oneDNN's, else None."""
    if kernels.linear_available(device, dtype):
        return CpuLinear
    return PackedLinear if can_pack(device, dtype) else None


def _replace_experts(model: nn.Module) -> None:
    """Every mixture of experts' float stacks (moe.Experts, not QuantExperts' blocks) laid
    out for linear.c (CpuExperts), in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is Experts:
                setattr(module, name, CpuExperts(child))


def _replace_linears(model: nn.Module, layer: type[nn.Module],
                     skip: tuple[str, ...] = ()) -> None:
    """Replace every nn.Linear below `model` with layer(weight, bias) (unless that is None),
    in place; not below the children named in `skip`."""
    for name, child in list(model.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            if (new := layer(child.weight, child.bias)) is not None:
                setattr(model, name, new)
        else:
            _replace_linears(child, layer)


def _read_selection(src, sel: Selection) -> torch.Tensor:
    """Part of a safetensors tensor (a get_slice handle), reading only its bytes: a slice at
    once, a list of rows (kv heads expanded on an uneven split, a fused tensor's parts) as
    runs of consecutive rows."""
    if isinstance(sel.index, slice):
        return src[sel.key]
    if sel.dim != 0:                    # the stacked experts' gate and up columns
        return sel.take(src[:])
    runs, rows = [], sel.index
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append(src[rows[start]:rows[i - 1] + 1])
            start = i
    return torch.cat(runs)


def _checkpoint_targets(config: ModelConfig, params: dict[str, torch.Tensor],
                        shard: Shard | None = None, stacked: bool = False) -> dict[str, Target]:
    """Checkpoint tensor name -> (our parameter name, the part of it that tensor fills, the
    part of the tensor this rank takes). config: the one the module was built with (this
    rank's under tensor parallelism). stacked: the checkpoint's experts are stacked, not one
    tensor each (_EXPERT_PARTS)."""
    part_rows = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size,
                 "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    names = checkpoint_names(config)
    targets = {}

    def select(part: str, kind: str) -> Selection | None:
        return None if shard is None else shard.select(part.rsplit(".", 1)[-1], kind)

    for name in params:
        if name.startswith("vision."):                          # an image encoder's, whole
            targets[names.encoder + name.removeprefix("vision.")] = (name, slice(None), None)
            continue
        if ".mlp.gate." in name or ".mlp.experts." in name:     # a mixture of experts'
            targets.update(_expert_targets(config, name, names.decoder, shard, stacked))
            continue
        module, kind = name.rsplit(".", 1)                      # kind: "weight" | "bias"
        hf_module = names.head if module == "lm_head" else f"{names.decoder}{module}"
        row_bias = next((b for b in ROW_BIASES if name.endswith(b)), None)
        if row_bias is not None:                                # replicated, added once
            hf_module = f"{names.decoder}{name[: -len(row_bias)]}{ROW_BIASES[row_bias]}"
            targets[f"{hf_module}.bias"] = (name, slice(None), None)
            continue
        fused = next((f for f in _FUSED if module.endswith(f)), None)
        if fused is None:
            rows = slice(None)
            if shard is not None and module in VOCAB_PARTS:     # the padding stays zero
                rows = slice(0, shard.real_vocab_rows)
            targets[f"{hf_module}.{kind}"] = (name, rows, select(module, kind))
            continue
        if config.family in _FUSED_IN_CHECKPOINT:
            parts = tuple(p.rsplit(".", 1)[1] for p in _FUSED[fused])
            targets[f"{hf_module}.{kind}"] = (
                name, slice(None), None if shard is None else shard.select_fused(parts, kind))
            continue
        prefix, start = hf_module[: -len(fused)], 0             # "model.layers.3."
        for part in _FUSED[fused]:
            n = part_rows[part.rsplit(".", 1)[1]]
            targets[f"{prefix}{part}.{kind}"] = (name, slice(start, start + n),
                                                 select(part, kind))
            start += n
    return targets


def _holds(path: Path, suffix: str) -> bool:
    """Does the safetensors file have a tensor whose name ends with `suffix`?"""
    with safe_open(path, framework="pt", device="cpu") as f:
        return any(key.endswith(suffix) for key in f.keys())


def _expert_targets(config: ModelConfig, name: str, prefix: str, shard: Shard | None,
                    stacked: bool) -> dict[str, Target]:
    """_checkpoint_targets for one parameter of a SparseMoE (moe.py): the router
    "layers.3.mlp.gate.weight" or a stack "layers.3.mlp.experts.gate_up_proj" /
    ".down_proj", from a checkpoint of either layout (_EXPERT_PARTS)."""
    layer, _, ours = name.partition(".mlp.")                  # "layers.3", "experts.down_proj"
    if stacked:
        sel = (None if shard is None or ours == "gate.weight"
               else shard.select_stacked(ours.removeprefix("experts.")))
        return {f"{prefix}{name}": (name, slice(None), sel)}
    block, gate, up, down = _EXPERT_PARTS[config.family]
    module = f"{prefix}{layer}.{block}"
    if ours == "gate.weight":                                   # the router: replicated
        return {f"{module}.gate.weight": (name, slice(None), None)}
    i = config.moe_intermediate_size                            # this rank's share
    parts = ([(gate, "gate_proj", slice(0, i)), (up, "up_proj", slice(i, 2 * i))]
             if ours == "experts.gate_up_proj" else [(down, "down_proj", slice(None))])
    return {f"{module}.experts.{e}.{leaf}.weight":
            (name, (e, rows), None if shard is None else shard.select(hf, "weight", expert=True))
            for e in range(config.num_experts) for leaf, hf, rows in parts}


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else model.safetensors, else all
    *.safetensors (a directory may also hold e.g. Mistral's consolidated.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files
