"""LoRA adapters over a loaded CausalLM: reading them (PEFT's directory format, llama.cpp's
LoRA GGUF), holding them in slots, and adding their low-rank products to the base layers'
outputs, grouped per adapter, for steps whose rows use different adapters (and none).

    lora = LoraSet(model, slots, dtype)     # wraps the targetable linears once (LoraLinear)
    rank = lora.load(slot, path)            # an adapter's weights into slot (replaces it)
    files = read_files(path); lora.load_files(slot, files, path)    # the same, in two
    lora.unload(slot)
    with lora.step(runs):                   # runs: [(slot, lo, hi)], rows lo..hi-1 use slot
        hidden = model(...)

What an adapter may target: per decoder layer the attention's q/k/v/o projections and the
MLP's gate/up/down (PEFT's names; Phi-3's fused qkv_proj and gate_up_proj as they are), any
rank and alpha, rsLoRA (alpha / sqrt(r)) where the config says, alpha_pattern / rank_pattern.
Refused with a message naming what: DoRA, biases, modules_to_save, adapters of the
embedding or the LM head, of a mixture of experts' experts, layers the model lacks, and
weights in PyTorch's pickle format (adapter_model.bin: nothing is unpickled).

The product, for a base layer y = W x of our fused layout (qkv_proj's output is q, then k,
then v): each targeted part p has A_p [r_p, in] and B_p [out_p, r_p] and adds
scale_p * B_p A_p x to its rows of y. We hold per (layer, module) A = the parts' A_p stacked
[R, in] and each part's B_p with scale_p folded in (ModuleWeights), so an adapter's share of
a fused layer is one shrink t = x A^T for all its parts, then per part
y[:, its columns] += t[:, its r_p columns] B_p^T (an untargeted part costs nothing).

Grouping: the scheduler orders a step's segments by adapter within its decode part and
within its prefill part (scheduler.py), so an adapter's rows are at most two contiguous
runs and the step is a short list of runs (runner.py: lora_runs). A LoraLinear adds each
run's product in place: two matmuls a run, no gather, no per-row loop. In float32 where
linear.c serves (kernels.linear_available) the whole list is one C call a layer
(`zs_lora_f32`: A and B in linear.c's panels, each slot's pointers in the layer's `table`):
torch's small matmuls cost ~13 us each in dispatch, which at 4 adapters and 32 rows of the
135M shape took 0.58x of the base model's throughput; elsewhere (bfloat16, CUDA) torch's
matmuls. A step with no runs costs one attribute test per layer. FastDecode (one C call
per decode step, decode.c) takes steps with runs where the kernel serves: decode.c calls
zs_lora_f32 after each linear kernel with the layer's table, as LoraLinear does, so the two
paths stay the same bit for bit; elsewhere it declines them (CausalLM.forward).

Tensor parallelism (models/tp.py): a column-parallel part (q, k, v, gate, up) keeps its B's
rows that the rank's base weight holds, A whole; a row-parallel one (o, down) keeps A's
columns of the rank's input, B whole, so each rank adds its partial product before the
all-reduce that joins the base layer's partial sums (sum_r B A_r x_r = B A x).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from models import kernels

from .cpu_linear import to_panels

# A checkpoint part (PEFT's target name; Phi-3's fused ones too) -> our module holding it
# (its parts' order there: _part_rows).
MODULES = {"q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj",
           "v_proj": "self_attn.qkv_proj", "qkv_proj": "self_attn.qkv_proj",
           "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up_proj",
           "up_proj": "mlp.gate_up_proj", "gate_up_proj": "mlp.gate_up_proj",
           "down_proj": "mlp.down_proj"}
ROW_PARALLEL = ("o_proj", "down_proj")
LORA_ENTRY = 3 + 5 * 3          # linear.c's zs_lora_f32 table: a slot's entry, int64s
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")
# llama.cpp's LoRA GGUF tensor names (convert_lora_to_gguf.py): blk.N.<ggml name>.weight.lora_a
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight\.lora_([ab])$")
GGUF_PARTS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
              "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
              "ffn_down": "down_proj", "attn_qkv": "qkv_proj"}
MAX_ADAPTER_BYTES = 4 << 30         # adapter files larger than this are refused


class AdapterError(ValueError):
    """An adapter that cannot be served here (the message says why, for the client)."""


@dataclass(frozen=True, slots=True)
class Part:
    """One targeted part of one layer: A [r, in], B [out, r], its scale (alpha / r)."""

    layer: int
    name: str                   # q_proj ... down_proj, or Phi-3's qkv_proj / gate_up_proj
    a: Tensor
    b: Tensor
    scale: float
    from_gguf: bool = False     # llama.cpp permuted a llama-family q/k B's rows (gguf.py)


# ---- reading ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """An adapter's files as read from disk: what every tensor-parallel rank parses (rank 0
    reads them once and sends them: runner.py), so all ranks hold the same weights."""

    kind: str                   # "peft" or "gguf"
    config: str                 # adapter_config.json's text ("" for a GGUF)
    data: bytes                 # adapter_model.safetensors, or the .gguf file


def read_files(path: str | Path) -> AdapterFiles:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) or a
    llama.cpp LoRA GGUF file, read; AdapterError if it is neither or too large."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        weights, kind, config = p, "gguf", ""
    elif p.is_dir():
        weights, kind = p / "adapter_model.safetensors", "peft"
        if not (p / "adapter_config.json").is_file():
            raise AdapterError(f"{path}: no adapter_config.json")
        if not weights.is_file():
            raise AdapterError(f"{path}: no adapter_model.safetensors (a .bin adapter is a "
                               f"pickle, which zserve does not load)")
    else:
        raise AdapterError(f"{path}: not a PEFT adapter directory or a .gguf LoRA file")
    try:
        if weights.stat().st_size > MAX_ADAPTER_BYTES:
            raise AdapterError(f"{path}: the adapter is larger than "
                               f"{MAX_ADAPTER_BYTES >> 30} GiB")
        if kind == "peft":
            config = (p / "adapter_config.json").read_text(errors="replace")[:1 << 20]
        return AdapterFiles(kind, config, weights.read_bytes())
    except OSError as e:
        raise AdapterError(f"{path}: cannot be read: {e}") from None


def read_adapter(path: str | Path) -> list[Part]:
    """The parts of the adapter at `path` (read_files, parse)."""
    return parse(read_files(path), str(path))


def parse(files: AdapterFiles, where: str) -> list[Part]:
    """The adapter's parts, float32 on the CPU; AdapterError (naming `where`) for anything
    it holds that we do not serve (module docstring), or that is not what it claims."""
    try:
        return _parse_gguf(files.data, where) if files.kind == "gguf" else \
            _parse_peft(files, where)
    except AdapterError:
        raise
    except Exception as e:      # noqa: BLE001 - a malformed file is the client's, not ours
        raise AdapterError(f"{where}: not a LoRA adapter zserve can read "
                           f"({type(e).__name__}: {e})") from None


def _parse_peft(files: AdapterFiles, where: str) -> list[Part]:
    try:
        config = json.loads(files.config)
    except ValueError as e:
        raise AdapterError(f"{where}: adapter_config.json is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: adapter_config.json is not a JSON object")
    _check_config(config, where)
    alpha = config.get("lora_alpha") or config.get("r") or 8
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha, (int, float)) or not isinstance(alpha_pattern, dict) or \
            not all(isinstance(v, (int, float)) for v in alpha_pattern.values()):
        raise AdapterError(f"{where}: lora_alpha and alpha_pattern's values must be numbers")
    rslora = bool(config.get("use_rslora"))
    from safetensors.torch import load as load_safetensors
    tensors: dict[tuple[int, str], dict[str, Tensor]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key, value in load_safetensors(files.data).items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"{where}: {key!r} is not a LoRA weight of an attention or "
                               f"MLP projection (embedding, LM head, expert and DoRA "
                               f"adapters are not supported)")
        layer, name, ab = int(m[1]), m[3], m[4]
        if name not in MODULES:
            raise AdapterError(f"{where}: {key!r} targets {name}, which zserve does not adapt")
        tensors.setdefault((layer, name), {})[ab] = value.float()
        # PEFT matches alpha_pattern's keys against the module's path in the base model
        paths[(layer, name)] = key.removeprefix("base_model.model.")[:-len(".lora_A.weight")]
    parts = []
    for (layer, name), ab in sorted(tensors.items()):
        parts.append(_part(layer, name, ab, where, lambda r, key=(layer, name): float(
            _pattern(alpha_pattern, paths[key], alpha)) / (math.sqrt(r) if rslora else r)))
    if not parts:
        raise AdapterError(f"{where}: the adapter holds no LoRA weights")
    return parts


def _part(layer: int, name: str, ab: dict[str, Tensor], where: str, scale,
          from_gguf: bool = False) -> Part:
    """One part from its lora_A [r, in] and lora_B [out, r]; scale(r) -> its scale."""
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{where}: layer {layer} {name} has lora_{''.join(ab)} only")
    a, b = ab["A"], ab["B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
        raise AdapterError(f"{where}: layer {layer} {name}: lora_A {tuple(a.shape)} and "
                           f"lora_B {tuple(b.shape)} are not a low-rank pair")
    return Part(layer, name, a, b, scale(a.shape[0]), from_gguf)


def _check_config(config: dict, path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r}: only LORA adapters "
                           f"are served")
    if config.get("use_dora"):
        raise AdapterError(f"{path}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: adapters that train biases (bias "
                           f"{config.get('bias')!r}) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save (whole trained modules) is not supported")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{path}: fan_in_fan_out (GPT-2's Conv1D layers) is not supported")


def _pattern(patterns: dict, name: str, default):
    """PEFT's alpha_pattern lookup: the first key that matches the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _parse_gguf(data: bytes, path: str) -> list[Part]:
    """llama.cpp's LoRA GGUF (general.type "adapter", adapter.type "lora"): lora_a [r, in] and
    lora_b [out, r] per tensor (shapes as torch reads them); scale adapter.lora.alpha / r
    (llama.cpp's, with --lora's scale 1). The gguf library reads files: `data` goes through
    a temporary one."""
    import tempfile
    from gguf import GGUFReader

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        return _gguf_parts(GGUFReader(f.name), path)


