"""What `--model-path` names, found out in the launcher before any process loads anything.

`resolve_model_path(arg)` returns a local path (a Hugging Face directory, a .gguf file, or
a directory holding exactly one .gguf) or raises StartupError with one line that says what
is wrong and what to pass instead. It reads only file names and config.json: no torch, so
every mistake is reported within a second, before a model is loaded.

A value that is not an existing path but looks like `Org/Name` is a Hugging Face hub id,
resolved through huggingface_hub: its local cache first, then a download where the network
allows one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

# Hugging Face architecture names zserve implements (models/config.py maps
# each to its family).
TEXT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Phi3ForCausalLM",
                      "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
                      "MixtralForCausalLM")


@dataclass(frozen=True, slots=True)
class VisionFamily:
    """A vision-language architecture: the text decoder it wraps (the checkpoint's
    `text_config` holds its config; this architecture where text_config names none) and
    the config keys that may hold its image token (the placeholder a prompt names an image
    by), the first one present."""

    decoder: str
    image_token_keys: tuple[str, ...] = ("image_token_id", "image_token_index")

    def image_token_id(self, config: dict) -> int:
        key = next((k for k in self.image_token_keys if config.get(k) is not None), None)
        if key is None:
            raise KeyError(" or ".join(self.image_token_keys))
        return int(config[key])


# Vision-language models: a vision encoder (models/vision/) in front of a text decoder.
VISION_ARCHITECTURES = {
    "Sarashina2VisionForCausalLM": VisionFamily("LlamaForCausalLM", ("image_token_index",)),
    "LlavaForConditionalGeneration": VisionFamily("LlamaForCausalLM"),
    "Idefics3ForConditionalGeneration": VisionFamily("LlamaForCausalLM"),
    "SmolVLMForConditionalGeneration": VisionFamily("LlamaForCausalLM"),
    "Qwen2VLForConditionalGeneration": VisionFamily("Qwen2ForCausalLM"),
}
# A text_config is saved as its difference from the decoder config class's defaults
# (Sarashina2-Vision-8B's names only its vocabulary, context and norm eps): transformers'
# LlamaConfig defaults fill in the rest.
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "hidden_act": "silu", "tie_word_embeddings": False}
SUPPORTED_ARCHITECTURES = TEXT_ARCHITECTURES + tuple(VISION_ARCHITECTURES)


def vision_architecture(config: dict) -> str | None:
    """The config's vision-language architecture, or None for a text model."""
    return next((a for a in config.get("architectures") or [] if a in VISION_ARCHITECTURES),
                None)


def decoder_config(config: dict) -> dict:
    """The text decoder's config.json: the config itself for a text model; a vision
    model's text_config, with its architecture and the top-level keys it leaves out
    (dtype, token ids) filled in, and the top level's tie_word_embeddings over its own
    (SmolVLM-256M's text_config says tied, the model is not: transformers reads the top)."""
    arch = vision_architecture(config)
    if arch is None:
        return config
    # Older saves (Qwen2-VL's on the hub) keep the decoder's keys at the top level.
    text = dict(config.get("text_config") or {k: v for k, v in config.items()
                                               if k not in ("vision_config", "architectures")})
    if not any(a in TEXT_ARCHITECTURES for a in text.get("architectures") or []):
        text["architectures"] = [VISION_ARCHITECTURES[arch].decoder]
    for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id"):
        if key in config and key not in text:
            text[key] = config[key]
    if "tie_word_embeddings" in config:     # the whole model's says (transformers ties the
        text["tie_word_embeddings"] = config["tie_word_embeddings"]     # head by it)
    if "LlamaForCausalLM" in text["architectures"]:
        text = {**_LLAMA_DEFAULTS, **text}
    return text
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class StartupError(Exception):
    """A mistake in how the server was started; the message is the whole story."""


def resolve_model_path(arg: str) -> str:
    path = Path(arg).expanduser()
    if not path.exists():
        if _HUB_ID.match(arg) and not arg.startswith((".", "~")):
            return check_local(_from_hub(arg))
        raise StartupError(f"--model-path {arg}: no such file or directory")
    return check_local(str(path))


