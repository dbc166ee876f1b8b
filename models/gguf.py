"""GGUF checkpoints (llama.cpp's single-file format) served as ordinary zserve models.

This module owns everything zserve knows about a `.gguf` file:

    path = find_gguf(model_path)          # the .gguf behind a file / directory / sidecar, or None
    header = read_header(path)            # metadata + tensor table (no tensor data read)
    cfg = config_dict(header)             # what config.json would say: ModelConfig.from_dict(cfg)
    native_linears(header, config)        # the linear layers kept in their blocks (quantization gguf)
    native_experts(header, config)        # ... and the experts' stacks
    load_weights(header, config, params)  # dequantize every tensor into our parameters (loader.py;
                                          # under tensor parallelism, this rank's part of it)
    sidecar = materialize(path)           # config + tokenizer files as an HF directory, cached

Architectures: general.architecture "llama" (Llama, and Mistral, which llama.cpp converts
as llama; with llama.expert_count, Mixtral), "qwen2", "qwen3", "qwen3moe", "gemma2",
"gemma3", "phi3", "smollm3" (a llama whose every fourth layer has no RoPE: llama.cpp fixes
that step at 4, as transformers' default no_rope_layer_interval; its q/k rows are permuted
as llama's). Mixtures of experts, as llama.cpp's converter writes them and its loader
reads them: each sparse layer's router `ffn_gate_inp` [E, hidden] (kept in F32 by the
converter and llama-quantize) and its experts stacked, `ffn_gate_exps` / `ffn_up_exps`
[E, I, hidden] and `ffn_down_exps` [E, hidden, I] (torch order), filling moe.py's stacks
(each expert's gate_up_proj rows: gate, then up); `expert_count`, `expert_used_count`,
and the experts' width I: Mixtral's `feed_forward_length`, Qwen3-MoE's
`expert_feed_forward_length` (else feed_forward_length / expert_used_count, llama.cpp's
fallback). The top-k weights are renormalized: Mixtral always; for qwen3moe llama.cpp
hard-codes it (no metadata key is read) and transformers' GGUF loader defaults
norm_topk_prob to true with it, as Qwen3-MoE's own configs say. Every layer of a qwen3moe
file is sparse: llama.cpp's tensor list for qwen3moe has no dense MLP, so a model with
mlp_only_layers cannot be converted, and llama.cpp requires ffn_gate_inp on every layer.
Mixtral's q/k rows are permuted as llama's (undone the same way). What llama.cpp's converter and
loader do for the last three, and this module undoes or reads the same way (config_dict):
Gemma's norm weights are stored as 1 + weight (undone at load: (1 + weight) is what the
model multiplies by); the local/global layer pattern is `attention.sliding_window_pattern`
(a per-layer array, or n: every n-th layer global; default 2 for Gemma 2, 6 for Gemma 3),
the local layers' RoPE base `rope.freq_base_swa` (Gemma 3 default 10,000; Gemma 2's is the
global base), and the query scale is not stored: head_dim ** -0.5, except for the 27B
models (46 layers for Gemma 2, 62 for Gemma 3): (hidden / heads) ** -0.5. Phi-3 keeps its
fused qkv (`attn_qkv`) and gate_up (`ffn_up`, gate rows first) tensors, partial rotary as
`rope.dimension_count`, and LongRoPE's factors as the `rope_factors_long` /
`rope_factors_short` tensors with `rope.scaling.original_context_length`; a
`attention.sliding_window` of 0 means none (Phi-4). Tensor types: whatever `gguf.quants.dequantize` can unpack
(F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, the IQ types); weights are dequantized to
float32 exactly as transformers' GGUF loader does (the same numpy code), then cast to the
served dtype. Anything else is a ValueError with one line naming what is missing.

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.modify_tensors) interleaves the
rows of each head of q_proj and k_proj (weights and biases) for the "llama" architecture so
that its RoPE can rotate adjacent pairs; `load_weights` undoes it. Qwen2/Qwen3 files are
written unpermuted (Qwen2Model has no such step, and llama.cpp rotates them NeoX-style).
Llama 3's rope scaling is stored as a `rope_freqs` tensor (one divisor per frequency), not
as metadata: rope.cos_sin_table builds the table from it and the loader installs that.

The header is read here rather than with `gguf.GGUFReader`, whose field parser builds a numpy
view per string of the vocabulary and merge table (2-7 s for SmolLM2's 98k strings on this
machine, more than the whole load budget); tests/test_gguf.py checks that both readers agree.

The sidecar: only the scheduler needs the weights; the tokenizer, detokenizer and API
processes need config.json and the tokenizer. `materialize` writes those once per GGUF
(keyed by its path, size and mtime) into a cache directory, using transformers' own GGUF
tokenizer conversion, plus `zserve_gguf.json` naming the file. Every process can then treat
the sidecar as an HF directory, and load_model(sidecar) reads the weights from the GGUF.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .llama import ROW_BIASES
from .quant_linear import KEPT_TYPES
from wire.model_path import SIDECAR_FILE, SIDECAR_VERSION, gguf_file_key, gguf_sidecar_dir

# general.architecture -> the HF architecture we build. Mistral GGUFs say "llama".
# "llama" with experts (llama.expert_count) is Mixtral's: config_dict.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
MIXTRAL = "MixtralForCausalLM"
_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType): id -> struct format of a scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


# ---------------------------------------------------------------------------------------
# Finding the file


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file that model path `path` stands for, or None for an HF directory.

    A `.gguf` file; a directory with no config.json and exactly one `*.gguf`; or a sidecar
    directory written by `materialize` (its zserve_gguf.json names the file)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir():
        return None
    if (path / SIDECAR_FILE).is_file():
        return _sidecar_target(path)
    if (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} .gguf files "
                         f"({', '.join(p.name for p in found)}): pass one of them")
    return found[0] if found else None


def _sidecar_target(sidecar: Path, file: str = "gguf_file", key: str = "key") -> Path:
    """The GGUF a sidecar stands for; an error if that file changed since it was written."""
    info = json.loads((sidecar / SIDECAR_FILE).read_text())
    target = Path(info[file])
    if not target.is_file():
        raise FileNotFoundError(f"{sidecar}: its GGUF file {target} no longer exists")
    if gguf_file_key(target) != info.get(key):
        raise ValueError(f"{sidecar}: {target} changed since this sidecar was written; "
                         f"pass the .gguf file itself to rebuild it")
    return target


def find_mmproj(path: str | Path) -> Path | None:
    """The vision projector file (--mmproj) a GGUF pair's sidecar stands for, else None."""
    path = Path(path)
    if not (path.is_dir() and (path / SIDECAR_FILE).is_file()):
        return None
    if "mmproj_file" not in json.loads((path / SIDECAR_FILE).read_text()):
        return None
    return _sidecar_target(path, "mmproj_file", "mmproj_key")