def _gguf_parts(reader, path: str) -> list[Part]:
    from gguf.quants import dequantize

    def field(name):
        f = reader.fields.get(name)
        return None if f is None else f.contents()
    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise AdapterError(f"{path}: not a LoRA adapter GGUF (general.type "
                           f"{field('general.type')!r}, adapter.type {field('adapter.type')!r})")
    alpha = field("adapter.lora.alpha")
    tensors: dict[tuple[int, str], dict[str, Tensor]] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m[2] not in GGUF_PARTS:
            raise AdapterError(f"{path}: {t.name!r} is not a LoRA weight of an attention or "
                               f"MLP projection")
        values = dequantize(t.data, t.tensor_type)
        shape = [int(d) for d in reversed(t.shape.tolist())]
        tensors.setdefault((int(m[1]), GGUF_PARTS[m[2]]), {})[m[3].upper()] = \
            torch.from_numpy(values.reshape(shape).copy()).float()
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise AdapterError(f"{path}: adapter.lora.alpha must be a number")
    parts = [_part(layer, name, ab, path, lambda r: (float(alpha) if alpha else r) / r,
                   from_gguf=True) for (layer, name), ab in sorted(tensors.items())]
    if not parts:
        raise AdapterError(f"{path}: the adapter holds no LoRA weights")
    return parts