def check_local(arg: str) -> str:
    path = Path(arg)
    if path.is_file():
        if path.suffix != ".gguf":
            raise StartupError(f"--model-path {arg}: a file must be a .gguf model; otherwise "
                               f"pass a Hugging Face model directory")
        return str(path)
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists():
        if len(ggufs) == 1:
            return str(ggufs[0])
        if ggufs:
            raise StartupError(f"--model-path {arg}: the directory holds {len(ggufs)} .gguf "
                               f"files; pass one of them: "
                               f"{', '.join(g.name for g in ggufs[:4])}")
        raise StartupError(f"--model-path {arg}: no config.json (or .gguf file) in this "
                           f"directory; pass a Hugging Face model directory or a .gguf file")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise StartupError(f"--model-path {arg}: config.json cannot be read: {e}") from None
    if (path / "zserve_gguf.json").exists():
        return str(path)                    # a GGUF sidecar: weights live in the .gguf
    archs = config.get("architectures") or [config.get("model_type")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise StartupError(f"--model-path {arg}: architecture {', '.join(map(str, archs))} "
                           f"is not supported; zserve serves "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if not any(path.glob("*.safetensors")):
        raise StartupError(f"--model-path {arg}: no *.safetensors weights in this directory")
    return str(path)


def _from_hub(repo_id: str) -> str:
    """The local snapshot of a hub model: cached, else downloaded (weights, config and
    tokenizer files only)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise StartupError(f"--model-path {repo_id}: not a local path, and huggingface_hub "
                           f"is not installed to resolve it as a hub id") from None
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns)
    except Exception:
        pass                                 # not cached (or not completely): download
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StartupError(
            f"--model-path {repo_id}: not a local path, not in the Hugging Face cache, and "
            f"it could not be downloaded ({reason}); pass a local model directory or a "
            f".gguf file") from None


RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS.txt"   # written by checkpoints/tiny.py


# ---- where things are cached (torch-free, so the launcher can look before it spawns) -------

SIDECAR_FILE = "zserve_gguf.json"       # in a GGUF sidecar directory: which GGUF it stands for
SIDECAR_VERSION = 1                     # bump when the sidecar's contents change


def zserve_cache() -> Path:
    """zserve's cache directory: $ZSERVE_CACHE, else ~/.cache/zserve."""
    env = os.environ.get("ZSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "zserve"


def gguf_file_key(path: Path) -> str:
    """A GGUF file's identity for its sidecar: resolved path, size and mtime."""
    st = path.stat()
    raw = f"{SIDECAR_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def gguf_sidecar_dir(gguf: Path, cache_root: Path | None = None,
                     mmproj: Path | None = None) -> Path:
    """Where the sidecar (config + tokenizer files) of GGUF file `gguf` lives once built by
    models/gguf.py's materialize; complete iff it holds SIDECAR_FILE. With a vision
    projector file (--mmproj), the pair's own sidecar."""
    gguf = gguf.resolve()
    root = (cache_root if cache_root is not None else zserve_cache() / "gguf")
    name = f"{gguf.stem}-{gguf_file_key(gguf)}"
    if mmproj is not None:
        mmproj = mmproj.resolve()
        name += f"+{mmproj.stem}-{gguf_file_key(mmproj)}"
    return root.expanduser().absolute() / name


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What every process needs to know of a model before any of them loads it (part of
    wire.server_args.ServerConfig)."""

    architecture: str
    max_position_embeddings: int
    vocab_size: int                 # rows of the embedding: the ids the model can take or emit
    num_params: int
    random_weights: bool            # one of our tiny test checkpoints
    num_attention_heads: int = 0    # what --tp-size may split (0: not known, not checked)
    image_token_id: int | None = None   # a vision-language model's (VISION_ARCHITECTURES)
                                        # image token; None: the model takes no images


def model_facts(path: str) -> ModelFacts:
    """From config.json (the same defaults as models/config.py). Raises
    StartupError when the config lacks what a Llama-family model must say."""
    full = json.loads((Path(path) / "config.json").read_text())
    vision = vision_architecture(full)
    config = decoder_config(full)
    arch = vision or next((a for a in config.get("architectures") or []
                           if a in SUPPORTED_ARCHITECTURES), str(config.get("architectures")))
    try:
        return ModelFacts(arch, int(config.get("max_position_embeddings", 2048)),
                          int(config["vocab_size"]), _num_params(config),
                          (Path(path) / RANDOM_WEIGHTS_MARKER).exists(),
                          int(config["num_attention_heads"]),
                          None if vision is None else
                          VISION_ARCHITECTURES[vision].image_token_id(full))
    except KeyError as e:
        raise StartupError(f"--model-path {path}: config.json has no {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise StartupError(f"--model-path {path}: config.json: {e}") from None


def _num_params(c: dict) -> int:
    """Parameters of a Llama-family decoder with this config (a vision model's encoder
    not counted)."""
    hidden, vocab, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = (c.get("num_key_value_heads") or heads) * head_dim
    q = heads * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 2 * hidden
    archs = c.get("architectures") or []
    if "Qwen3ForCausalLM" in archs or "Qwen3MoeForCausalLM" in archs:
        layer += 2 * head_dim                              # q_norm, k_norm
    # A mixture of experts: each sparse layer's experts (all of them, not only the active
    # ones) and router in place of the dense MLP.
    sparse = sum(sparse_layers(c))
    expert = 3 * hidden * expert_intermediate_size(c) + hidden if sparse else 0
    mlps = (c["num_hidden_layers"] - sparse) * 3 * hidden * inter + \
        sparse * num_experts(c) * expert
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return c["num_hidden_layers"] * layer + mlps + embeddings + hidden


# Mixtures of experts: what a config says of its experts, read once here for the launcher
# (_num_params) and the model (models/config.py), with transformers' defaults.

def num_experts(c: dict) -> int:
    """Experts per sparse layer. transformers 5 writes num_local_experts for Qwen3-MoE and
    Mixtral alike (num_experts is its alias; the Hub's Qwen3-MoE configs say num_experts)."""
    n = c.get("num_local_experts", c.get("num_experts"))
    if n is not None:
        return int(n)
    return {"Qwen3MoeForCausalLM": 128, "MixtralForCausalLM": 8}.get(_moe_arch(c), 0)


def expert_intermediate_size(c: dict) -> int:
    """Each expert's intermediate width (Mixtral's experts are its intermediate_size)."""
    if _moe_arch(c) == "MixtralForCausalLM":
        return int(c["intermediate_size"])
    return int(c.get("moe_intermediate_size", 768))


def sparse_layers(c: dict) -> list[int]:
    """1 for each layer whose MLP is the mixture of experts, 0 for a dense one: every
    layer of Mixtral; Qwen3-MoE's every decoder_sparse_step-th layer not in
    mlp_only_layers, if it has experts at all. All 0 for a dense model."""
    layers, arch = c["num_hidden_layers"], _moe_arch(c)
    if arch == "MixtralForCausalLM":
        return [1] * layers
    if arch != "Qwen3MoeForCausalLM" or num_experts(c) == 0:
        return [0] * layers
    dense, step = set(c.get("mlp_only_layers") or ()), c.get("decoder_sparse_step", 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _moe_arch(c: dict) -> str | None:
    return next((a for a in c.get("architectures") or []
                 if a in ("Qwen3MoeForCausalLM", "MixtralForCausalLM")), None)


def describe_source(arg: str | None, resolved: str) -> str:
    """How the user named the model, for the startup banner."""
    if arg is None:
        return "the built-in default model"
    if resolved.endswith(".gguf") or Path(resolved, "zserve_gguf.json").exists():
        return "GGUF file"
    if not Path(arg).expanduser().exists():
        return f"hub id {arg}"
    return "model directory"


def model_fingerprint(path: str) -> str:
    """A short digest of a resolved model directory that two machines holding the same
    checkpoint agree on: config.json's bytes and the name and size of each weight file
    (for a GGUF sidecar, of the GGUF it stands for). Two fine-tunes of one base differ in
    their weights' bytes, not always in these: a sanity check, not a proof."""
    root = Path(path)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    weights = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".gguf"))
    sidecar = root / SIDECAR_FILE
    if sidecar.is_file():
        weights.append(Path(json.loads(sidecar.read_text())["gguf_file"]))
    for w in weights:
        digest.update(f"\0{w.name}\0{w.stat().st_size}".encode())
    return digest.hexdigest()[:16]


# sentence-transformers' Pooling config keys, by the --pooling mode each one is; the other
# modes it knows (max, mean_sqrt_len, weightedmean) zserve does not compute.
ST_POOLING_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_cls_token": "cls"}
ST_POOLING_MODULE = "sentence_transformers.models.Pooling"


def sentence_transformers_pooling(model_dir: str) -> str | None:
    """The pooling a sentence-transformers model directory declares (modules.json names a
    Pooling module; its config.json, by default in 1_Pooling/, says which mode): "last",
    "mean" or "cls", or None where the directory has no such config. StartupError where it
    names a mode zserve does not compute, or more than one, or cannot be read: pass
    --pooling then."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        entry = next((m for m in modules if isinstance(m, dict)
                      and m.get("type") == ST_POOLING_MODULE), None)
        if entry is None:
            return None
        config_file = Path(model_dir) / str(entry.get("path") or "1_Pooling") / "config.json"
        config = json.loads(config_file.read_text())
    except (OSError, ValueError, TypeError) as e:
        raise StartupError(f"{modules_file}: the sentence-transformers pooling config cannot "
                           f"be read ({e}); pass --pooling last|mean|cls") from None
    if not isinstance(config, dict):
        raise StartupError(f"{config_file}: not a JSON object; pass --pooling last|mean|cls")
    if isinstance(config.get("pooling_mode"), str):     # newer sentence-transformers
        named = {"lasttoken": "last", "mean": "mean", "cls": "cls"}.get(config["pooling_mode"])
        modes = [named] if named else [config["pooling_mode"]]
    else:
        modes = [mode for key, mode in ST_POOLING_KEYS.items() if config.get(key) is True]
        modes += [k for k, v in config.items() if k.startswith("pooling_mode_")
                  and k not in ST_POOLING_KEYS and v is True]
    if len(modes) != 1 or modes[0] not in ST_POOLING_KEYS.values():
        raise StartupError(f"{config_file} asks for pooling {', '.join(modes) or 'none'}; "
                           f"zserve pools by one of last, mean or cls: pass --pooling")
    return modes[0]