# ---------------------------------------------------------------------------------------
# Header


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]          # torch order: (rows, columns) for a matrix
    ggml_type: int                  # gguf.GGMLQuantizationType value
    offset: int                     # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """A GGUF file's metadata and tensor table. String arrays (the vocabulary, the merges)
    are kept as their length only: nothing in the scheduler needs their contents."""
    path: Path
    metadata: dict
    tensors: dict[str, TensorInfo]
    _buffer: mmap.mmap

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes (a view of the mapped file) shaped as gguf.quants.dequantize
        expects: rows x bytes-per-row."""
        arr = np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return arr.reshape(*info.shape[:-1], info.nbytes // max(rows, 1))

    def dequantize(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32 in torch order (the gguf library's dequantization; an F32
        tensor is a read-only view of the file)."""
        from gguf.quants import dequantize
        return dequantize(self.raw(info), info.ggml_type).reshape(info.shape)


def read_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (v2 and v3, little-endian).

    Every count and length the header states (entries, strings, arrays, dimensions) is
    checked against the bytes left in the file before anything is read or allocated by it:
    a corrupt or hostile file is a ValueError naming the file and the bad value."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:                      # an empty file cannot be mapped
            raise ValueError(f"{path}: empty file, not a GGUF file") from None
    if buf[:4] != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it does not start with b'GGUF')")
    size = len(buf)
    try:
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported "
                             f"(zserve reads v2 and v3, little-endian)")
        pos, metadata = 24, {}
        _check_count(path, n_kv, "metadata entries", _MIN_KV_BYTES, size - pos)
        _check_count(path, n_tensors, "tensors", _MIN_TENSOR_BYTES, size - pos)
        for _ in range(n_kv):
            try:
                key, pos = _read_str(buf, pos)
            except ValueError as exc:
                raise ValueError(f"{path}: metadata key: {exc}") from None
            (vtype,) = struct.unpack_from("<I", buf, pos)
            try:
                metadata[key], pos = _read_value(buf, pos + 4, vtype)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc} (key {key})") from None
        _check_count(path, n_tensors, "tensors", _MIN_TENSOR_BYTES, size - pos)
        entries = []
        for i in range(n_tensors):
            try:
                name, pos = _read_str(buf, pos)
            except ValueError as exc:
                raise ValueError(f"{path}: tensor {i}'s name: {exc}") from None
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            if n_dims > _MAX_DIMS:
                raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions; GGUF "
                                 f"allows at most {_MAX_DIMS} (a corrupt file?)")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    except (struct.error, OverflowError):       # no count above lets either happen
        raise ValueError(f"{path}: truncated or corrupt GGUF header") from None
    align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(align) is not int or not 0 < align <= size or align & (align - 1):
        raise ValueError(f"{path}: general.alignment {align!r} is not a power of two that "
                         f"fits the file")
    data_start = -(-pos // align) * align
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has ggml type {ggml_type}, which the gguf "
                             f"library does not know; supported: {', '.join(supported_types())}"
                             ) from None
        n = math.prod(shape)                    # Python ints: a forged shape cannot wrap
        info = TensorInfo(name, shape, ggml_type, data_start + offset, n // block * type_size)
        if info.offset + info.nbytes > size:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
        tensors[name] = info
    return GGUFHeader(path, metadata, tensors, buf)


# The fewest bytes a header entry can take: a metadata pair (key length, value type, a
# one-byte value) and a tensor (name length, dimension count, type, offset).
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8
_MAX_DIMS = 4                                   # GGML_MAX_DIMS


def _check_count(path: Path, count: int, what: str, each: int, left: int) -> None:
    if count * each > left:
        raise ValueError(f"{path}: the GGUF header claims {count} {what}, more than the "
                         f"{left} bytes left in the file can hold (at least {each} bytes "
                         f"each): the file is corrupt or truncated")


def _str_end(buf, pos: int) -> int:
    """Where the string at `pos` (a uint64 length, then its bytes) ends."""
    (n,) = struct.unpack_from("<Q", buf, pos)
    if n > len(buf) - pos - 8:
        raise ValueError(f"a string of {n} bytes at byte {pos} runs past the end of the file "
                         f"({len(buf)} bytes)")
    return pos + 8 + n


def _read_str(buf, pos: int) -> tuple[str, int]:
    end = _str_end(buf, pos)
    return buf[pos + 8:end].decode("utf-8", errors="replace"), end


def _read_value(buf, pos: int, vtype: int):
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        value = struct.unpack_from(fmt, buf, pos)[0]
        if vtype == 6:          # float32: its shortest decimal (1e-06, not 9.99999997e-07)
            value = float(str(np.float32(value)))
        return value, pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_str(buf, pos)
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        each = struct.calcsize("<" + _SCALARS[item_type]) if item_type in _SCALARS else 8
        if count * each > len(buf) - pos:
            raise ValueError(f"an array of {count} items at byte {pos - 12} runs past the end "
                             f"of the file ({len(buf)} bytes)")
        if item_type in _SCALARS:
            fmt = f"<{count}{_SCALARS[item_type]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        if item_type == _STRING:                # walk past it; keep its length only
            for _ in range(count):
                pos = _str_end(buf, pos)
            return count, pos
        raise ValueError(f"arrays of GGUF metadata value type {item_type} are not supported")
    raise ValueError(f"unknown GGUF metadata value type {vtype}")


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@functools.cache
def supported_types() -> tuple[str, ...]:
    """The ggml tensor types the installed gguf library can dequantize (probed: one block
    of zeros each)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    names = []
    for t in GGMLQuantizationType:
        block, type_size = GGML_QUANT_SIZES.get(t, (0, 0))
        if not block:
            continue
        try:
            out = dequantize(np.zeros((1, type_size), dtype=np.uint8), t)
        except (NotImplementedError, ValueError, TypeError):
            continue
        if out.dtype == np.float32:
            names.append(t.name)
    return tuple(names)


# ---------------------------------------------------------------------------------------
# Config


def config_dict(header: GGUFHeader) -> dict:
    """The config.json (plus generation eos ids) that this GGUF's metadata describes, in
    transformers 5's dialect; ModelConfig.from_dict checks what we can serve."""
    meta, tensors, name = header.metadata, header.tensors, header.path.name
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{name}: unsupported GGUF architecture {arch!r}: zserve supports "
                         f"{sorted(ARCHITECTURES)} (Mistral files are 'llama')")
    if int(meta.get("split.count", 1)) > 1:
        raise ValueError(f"{name}: split GGUF files are not supported; merge them first "
                         f"(llama-gguf-split --merge)")
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if experts and arch not in ("llama", "qwen3moe"):
        raise ValueError(f"{name}: experts in a {arch!r} file are not supported (zserve reads "
                         f"mixtures of experts from 'qwen3moe' and Mixtral's 'llama' files)")
    if arch == "qwen3moe" and not experts:
        raise ValueError(f"{name}: a qwen3moe file without qwen3moe.expert_count")

    def get(key, default=KeyError):
        value = meta.get(f"{arch}.{key}", default)
        if value is KeyError:
            raise ValueError(f"{name}: GGUF metadata has no {arch}.{key}")
        if isinstance(value, list):             # per-layer values: only uniform ones
            if len(set(value)) != 1:
                raise ValueError(f"{name}: per-layer {arch}.{key} is not supported")
            value = value[0]
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{name}: key_length != value_length is not supported")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise ValueError(f"{name}: partial rotary embeddings (rope.dimension_count {rope_dim} "
                         f"< head dim {head_dim}) are not supported for {arch!r}")
    vocab = meta.get("tokenizer.ggml.tokens")   # its length, see GGUFHeader
    if not isinstance(vocab, int):              # no tokenizer in the file
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None and "token_embd.weight" not in tensors:
            raise ValueError(f"{name}: neither a vocabulary nor a token_embd.weight tensor")
        vocab = int(vocab or tensors["token_embd.weight"].shape[0])
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear" and arch == "gemma3":     # Gemma 3 4B+: its global layers'
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in ("none", None):  # llama.cpp's own linear / yarn / longrope parameters
        raise ValueError(f"{name}: unsupported rope type {scaling!r} in a GGUF file (zserve "
                         f"reads RoPE scaling from GGUF only as Llama 3's rope_freqs tensor, "
                         f"Gemma 3's linear factor and Phi-3's LongRoPE factor tensors)")
    types = {t.ggml_type for n, t in tensors.items() if n.endswith(".weight")}
    dtype = {frozenset([0]): "float32", frozenset([0, 1]): "float16", frozenset([1]): "float16",
             frozenset([0, 30]): "bfloat16", frozenset([30]): "bfloat16"}.get(frozenset(types))

    eos = meta.get("tokenizer.ggml.eos_token_id")
    hf_arch = MIXTRAL if experts and arch == "llama" else ARCHITECTURES[arch]
    cfg = {
        "architectures": [hf_arch],
        "model_type": {MIXTRAL: "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}.get(hf_arch, arch),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if experts:
        cfg.update(_experts_config(get, arch, experts, cfg["intermediate_size"]))
    elif arch in ("llama", "smollm3"):
        cfg["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors
    if arch in ("qwen2", "qwen3", "qwen3moe"):
        cfg["use_sliding_window"] = False
    elif arch in ("gemma2", "gemma3"):
        cfg.update(_gemma_config(header, get, cfg, rope))
    elif arch == "phi3":
        cfg.update(_phi3_config(header, get, rope, rope_dim / head_dim))
    if dtype is not None:
        cfg["dtype"] = dtype
    return cfg


def _experts_config(get, arch: str, experts: int, feed_forward: int) -> dict:
    """A mixture of experts' config keys, as llama.cpp's loader reads them (module
    docstring): Mixtral's experts are feed_forward_length wide, Qwen3-MoE's
    expert_feed_forward_length (else, as llama.cpp, feed_forward_length / experts used)."""
    used = int(get("expert_used_count"))
    out = {"num_local_experts": experts, "num_experts_per_tok": used}
    if arch == "llama":
        out["sliding_window"] = None
        return out
    width = get("expert_feed_forward_length", None)
    return {**out, "moe_intermediate_size": int(width or feed_forward // used),
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _gemma_config(header: GGUFHeader, get, cfg: dict, rope: dict) -> dict:
    """Gemma 2 / 3's config keys, as llama.cpp's loader reads them (module docstring)."""
    arch, n = header.metadata["general.architecture"], cfg["num_hidden_layers"]
    pattern = header.metadata.get(f"{arch}.attention.sliding_window_pattern",   # get() takes
                                  2 if arch == "gemma2" else 6)                  # no lists
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ValueError(f"{header.path.name}: {arch}.attention.sliding_window_pattern "
                             f"has {len(pattern)} entries for {n} layers")
        local = [bool(x) for x in pattern]
    else:                               # llama.cpp's set_swa_pattern(n): the n-th global
        local = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n)]
    big = n == (46 if arch == "gemma2" else 62)             # the 27B models
    out = {"hidden_activation": "gelu_pytorch_tanh",
           "sliding_window": int(get("attention.sliding_window", 4096)),
           "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
           "query_pre_attn_scalar": (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                     else cfg["head_dim"]),
           "final_logit_softcapping": get("final_logit_softcapping", None)}
    if arch == "gemma2":
        out["attn_logit_softcapping"] = get("attn_logit_softcapping", None)
        swa_base = get("rope.freq_base_swa", rope["rope_theta"])
        if float(swa_base) != rope["rope_theta"]:
            raise ValueError(f"{header.path.name}: a Gemma 2 with its own local RoPE base is "
                             f"not supported")
    else:
        out["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(get("rope.freq_base_swa", 10000.0))}}
    return out


def _phi3_config(header: GGUFHeader, get, rope: dict, partial: float) -> dict:
    """Phi-3's config keys: partial rotary, its window (0: none) and LongRoPE's factors,
    which the file keeps as two small tensors (read here)."""
    out = {"partial_rotary_factor": partial,
           "sliding_window": int(get("attention.sliding_window", 0)) or None}
    long, short = (header.tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if (long is None) != (short is None):
        raise ValueError(f"{header.path.name}: only one of rope_factors_long and "
                         f"rope_factors_short")
    if long is not None:
        rope.update(rope_type="longrope",
                    long_factor=[float(x) for x in header.dequantize(long).reshape(-1)],
                    short_factor=[float(x) for x in header.dequantize(short).reshape(-1)])
        out["original_max_position_embeddings"] = int(
            get("rope.scaling.original_context_length"))
    return out


def generation_dict(header: GGUFHeader) -> dict:
    """generation_config.json: eos_token_id also lists llama.cpp's other end-of-generation
    tokens (end of turn, end of message: Llama 3's <|eot_id|>, <|eom_id|>)."""
    meta = header.metadata
    eos = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    gen = {"eos_token_id": list(dict.fromkeys(int(i) for i in eos))}
    for key in ("bos", "padding"):
        if (value := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            gen["pad_token_id" if key == "padding" else "bos_token_id"] = int(value)
    return gen


# ---------------------------------------------------------------------------------------
# Weights


# GGUF tensor part -> the HF module it stands for (what models/tp.py's Shard.select names).
HF_PARTS = {"token_embd": "embed_tokens", "output": "lm_head", "attn_q": "q_proj",
            "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
            "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Under tensor parallelism a row-parallel layer's bias is a parameter of its own (llama.py).
ROW_BIAS_PARAMS = {f"{module}.bias": param for param, module in ROW_BIASES.items()}


def parameter_targets(config, shard=None) -> dict[str, tuple]:
    """GGUF tensor name -> (our parameter name, the rows of it that tensor fills, the part
    of the tensor this rank takes: a models/tp.py Selection, None for all of it). config:
    the whole model's; under tensor parallelism (`shard`) the rows are of this rank's
    parameters."""
    local = config if shard is None else shard.config
    q, kv, inter = local.q_size, local.kv_size, local.intermediate_size
    vocab_rows = slice(None) if shard is None else slice(0, shard.real_vocab_rows)

    phi3 = config.family == "phi3"

    def select(gguf_part: str, kind: str):
        if shard is not None and phi3 and gguf_part in _PHI3_FUSED:
            return shard.select_fused(_PHI3_FUSED[gguf_part], kind)
        hf = HF_PARTS.get(gguf_part)
        return None if shard is None or hf is None else shard.select(hf, kind)

    targets = {"token_embd.weight": ("embed_tokens.weight", vocab_rows,
                                     select("token_embd", "weight")),
               "output_norm.weight": ("norm.weight", slice(None), None)}
    if not config.tie_word_embeddings:
        targets["output.weight"] = ("lm_head.weight", vocab_rows, select("output", "weight"))
    kinds = ("weight", "bias")
    for i in range(config.num_layers):
        blk, ours = f"blk.{i}.", f"layers.{i}."
        parts = {
            "attn_norm": ("input_layernorm", None, ("weight",)),
            "ffn_norm": ("post_attention_layernorm", None, ("weight",)),
            "attn_q": ("self_attn.qkv_proj", slice(0, q), kinds),
            "attn_k": ("self_attn.qkv_proj", slice(q, q + kv), kinds),
            "attn_v": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv), kinds),
            "attn_output": ("self_attn.o_proj", None, kinds),
            "attn_q_norm": ("self_attn.q_norm", None, ("weight",)),
            "attn_k_norm": ("self_attn.k_norm", None, ("weight",)),
            "ffn_gate": ("mlp.gate_up_proj", slice(0, inter), kinds),
            "ffn_up": ("mlp.gate_up_proj", slice(inter, 2 * inter), kinds),
            "ffn_down": ("mlp.down_proj", None, kinds),
        }
        if config.gemma:        # a norm after attention and after the MLP too (gemma.py)
            parts.update(ffn_norm=("pre_feedforward_layernorm", None, ("weight",)),
                         post_attention_norm=("post_attention_layernorm", None, ("weight",)),
                         post_ffw_norm=("post_feedforward_layernorm", None, ("weight",)))
        if phi3:                # the fused tensors of the checkpoint, kept fused
            for part in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
                del parts[part]
            parts.update(attn_qkv=("self_attn.qkv_proj", None, kinds),
                         ffn_up=("mlp.gate_up_proj", None, kinds))
        if config.sparse(i):    # the experts stacked [E, ...], and the router
            for part in ("ffn_gate", "ffn_up", "ffn_down"):
                del parts[part]
            targets.update(_expert_targets(config, local, i, shard))
        for gguf_part, (module, rows, allowed) in parts.items():
            for kind in allowed:
                param = f"{module}.{kind}"
                if shard is not None:
                    param = ROW_BIAS_PARAMS.get(param, param)
                targets[f"{blk}{gguf_part}.{kind}"] = (f"{ours}{param}", rows or slice(None),
                                                       select(gguf_part, kind))
    return targets


def _expert_targets(config, local, layer: int, shard) -> dict[str, tuple]:
    """parameter_targets for a sparse layer (moe.py): the router ffn_gate_inp [E, hidden],
    replicated; ffn_gate_exps and ffn_up_exps [E, I, hidden] fill the gate and up rows of
    each expert's gate_up_proj [E, 2 I, hidden], ffn_down_exps [E, hidden, I] down_proj;
    under tensor parallelism each expert's share of the I columns (Shard.select_stacked)."""
    blk, ours, inter = f"blk.{layer}.", f"layers.{layer}.mlp.", local.moe_intermediate_size

    def select(part: str):
        return None if shard is None else shard.select_stacked(part)

    every = slice(None)
    return {f"{blk}ffn_gate_inp.weight": (f"{ours}gate.weight", every, None),
            f"{blk}ffn_gate_exps.weight": (f"{ours}experts.gate_up_proj",
                                           (every, slice(0, inter)), select("gate_proj")),
            f"{blk}ffn_up_exps.weight": (f"{ours}experts.gate_up_proj",
                                         (every, slice(inter, 2 * inter)), select("up_proj")),
            f"{blk}ffn_down_exps.weight": (f"{ours}experts.down_proj", every,
                                           select("down_proj"))}


# Phi-3's fused GGUF tensors -> the column-parallel parts they stack (models/tp.py).
_PHI3_FUSED = {"attn_qkv": ("q_proj", "k_proj", "v_proj"), "ffn_up": ("gate_proj", "up_proj")}


def _permuted_heads(config) -> dict[str, int]:
    """GGUF tensor -> its head count, for the tensors llama.cpp permuted (see the module
    docstring): q and k, weights and biases, of the "llama" architecture."""
    if config.family not in ("llama", "mistral", "smollm3", "mixtral"):
        return {}
    return {f"blk.{i}.{part}.{kind}": heads for i in range(config.num_layers)
            for part, heads in (("attn_q", config.num_heads), ("attn_k", config.num_kv_heads))
            for kind in ("weight", "bias")}


def _unpermute_rows(rows, heads: int, head_dim: int):
    """llama.cpp's LlamaModel.permute undone: rows h*D + s*D/2 + i (s: half, i < D/2) were
    written at h*D + 2*i + s; reading [h, D/2, 2] back as [h, 2, D/2] undoes it. rows: a
    torch tensor or numpy array whose first dimension is the rows (float values or a
    quantized row's bytes: only whole rows move)."""
    rest = tuple(rows.shape[1:])
    return rows.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
            "lm_head")


def _linear_parts(config) -> dict[str, list[str]]:
    """Our linear module -> its GGUF weight tensors, in the parameter's row order. A tied
    LM head reads token_embd."""
    groups: dict[str, list[tuple[str, slice]]] = {}
    for key, (param, rows, _) in parameter_targets(config).items():
        module, _, kind = param.rpartition(".")
        if kind == "weight" and module.endswith(_LINEARS):
            groups.setdefault(module, []).append((key, rows))
    if config.tie_word_embeddings:
        groups["lm_head"] = [("token_embd.weight", slice(None))]
    return {module: [key for key, rows in sorted(parts, key=lambda p: p[1].start or 0)]
            for module, parts in groups.items()}


def linear_types(header: GGUFHeader, config) -> dict[str, tuple[set[str], bool]]:
    """Our linear module -> (its GGUF parts' tensor types, whether --quantization gguf
    keeps it in its blocks: all parts there and each of a type the loader keeps
    (quant_linear.py: KEPT_TYPES); the parts may differ in type, as Q4_K_M's q/k (Q4_K) and
    v (Q6_K) do)."""
    out = {}
    for module, keys in _linear_parts(config).items():
        infos = [header.tensors.get(key) for key in keys]
        types = {info.type_name for info in infos if info is not None}
        kept = None not in infos and types <= set(KEPT_TYPES)
        out[module] = types, kept
    return out


def native_linears(header: GGUFHeader, config) -> dict[str, tuple[list[str], list[np.ndarray],
                                                                  list[str]]]:
    """For --quantization gguf (one rank): our linear module -> (its parts' ggml types, their
    weights as the file's own blocks, each uint8 [rows, bytes per row], the GGUF tensors
    read), in the parameter's row order, for each linear layer linear_types keeps; the
    others are dequantized as usual. llama's q/k rows are un-permuted. A tied LM head takes
    token_embd's blocks (loader.py then reads the embedding's lookups from the head's)."""
    unpermute = _permuted_heads(config)
    parts = _linear_parts(config)
    found = {}
    for module, (types, kept) in linear_types(header, config).items():
        if not kept:
            continue
        qtypes, blocks = [], []
        for key in parts[module]:
            info = header.tensors[key]
            raw = header.raw(info)
            blocks.append(_unpermute_rows(raw, unpermute[key], config.head_dim)
                          if key in unpermute else raw)
            qtypes.append(info.type_name)
        found[module] = (qtypes, blocks, parts[module])
    return found


_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def native_experts(header: GGUFHeader, config) -> dict[str, tuple[list[str], list[np.ndarray],
                                                                  list[str]]]:
    """For --quantization gguf (one rank): each sparse layer's experts module ("layers.3.mlp.
    experts") -> (the types of its gate, up and down stacks, their blocks as the file holds
    them, uint8 [E, rows, bytes per row], the GGUF tensors read), where all three are
    there and of KEPT_TYPES (quant_linear.QuantExperts); the others are dequantized."""
    found = {}
    for i in range(config.num_layers):
        if not config.sparse(i):
            continue
        keys = [f"blk.{i}.{part}.weight" for part in _EXPERT_TENSORS]
        infos = [header.tensors.get(key) for key in keys]
        if None in infos or any(info.type_name not in KEPT_TYPES for info in infos):
            continue
        found[f"layers.{i}.mlp.experts"] = ([info.type_name for info in infos],
                                            [header.raw(info) for info in infos], keys)
    return found


def load_weights(header: GGUFHeader, config, params: dict[str, torch.Tensor],
                 shard=None, native: frozenset[str] = frozenset()) -> torch.Tensor | None:
    """Dequantize every tensor of the file into its rows of `params` (allocated, any dtype
    and device). Returns the rope_freqs tensor (float32) if the file has one, else None.
    Raises ValueError naming missing / unexpected / mistyped tensors before reading any.
    config: the whole model's. shard (models/tp.py): under tensor parallelism, each tensor
    is dequantized whole, un-permuted per head, then cut to this rank's part. native: the
    tensors kept quantized (native_linears), which have no parameter here."""
    from tqdm import tqdm

    name = header.path.name
    targets = {k: v for k, v in parameter_targets(config, shard).items() if v[0] in params}
    extra = ({"rope_freqs.weight"} if config.family in ("llama", "mistral", "mixtral") else
             {"rope_factors_long.weight", "rope_factors_short.weight"}    # config_dict's
             if config.family == "phi3" else set())
    unexpected = sorted(set(header.tensors) - set(targets) - extra - native)
    missing = sorted(set(targets) - set(header.tensors))
    if missing or unexpected:
        raise ValueError(f"{name} does not match {config.architecture}: missing tensors "
                         f"{_few(missing)}, unexpected tensors {_few(unexpected)}")
    check_types(header)
    if "rope_freqs.weight" in header.tensors and \
            header.tensors["rope_freqs.weight"].shape != (config.head_dim // 2,):
        raise ValueError(f"{name}: rope_freqs.weight has shape "
                         f"{header.tensors['rope_freqs.weight'].shape}, expected "
                         f"({config.head_dim // 2},)")
    for key, (param, rows, sel) in targets.items():
        want = tuple(params[param][rows].shape)
        if sel is not None:
            want = sel.full_shape(want)
        if header.tensors[key].shape != want:
            raise ValueError(f"{name}: {key} has shape {header.tensors[key].shape}, expected "
                             f"{want} for {config.architecture}")

    unpermute = _permuted_heads(config)

    def load_one(key: str) -> int:
        info = header.tensors[key]
        param, rows, sel = targets[key]
        values = header.dequantize(info)
        src = torch.from_numpy(values if values.flags.writeable else values.copy())
        dst = params[param][rows]
        if key in unpermute:        # by the whole model's heads: before any cut
            src = _unpermute_rows(src, unpermute[key], config.head_dim)
        if config.gemma and key.endswith("norm.weight"):   # stored as 1 + weight
            src = src - 1
        if sel is not None:
            src = sel.take(src)
        dst.copy_(src)
        return info.nbytes

    order = sorted(targets, key=lambda k: -header.tensors[k].nbytes)     # big ones first
    total = sum(header.tensors[k].nbytes for k in order)
    workers = max(1, min(4, os.cpu_count() or 1))
    # A thread lock for the bar: tqdm's default adds a multiprocessing lock, a named
    # semaphore that a server child never unlinks (launch.py stops children with SIGKILL,
    # see wire/proc.py), so every shutdown warned of a "leaked semaphore".
    tqdm.set_lock(threading.RLock())
    with tqdm(total=total, desc=f"Loading {name}", unit="B", unit_scale=True,
              delay=1.0, leave=True) as bar, ThreadPoolExecutor(workers) as pool:
        for nbytes in pool.map(load_one, order):    # numpy and torch release the GIL
            bar.update(nbytes)
    rope_freqs = header.tensors.get("rope_freqs.weight")
    return torch.from_numpy(header.dequantize(rope_freqs).copy()) if rope_freqs else None


def check_types(header: GGUFHeader) -> None:
    """A ValueError naming the first tensor whose type the gguf library cannot dequantize."""
    ok = supported_types()
    for info in header.tensors.values():
        if info.type_name not in ok:
            raise ValueError(f"{header.path.name}: tensor {info.name} has type {info.type_name}, "
                             f"which the gguf library cannot dequantize; supported: "
                             f"{', '.join(ok)}")


def _few(names: list[str], n: int = 8) -> str:
    return f"{names[:n]}{'...' if len(names) > n else ''}"


# ---------------------------------------------------------------------------------------
# Sidecar


def materialize(gguf_path: str | Path, cache_root: str | Path | None = None,
                mmproj: str | Path | None = None) -> Path:
    """The sidecar directory for a GGUF file (or a directory holding one), built on first
    use: config.json, generation_config.json, the tokenizer files (transformers' GGUF
    tokenizer, saved with save_pretrained; the chat template included) and zserve_gguf.json.
    With a vision projector file (`mmproj`), the pair's sidecar (materialize_pair).

    Keyed by the file's resolved path, size and mtime; built under a temporary name and
    renamed into place, so concurrent callers are safe and a sidecar is never half-written.
    An unsupported architecture or tensor type is refused here, before anything is built."""
    path = find_gguf(gguf_path) if Path(gguf_path).is_dir() else Path(gguf_path)
    if path is None:
        raise ValueError(f"{gguf_path}: no .gguf file there")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    path = path.resolve()
    if mmproj is not None:
        return materialize_pair(path, Path(mmproj), cache_root)
    final = gguf_sidecar_dir(path, Path(cache_root) if cache_root is not None else None)
    root, key = final.parent, gguf_file_key(path)
    if (final / SIDECAR_FILE).is_file():
        return final

    header = read_header(path)
    cfg = config_dict(header)
    gen = generation_dict(header)
    from .config import ModelConfig
    config = ModelConfig.from_dict(cfg, gen)        # refuse what we cannot serve, now
    check_types(header)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _save_tokenizer(path, tmp, config)
        (tmp / SIDECAR_FILE).write_text(json.dumps({
            "gguf_file": str(path), "key": key, "size": path.stat().st_size,
            "sidecar_version": SIDECAR_VERSION, "created": time.time()}, indent=2) + "\n")
    return _install_sidecar(final, write)


def _install_sidecar(final: Path, write) -> Path:
    """Build a sidecar with write(tmp) under a temporary name beside `final`, then rename
    it into place: concurrent builders are safe, and a sidecar is never half-written."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:                 # another process won the race: keep theirs
            if not (final / SIDECAR_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def materialize_pair(path: Path, mmproj: Path, cache_root: str | Path | None = None) -> Path:
    """The sidecar of a GGUF text model with a vision projector file: the text model's
    tokenizer and generation files, a vision config.json (models/vision/mmproj.py: the
    text model's config as its text_config, the encoder's from the projector's metadata,
    the image token from the tokenizer), processor_config.json, and zserve_gguf.json naming
    both files."""
    from .vision import mmproj as projector

    mmproj = mmproj.resolve()
    if not mmproj.is_file():
        raise FileNotFoundError(f"{mmproj}: no such file")
    root = Path(cache_root) if cache_root is not None else None
    final = gguf_sidecar_dir(path, root, mmproj)
    if (final / SIDECAR_FILE).is_file():
        return final
    text = materialize(path, cache_root)
    header = read_header(mmproj)
    projector.check(header)
    from transformers import AutoTokenizer
    image_token = AutoTokenizer.from_pretrained(str(text)).convert_tokens_to_ids("<image>")
    if not isinstance(image_token, int) or image_token < 0:
        raise ValueError(f"{path.name}: its tokenizer has no <image> token for the "
                         f"projector's images")
    cfg = projector.vision_config(header, json.loads((text / "config.json").read_text()),
                                  image_token)

    def write(tmp: Path) -> None:
        for f in text.iterdir():
            if f.name not in (SIDECAR_FILE, "config.json"):
                shutil.copy(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "processor_config.json").write_text(
            json.dumps(projector.processor_config(header), indent=2) + "\n")
        info = json.loads((text / SIDECAR_FILE).read_text())
        (tmp / SIDECAR_FILE).write_text(json.dumps({
            **info, "mmproj_file": str(mmproj), "mmproj_key": gguf_file_key(mmproj)},
            indent=2) + "\n")
    return _install_sidecar(final, write)


def _save_tokenizer(path: Path, out: Path, config) -> None:
    """transformers' tokenizer for the GGUF (AutoTokenizer with gguf_file=), saved into out,
    less any token it added past the model's vocabulary. The chat template goes into
    tokenizer_config.json too (transformers 5 saves it as chat_template.jinja)."""
    import transformers
    from transformers import AutoTokenizer

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()      # "some keys were not parsed" noise
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError as exc:
            if "is not supported yet" not in str(exc):
                raise
            # An architecture transformers cannot load from GGUF (SmolLM3): its tokenizer
            # alone, by the file's tokenizer type, as AutoTokenizer would have built it.
            from transformers import PreTrainedTokenizerFast
            tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent),
                                                          gguf_file=path.name)
    except Exception as exc:            # transformers raises many types; say which file
        raise ValueError(f"{path.name}: transformers cannot build its tokenizer: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                         ) from exc
    finally:
        transformers.logging.set_verbosity(verbosity)
    tok.save_pretrained(str(out))
    # transformers' byte-level GGUF tokenizer adds GPT-2's "<|endoftext|>" when the vocabulary
    # lacks it, at an id past the model's embedding (ids the model cannot take): drop them.
    tj_path, tc_path = out / "tokenizer.json", out / "tokenizer_config.json"
    tj, tc = json.loads(tj_path.read_text()), json.loads(tc_path.read_text())
    dropped = {t["content"] for t in tj.get("added_tokens", []) if t["id"] >= config.vocab_size}
    if dropped:
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] not in dropped]
        tj_path.write_text(json.dumps(tj, indent=2, ensure_ascii=False) + "\n")
        for key, value in list(tc.items()):
            if isinstance(value, str) and value in dropped:
                tc[key] = None
            elif isinstance(value, list):
                tc[key] = [v for v in value if v not in dropped]
    if tok.chat_template and "chat_template" not in tc:     # where older readers look
        tc["chat_template"] = tok.chat_template
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    n = len(AutoTokenizer.from_pretrained(str(out)))
    if n > config.vocab_size:
        raise ValueError(f"{path.name}: its tokenizer has {n} tokens, more than the model's "
                         f"vocabulary of {config.vocab_size}")