# ---- serving ---------------------------------------------------------------------------------

class LoraLinear(nn.Module):
    """A base linear layer plus the low-rank products of the step's adapter runs. `base` keeps
    its own type (float, packed, or GGUF blocks) and its own kernel."""

    def __init__(self, base: nn.Module, key: tuple[int, str], lora: "LoraSet"):
        super().__init__()
        self.base = base
        self.key = key                  # (layer, our module name)
        self._lora = [lora]             # a list: not a submodule
        self.in_features, self.out_features = base.in_features, base.out_features

        # zs_lora_f32's table: per slot (linear.c: LORA_ENTRY); R = 0: not adapted.
        self.table = torch.zeros((len(lora.weights), LORA_ENTRY), dtype=torch.int64)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        lora = self._lora[0]
        if not lora.runs:
            return y
        if lora.kernel is not None:         # (its weights are panels: the kernel's only)
            x, y = x.contiguous(), y.contiguous()
            if lora.kernel(lora.avx512, x.data_ptr(), self.in_features, y.data_ptr(),
                           self.out_features, lora.c_runs.data_ptr(), len(lora.runs),
                           self.table.data_ptr()):
                raise MemoryError("zs_lora_f32 could not allocate its scratch")
            return y
        for slot, lo, hi in lora.runs:
            w = lora.weights[slot].get(self.key)
            if w is None:
                continue
            t = x[lo:hi] @ w.a.t()
            for r0, b, c0 in w.parts:
                y[lo:hi, c0:c0 + b.shape[0]].addmm_(t[:, r0:r0 + b.shape[1]], b.t())
        return y


