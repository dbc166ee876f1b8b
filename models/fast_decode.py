"""FastDecode: a step of decode rows through every decoder layer in one C call
(kernels/decode.c), where the model's layers all run on zserve's CPU kernels.

At batch 1 the kernels of a 30-layer model take ~5 ms a token here, and the Python around
them (some 300 calls a token, each with its tensor allocations and ctypes argument
conversions) took as long again. decode.c calls the same kernels in the same order on the
same kind of buffers, so the hidden state is bit for bit the module path's
(tests/test_fast_decode.py); the model's own forward stays the reference and the path
for everything else.

It applies (`FastDecode.of` says None otherwise): float32 or bfloat16 on the CPU, one
rank, no per-head q/k norm (Qwen3), RoPE in every layer (not SmolLM3) and on whole heads
(not Phi-3's partial rotary: decode.c rotates every dim of a head by one table), Llama's
layer (not Gemma's), dense MLPs only (not a mixture of experts, Qwen3-MoE or Mixtral:
moe.py runs those in torch, so they decode layer by layer), every linear layer a CpuLinear
of the model's dtype (or, float32 only, a QuantLinear), and the norm / RoPE / SiLU /
decode-attention kernels available for the dtype; per step, when every row is a decode row
on the attention kernel and no row is longer than a sliding window (`takes`). The embedding
and the logits stay torch. Every rope type is just another table (rope.py folds YaRN's and
LongRoPE's attention factor into it), and decode.c reads the model's own `cos_sin`, so
those run here too.
"""

from __future__ import annotations

import ctypes

import torch

from models import kernels

from .cpu_linear import CpuLinear
from .quant_linear import QuantLinear

_i64, _p, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("weight", _p), ("bias", _p), ("lora", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("kv", _p), ("kv_scales", _p)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("inter", _i64), ("eps", _f), ("scale", _f),
                ("avx512", _i64), ("bf16", _i64), ("kv_kind", _i64), ("cos_sin", _p),
                ("layer", ctypes.POINTER(_Layer)), ("lora_runs", _p), ("lora_nruns", _i64)]


def _linear(module, dtype: torch.dtype) -> _Linear | None:
    """decode.c's description of a linear layer of a `dtype` model, or None if it cannot run
    there."""
    if isinstance(module, QuantLinear):
        bias = module.bias
        if dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
            return None
        return _Linear(1, module.c_blocks(), None if bias is None else bias.data_ptr(), None)
    if isinstance(module, CpuLinear) and module.dtype == dtype:
        return _Linear(-1 if module.avx512 else 0, module.weight.data_ptr(),
                       None if module.bias is None else module.bias.data_ptr(), None)
    return None


class FastDecode:
    def __init__(self, model, c_model: _Model, layers, keep: list):
        self.model = model
        self.c = c_model
        self._c_addr = ctypes.addressof(c_model)
        self.layers = layers                # the ctypes array c_model points into
        self._keep = keep                   # what the structs hold pointers into
        self._run = kernels.library().zs_decode_layers

    @classmethod
    def of(cls, model) -> "FastDecode | None":
        """For a loaded CausalLM; None where the fast path does not apply (module doc)."""
        from .ops import _kernels_for, decode_kernel_fits

        c = model.config
        dtype = model.norm.weight.dtype          # the model's (the embedding may be blocks)
        device = model.norm.weight.device
        if (model.tp is not None or dtype not in (torch.float32, torch.bfloat16)
                or device.type != "cpu"
                or c.qk_norm or c.rope_layers is not None     # decode.c rotates every layer
                or c.gemma                                    # and runs Llama's layer
                or model.cos_sin.shape[-1] != c.head_dim       # ... and every dim of a head
                or c.moe_layers is not None                   # decode.c runs dense MLPs
                or c.hidden_size < 8 or _kernels_for("cpu", dtype) is None
                or not decode_kernel_fits(device, dtype, c.num_heads, c.num_kv_heads,
                                          c.head_dim)):
            return None
        avx512 = kernels.available("cpu", dtype)
        layers = (_Layer * c.num_layers)()
        keep = []
        for i, layer in enumerate(model.layers):
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)
            parts = [_linear(m, dtype) for m in linears]
            if any(p is None for p in parts):
                return None
            keep.extend(linears)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
                return None
            keep.extend(norms)
            layers[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), *parts, None, None)
        cos_sin = model.cos_sin
        if cos_sin.dtype != dtype or not cos_sin.is_contiguous():
            return None
        keep.append(cos_sin)
        c_model = _Model(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                         c.intermediate_size, c.rms_norm_eps, c.head_dim ** -0.5, int(avx512),
                         int(dtype == torch.bfloat16), 0, cos_sin.data_ptr(), layers)
        return cls(model, c_model, layers, keep)

    @staticmethod
    def takes(attn, positions: torch.Tensor) -> bool:
        """Is this step (its positions, attention `attn`) all decode rows on the kernels,
        with the int64 contiguous index tensors decode.c reads?"""
        n = positions.shape[0]
        return bool(getattr(attn, "kernel", False) and not attn.prefills
                    and not attn.windowed
                    and attn.cache.kind is not None
                    and attn.num_decode == n and n > 0
                    and all(t.dtype == torch.int64 and t.is_contiguous()
                            for t in (positions, attn.table, attn.out_slots,
                                      attn.decode.rows, attn.decode.lens)))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """CausalLM.forward for such a step: [N] ids and positions -> [N, hidden]."""
        cache = attn.cache
        for i, kv in enumerate(cache.kv):               # every step: cheap, never stale
            self.layers[i].kv = kv.data_ptr()
            self.layers[i].kv_scales = (None if cache.scales is None
                                        else cache.scales[i].data_ptr())
        c = self.c
        c.kv_kind = cache.kind
        lora = self.model.lora                          # this step's adapter runs, if any
        c.lora_runs, c.lora_nruns = ((lora.c_runs.data_ptr(), len(lora.runs))
                                     if lora is not None and lora.runs else (None, 0))
        x = self.model.embed_tokens(input_ids)
        m = x.shape[0]
        qw = (c.heads + 2 * c.kv_heads) * c.head_dim
        scratch = torch.empty(m * (2 * c.hidden + qw + c.heads * c.head_dim + 3 * c.inter),
                              dtype=x.dtype)
        r, y, qkv, att, gu, act = torch.split(
            scratch, [m * c.hidden, m * c.hidden, m * qw, m * c.heads * c.head_dim,
                      m * 2 * c.inter, m * c.inter])
        decode = attn.decode
        if self._run(self._c_addr, m, x.data_ptr(), r.data_ptr(), positions.data_ptr(),
                     attn.table.data_ptr(), attn.table.shape[1], decode.rows.data_ptr(),
                     decode.lens.data_ptr(), attn.out_slots.data_ptr(), y.data_ptr(),
                     qkv.data_ptr(), att.data_ptr(), gu.data_ptr(), act.data_ptr()):
            raise MemoryError("decode step: no memory for the int8 copy of the activations")
        return x