@dataclass(slots=True)
class ModuleWeights:
    """One adapter's share of one of our layers: A [R, in] (its parts' A stacked), and per
    part of the layer's output it adapts (r0, B [n, r] with the scale folded in, c0): rows
    c0..c0+n-1 of the output get t[:, r0:r0+r] B^T, t = x A^T. In the kernel's panels where
    it serves (LoraSet.load_files)."""

    a: Tensor
    parts: list[tuple[int, Tensor, int]]
    rank: int


class LoraSet:
    """Adapter slots over one model (one rank's share under TP): `weights[slot]` maps
    (layer, module) -> its ModuleWeights, in the model's dtype on its device."""

    def __init__(self, model: nn.Module, slots: int, dtype: torch.dtype):
        """dtype: the model's (its linear layers' inputs and outputs)."""
        self.model = model
        self.shard = getattr(model, "shard", None)
        self.weights: list[dict[tuple[int, str], ModuleWeights]] = [
            {} for _ in range(slots)]
        self.runs: list[tuple[int, int, int]] = []
        self.c_runs = torch.zeros((0, 3), dtype=torch.int64)      # the runs, for the kernel
        self.dtype = dtype
        self.device = model.cos_sin.device
        self.kernel, self.avx512 = None, 0
        if self.dtype == torch.float32 and kernels.linear_available(self.device, self.dtype):
            self.kernel = kernels.library().zs_lora_f32
            self.avx512 = int(kernels.available(self.device, self.dtype))
        self.modules: dict[tuple[int, str], LoraLinear] = {}
        for i, layer in enumerate(model.layers):
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                         "mlp.down_proj"):
                parent_name, _, leaf = name.rpartition(".")
                parent = layer.get_submodule(parent_name)
                base = getattr(parent, leaf, None)
                if base is None:                # a mixture of experts' layer has no MLP
                    continue
                wrapped = LoraLinear(base, (i, name), self)
                setattr(parent, leaf, wrapped)
                self.modules[(i, name)] = wrapped
        model.lora = self
        if model.fast is not None and self.kernel is not None:
            # FastDecode's one-call decode step adds the same products (decode.c calls
            # zs_lora_f32 after each linear kernel with the layer's table)
            for i, c_layer in enumerate(model.fast.layers):
                for field, name in (("qkv", "self_attn.qkv_proj"), ("o", "self_attn.o_proj"),
                                    ("gate_up", "mlp.gate_up_proj"), ("down", "mlp.down_proj")):
                    getattr(c_layer, field).lora = self.modules[(i, name)].table.data_ptr()

    @contextlib.contextmanager
    def step(self, runs: list[tuple[int, int, int]]):
        self.runs = runs
        if self.kernel is not None and runs:
            self.c_runs = torch.tensor(runs, dtype=torch.int64)
        try:
            yield
        finally:
            self.runs = []

    def load(self, slot: int, path: str | Path, max_rank: int | None = None) -> int:
        """Read the adapter at `path` into `slot` (load_files)."""
        return self.load_files(slot, read_files(path), str(path), max_rank)

    def load_files(self, slot: int, files: AdapterFiles, where: str,
                   max_rank: int | None = None) -> int:
        """An adapter's files into `slot`; returns its largest rank. AdapterError (naming
        `where`) if it does not fit this model, or its rank is above max_rank: then the
        slot is left empty."""
        parts = parse(files, where)
        rank = max(p.a.shape[0] for p in parts)
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
        self.unload(slot)
        try:
            self._place(slot, self.build(parts, where))
        except BaseException:
            self.unload(slot)                       # a slot is whole or empty
            raise
        return rank

    def _place(self, slot: int, weights: dict) -> None:
        self.weights[slot] = weights
        if self.kernel is not None:                 # the kernel's panels, in place of A, B
            for key, w in self.weights[slot].items():
                a = to_panels(w.a)
                parts = [(r0, b.shape[1], to_panels(b), c0, b.shape[0]) for r0, b, c0 in w.parts]
                entry = [a.data_ptr(), w.rank, len(parts)]
                for r0, r, b, c0, n in parts:
                    entry += [r0, r, b.data_ptr(), c0, n]
                self.modules[key].table[slot] = torch.tensor(
                    entry + [0] * (LORA_ENTRY - len(entry)))
                self.weights[slot][key] = ModuleWeights(a, [(r0, b, c0) for r0, _, b, c0, _
                                                            in parts], w.rank)

    def unload(self, slot: int) -> None:
        for module in self.modules.values():
            module.table[slot] = 0
        self.weights[slot] = {}

    def build(self, parts: list[Part], where: str) -> dict:
        """parts -> weights per (layer, module), this rank's share (module docstring)."""
        config = self.model.config if self.shard is None else self.shard.full
        by_module: dict[tuple[int, str], list[Part]] = {}
        for p in parts:
            module = MODULES[p.name]
            if (p.layer, module) not in self.modules:
                raise AdapterError(f"{where}: layer {p.layer} {p.name} is not in this model "
                                   f"({config.num_layers} layers"
                                   f"{', experts are not adapted' if module.startswith('mlp') else ''})")
            by_module.setdefault((p.layer, module), []).append(p)
        out = {}
        for key, group in by_module.items():
            out[key] = self._fuse(key, group, config, where)
        return out

    def _fuse(self, key, group: list[Part], config, where: str) -> ModuleWeights:
        """One module's weights: its parts' A stacked, each part's B (scale folded in) for
        the rows of the layer's output this rank holds (module docstring)."""
        layer, module = key
        base = self.modules[key]
        full_parts = _part_rows(module, config)             # [(part name, full rows)]
        names = [n for n, _ in full_parts]
        given = [p.name for p in group]
        if len(set(given)) != len(given) or (len(given) > 1 and not set(given) <= set(names)):
            raise AdapterError(f"{where}: layer {layer} {module}: parts {sorted(given)} overlap "
                               f"(a fused projection and its parts)")
        local = [self._local_rows(n, rows) for n, rows in full_parts]
        a_blocks, parts, r0 = [], [], 0
        for p in group:
            a, b = p.a, p.b * p.scale
            r = a.shape[0]
            if p.from_gguf and p.name in ("q_proj", "k_proj"):
                from .gguf import _permuted_heads, _unpermute_rows
                heads = _permuted_heads(config).get(f"blk.{layer}.attn_{p.name[0]}.weight")
                if heads is not None and b.shape[0] == heads * config.head_dim:
                    b = _unpermute_rows(b, heads, config.head_dim)
            full_in = config.hidden_size if p.name not in ROW_PARALLEL else (
                config.num_heads * config.head_dim if p.name == "o_proj"
                else config.intermediate_size)
            fused = p.name not in names                      # Phi-3's qkv_proj / gate_up_proj
            rows = sum(n for _, n in full_parts) if fused else full_parts[names.index(p.name)][1]
            if tuple(a.shape) != (r, full_in) or tuple(b.shape) != (rows, r):
                raise AdapterError(f"{where}: layer {layer} {p.name}: lora_A {tuple(a.shape)} "
                                   f"and lora_B {tuple(b.shape)} do not fit the model's "
                                   f"{full_in} -> {rows}")
            c0 = 0 if fused else sum(local[:names.index(p.name)])
            if self.shard is not None:
                if p.name in ROW_PARALLEL:                  # this rank's input columns
                    a = self.shard.select(p.name, "weight").take(a)
                elif fused:
                    b = self.shard.select_fused(tuple(names), "weight").take(b)
                else:                                       # this rank's output rows
                    b = self.shard.select(p.name, "weight").take(b)
            a_blocks.append(a)
            parts.append((r0, b.to(device=self.device, dtype=self.dtype).contiguous(), c0))
            r0 += r
        a_all = torch.cat(a_blocks)
        if a_all.shape[1] != base.in_features or \
                any(c0 + b.shape[0] > base.out_features for _, b, c0 in parts):
            raise AdapterError(f"{where}: layer {layer} {module}: the adapter's shapes do not "
                               f"fit this rank's layer")
        return ModuleWeights(a_all.to(device=self.device, dtype=self.dtype).contiguous(),
                             parts, r0)

    def _local_rows(self, name: str, rows: int) -> int:
        """How many of a column-parallel part's `rows` output rows this rank holds (only
        fused layers' offsets ask)."""
        if self.shard is None:
            return rows
        sel = self.shard.select(name, "weight")
        return len(range(*sel.index.indices(sel.full))) if isinstance(sel.index, slice) \
            else len(sel.index)


def _part_rows(module: str, config) -> list[tuple[str, int]]:
    """The parts of one of our modules in output order, with their full row counts."""
    if module == "self_attn.qkv_proj":
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
    if module == "mlp.gate_up_proj":
        return [("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)]
    if module == "self_attn.o_proj":
        return [("o_proj", config.hidden_size)]
    return [("down_proj", config.hidden_size)]
