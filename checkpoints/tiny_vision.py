"""Tiny vision-language checkpoints, as tiny.py makes text ones: seeded random weights
scaled for clear greedy margins, the tiny tokenizer with the family's image tokens, the
family's image processor config, written as the family's Hugging Face directory.

- "sarashina2_vision": Sarashina2-Vision's layout (SGLang's sarashina2_vision.py):
  `visual.*` (transformers' Qwen2-VL vision transformer, merger included), `norm.*` (a
  LayerNorm over the decoder's width), `llm.*` (a Llama causal LM); config.json with
  text_config, vision_config and the image token ids; Qwen2-VL's preprocessor_config.json.
  The prompt names an image as <|prefix|><|file|><|suffix|> (the chat template writes that
  for each image part); <|file|> is the placeholder the server expands.

- "llava": transformers' own LlavaForConditionalGeneration (a CLIP tower, the projector, a
  Llama decoder) and LlavaProcessor, saved by them; <image> is the placeholder.

`reference(out_dir)` is the tests' oracle: transformers' LlavaForConditionalGeneration for
LLaVA; for Sarashina2-Vision (no transformers class) transformers' own composition of the
same weights: Qwen2VisionTransformerPretrainedModel, nn.LayerNorm, LlamaForCausalLM.
"""

from __future__ import annotations

import json
import math
import pathlib

from checkpoints import tiny
from wire.model_path import RANDOM_WEIGHTS_MARKER

VISION_FAMILIES = ("sarashina2_vision", "llava", "smolvlm", "qwen2_vl")
IMAGE, IMAGE_START, IMAGE_END = "<|file|>", "<|prefix|>", "<|suffix|>"
LLAVA_IMAGE = "<image>"

# Sarashina2-Vision's prompt shape: "### Human: ... ### Assistant:", each image part as
# <|prefix|><|file|><|suffix|> where it stands in the message.
SARASHINA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '### Human: ' }}"
    "{% elif message['role'] == 'assistant' %}{{ '### Assistant: ' }}"
    "{% else %}{{ '### System: ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|prefix|><|file|><|suffix|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:' }}{% endif %}"
)

# LLaVA-1.5's prompt shape, each image part as <image> where it stands in the message.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' }}{% else %}{{ 'ASSISTANT: ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# SmolVLM's prompt shape, each image part as <image> where it stands in the message.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                  *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))
# A 2-layer SigLIP tower of width 32 on 32 x 32 tiles of 8-pixel patches, shuffled 2 x 2:
# 4 image tokens a tile; images resized to a longest edge of 128, so up to 4 x 4 tiles.
SIGLIP_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, image_size=32, patch_size=8)
SMOLVLM_SIZES = dict(size={"longest_edge": 128}, max_image_size={"longest_edge": 32})
# Qwen2-VL's ChatML, each image part as <|vision_start|><|image_pad|><|vision_end|>.
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A 2-layer CLIP tower of width 32 on 56 x 56 crops of 14-pixel patches: 16 image tokens.
CLIP_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, image_size=56, patch_size=14, projection_dim=16,
                   hidden_act="quick_gelu")

# Small enough for a test, big enough to be a real Qwen2-VL tower: 2 blocks of width 32,
# 14-pixel patches merged 2 x 2; images resized to 1 to 16 merged tokens (28 x 28 pixels
# per token).
VISION_CONFIG = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                     hidden_act="quick_gelu")
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 16


def _init_vision(module, prefix: str, seed: int) -> None:
    """tiny.py's rules for the encoder's parameters: matrices (and the patch convolution)
    LINEAR_GAIN / sqrt(fan_in) in std, norm weights 1 + noise, biases BIAS_SCALE * u."""
    import torch

    sqrt3 = math.sqrt(3.0)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            u = tiny._uniform(param.shape, tiny._stable_seed(seed, "vision", prefix + name))
            if param.dim() >= 2:
                fan_in = param[0].numel()
                value = tiny.LINEAR_GAIN * sqrt3 / math.sqrt(fan_in) * u
            elif name.endswith(".bias") or name == "bias":
                value = tiny.BIAS_SCALE * u
            else:
                value = 1.0 + tiny.NORM_NOISE * u
            param.copy_(value)


def build_sarashina2_vision(out_dir, family: str = "sarashina2_vision",
                            seed: int = 0) -> pathlib.Path:
    import torch
    from safetensors.torch import save_file
    from transformers import (AutoTokenizer, LlamaForCausalLM, Qwen2VLImageProcessorPil,
                              Qwen2VLVisionConfig)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import \
        Qwen2VisionTransformerPretrainedModel

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny.build_tokenizer(out, (IMAGE, IMAGE_START, IMAGE_END), SARASHINA_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t)
           for t in (*tiny.SPECIAL_TOKENS, IMAGE, IMAGE_START, IMAGE_END)}
    text = tiny._config("llama", len(tok), ids, {})
    llm = LlamaForCausalLM(text)
    tiny._init_weights(llm, "llama", seed)
    vision = Qwen2VLVisionConfig(**VISION_CONFIG, hidden_size=text.hidden_size)
    visual = Qwen2VisionTransformerPretrainedModel._from_config(vision, dtype=torch.float32)
    norm = torch.nn.LayerNorm(text.hidden_size)
    _init_vision(visual, "visual.", seed)
    _init_vision(norm, "norm.", seed)
    state = {**{f"visual.{k}": v for k, v in visual.state_dict().items()},
             **{f"norm.{k}": v for k, v in norm.state_dict().items()},
             **{f"llm.{k}": v for k, v in llm.state_dict().items()}}
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = {"architectures": ["Sarashina2VisionForCausalLM"],
              "model_type": "sarashina2_vision",
              "image_token_index": ids[IMAGE], "start_image_token_index": ids[IMAGE_START],
              "end_image_token_index": ids[IMAGE_END],
              "text_config": text.to_dict(), "vision_config": vision.to_dict(),
              "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[tiny.BOS], "eos_token_id": [ids[tiny.EOS]],
         "pad_token_id": ids[tiny.PAD]}, indent=2))
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(
        str(out))
    (out / RANDOM_WEIGHTS_MARKER).write_text(
        "zserve's tiny test checkpoint: seeded random weights, its text is gibberish.\n")
    return out


def _save_with_decoder(model, text_model, llm, eos: int, out: pathlib.Path) -> None:
    """Put tiny.py's initialized Llama (`llm`) in a transformers vision model as its text
    model and head, and save the model with transformers (its own names and config)."""
    text_model.load_state_dict({k.removeprefix("model."): v for k, v in llm.state_dict().items()
                                if k.startswith("model.")})
    model.lm_head.load_state_dict(llm.lm_head.state_dict())
    model.generation_config.eos_token_id = [eos]
    model.save_pretrained(str(out), safe_serialization=True)


def build_llava(out_dir, family: str = "llava", seed: int = 0) -> pathlib.Path:
    """transformers' own LlavaForConditionalGeneration and LlavaProcessor, saved by them."""
    import torch
    from transformers import (AutoTokenizer, CLIPImageProcessorPil, CLIPVisionConfig,
                              LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny.build_tokenizer(out, (LLAVA_IMAGE,), LLAVA_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*tiny.SPECIAL_TOKENS, LLAVA_IMAGE)}
    text = tiny._config("llama", len(tok), ids, {})
    llm = LlamaForCausalLM(text)
    tiny._init_weights(llm, "llama", seed)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**CLIP_CONFIG), text_config=text,
                         image_token_id=ids[LLAVA_IMAGE], image_seq_length=16)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _init_vision(model.model.vision_tower, "vision_tower.", seed)
    _init_vision(model.model.multi_modal_projector, "multi_modal_projector.", seed)
    _save_with_decoder(model, model.model.language_model, llm, ids[tiny.EOS], out)
    images = CLIPImageProcessorPil(size={"shortest_edge": 56},
                                   crop_size={"height": 56, "width": 56})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=LLAVA_CHAT_TEMPLATE).save_pretrained(str(out))
    (out / RANDOM_WEIGHTS_MARKER).write_text(
        "zserve's tiny test checkpoint: seeded random weights, its text is gibberish.\n")
    return out


def build_smolvlm(out_dir, family: str = "smolvlm", seed: int = 0) -> pathlib.Path:
    """transformers' own SmolVLMForConditionalGeneration, saved by it, with its image
    processor's config and the processor's image_seq_len (processor_config.json, as
    SmolVLMProcessor writes it: constructing that one needs num2words and torchvision)."""
    import torch
    from transformers import (AutoTokenizer, LlamaForCausalLM, SmolVLMConfig,
                              SmolVLMForConditionalGeneration)
    from transformers.models.smolvlm.image_processing_pil_smolvlm import \
        SmolVLMImageProcessorPil

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny.build_tokenizer(out, SMOLVLM_TOKENS, SMOLVLM_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*tiny.SPECIAL_TOKENS, "<image>")}
    text = tiny._config("llama", len(tok), ids, {})
    llm = LlamaForCausalLM(text)
    tiny._init_weights(llm, "llama", seed)
    config = SmolVLMConfig(vision_config=SIGLIP_CONFIG, text_config=text.to_dict(),
                           scale_factor=2, image_token_id=ids["<image>"])
    model = SmolVLMForConditionalGeneration(config).to(torch.float32).eval()
    _init_vision(model.model.vision_model, "vision_model.", seed)
    _init_vision(model.model.connector, "connector.", seed)
    _save_with_decoder(model, model.model.text_model, llm, ids[tiny.EOS], out)
    images = SmolVLMImageProcessorPil(**SMOLVLM_SIZES)
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "SmolVLMProcessor", "image_seq_len": model.model.image_seq_len,
         "image_processor": images.to_dict()}, indent=2, sort_keys=True))
    (out / RANDOM_WEIGHTS_MARKER).write_text(
        "zserve's tiny test checkpoint: seeded random weights, its text is gibberish.\n")
    return out


def build_qwen2_vl(out_dir, family: str = "qwen2_vl", seed: int = 0) -> pathlib.Path:
    """transformers' own Qwen2VLForConditionalGeneration (a Qwen2 decoder with multimodal
    RoPE: head_dim 16, sections [2, 3, 3] of its 8 frequencies), saved by it, with Qwen2-VL's
    image processor (the Sarashina2 tower's settings)."""
    import torch
    from transformers import (AutoTokenizer, Qwen2ForCausalLM, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil)

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny.build_tokenizer(out, QWEN2_VL_TOKENS, QWEN2_VL_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*tiny.SPECIAL_TOKENS, *QWEN2_VL_TOKENS)}
    text = tiny._config("qwen2", len(tok), ids, {})
    llm = Qwen2ForCausalLM(text)
    tiny._init_weights(llm, "qwen2", seed)
    text_cfg = {**text.to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": text.rope_parameters["rope_theta"],
        "mrope_section": [2, 3, 3]}}
    config = Qwen2VLConfig(text_config=text_cfg, vision_config={**VISION_CONFIG,
                                                                "hidden_size": text.hidden_size},
                           image_token_id=ids["<|image_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    _init_vision(model.model.visual, "visual.", seed)
    _save_with_decoder(model, model.model.language_model, llm, ids[tiny.EOS], out)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(
        str(out))
    (out / RANDOM_WEIGHTS_MARKER).write_text(
        "zserve's tiny test checkpoint: seeded random weights, its text is gibberish.\n")
    return out


BUILDERS = {"sarashina2_vision": build_sarashina2_vision, "llava": build_llava,
            "smolvlm": build_smolvlm, "qwen2_vl": build_qwen2_vl}


def reference(out_dir):
    """The oracle for a tiny vision checkpoint: transformers' model of its family."""
    arch = json.loads((pathlib.Path(out_dir) / "config.json").read_text())["architectures"][0]
    return {"LlavaForConditionalGeneration": LlavaReference,
            "SmolVLMForConditionalGeneration": SmolVLMReference,
            "Qwen2VLForConditionalGeneration": Qwen2VLReference}.get(arch, Reference)(out_dir)


class Qwen2VLReference:
    """transformers' Qwen2VLForConditionalGeneration with its image processor; the
    placeholder expanded as Qwen2VLProcessor does (one <|image_pad|> per merged patch;
    that processor itself needs torchvision), mm_token_type_ids marking the image tokens
    (what its multimodal RoPE reads)."""

    def __init__(self, out_dir):
        from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(
            str(out_dir), attn_implementation="eager").eval()
        self.processor = AutoImageProcessor.from_pretrained(str(out_dir))
        self.image_token = self.model.config.image_token_id

    def _pixels(self, images):
        return self.processor(images=list(images), return_tensors="pt")

    def expand(self, ids: list[int], images) -> list[int]:
        if not images:
            return list(ids)
        counts = iter((self._pixels(images)["image_grid_thw"].prod(-1) // 4).tolist())
        return [x for t in ids for x in ([t] * next(counts) if t == self.image_token else [t])]

    def generate(self, ids: list[int], images, max_new_tokens: int
                 ) -> tuple[list[int], list[float]]:
        import torch
        full = torch.tensor([self.expand(ids, images)])
        kw = {}
        if images:
            p = self._pixels(images)
            kw = {"pixel_values": p["pixel_values"], "image_grid_thw": p["image_grid_thw"],
                  "mm_token_type_ids": (full == self.image_token).int()}
        self.model.model.rope_deltas = None         # left over from another prompt
        with torch.no_grad():
            out = self.model(input_ids=full, use_cache=True, **kw)
            return greedy_loop(self.model, out, max_new_tokens)


class SmolVLMReference:
    """transformers' SmolVLMForConditionalGeneration, with Idefics3Processor's expansion
    (the same text as SmolVLMProcessor's, which needs num2words and torchvision) over the
    saved image processor."""

    def __init__(self, out_dir, **image_processor):
        """image_processor: settings over the saved ones (do_image_splitting=False ...)."""
        from transformers import (AutoTokenizer, Idefics3Processor,
                                  SmolVLMForConditionalGeneration)
        from transformers.models.idefics3.image_processing_pil_idefics3 import \
            Idefics3ImageProcessorPil
        self.model = SmolVLMForConditionalGeneration.from_pretrained(
            str(out_dir), attn_implementation="eager").eval()
        saved = json.loads((pathlib.Path(out_dir) / "processor_config.json").read_text())
        cfg = {k: v for k, v in saved["image_processor"].items()
               if k not in ("image_processor_type", "processor_class")} | image_processor
        self.processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**cfg),
                                           tokenizer=AutoTokenizer.from_pretrained(str(out_dir)),
                                           image_seq_len=saved["image_seq_len"])
        self.image_token = self.model.config.image_token_id

    def _inputs(self, ids: list[int], images):
        text = self.processor.tokenizer.decode(ids)
        if not images:
            return {"input_ids": __import__("torch").tensor([ids])}
        out = self.processor(text=[text], images=[list(images)], return_tensors="pt",
                             add_special_tokens=False)
        return {k: out[k] for k in ("input_ids", "pixel_values", "pixel_attention_mask")}

    def expand(self, ids: list[int], images) -> list[int]:
        return self._inputs(ids, images)["input_ids"][0].tolist()

    def generate(self, ids: list[int], images, max_new_tokens: int
                 ) -> tuple[list[int], list[float]]:
        import torch
        with torch.no_grad():
            out = self.model(**self._inputs(ids, images), use_cache=True)
            return greedy_loop(self.model, out, max_new_tokens)


def greedy_loop(model, out, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy ids over transformers' KV cache from a first forward's output (no EOS stop),
    with each step's top-1 minus top-2 logit margin (tests/reference.py's convention)."""
    import torch
    ids, margins = [], []
    for step in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        ids.append(int(torch.argmax(logits)))
        margins.append(float(top2[0] - top2[1]))
        if step + 1 < max_new_tokens:
            out = model(input_ids=torch.tensor([[ids[-1]]]), cache=out.cache, use_cache=True)
    return ids, margins


class LlavaReference:
    """transformers' LlavaForConditionalGeneration and its processor, as saved."""

    def __init__(self, out_dir):
        from transformers import AutoProcessor, LlavaForConditionalGeneration
        self.model = LlavaForConditionalGeneration.from_pretrained(
            str(out_dir), attn_implementation="eager").eval()
        self.processor = AutoProcessor.from_pretrained(str(out_dir))
        self.image_token = self.model.config.image_token_id

    def expand(self, ids: list[int], images) -> list[int]:
        n = self.model.config.image_seq_length
        return [x for t in ids for x in ([t] * n if t == self.image_token else [t])]

    def generate(self, ids: list[int], images, max_new_tokens: int
                 ) -> tuple[list[int], list[float]]:
        import torch
        full = self.expand(ids, images)
        with torch.no_grad():
            kw = {}
            if images:
                kw["pixel_values"] = self.processor.image_processor(
                    images=images, return_tensors="pt")["pixel_values"]
            out = self.model(input_ids=torch.tensor([full]), use_cache=True, **kw)
            return greedy_loop(self.model, out, max_new_tokens)


class Reference:
    """transformers' composition of a tiny vision checkpoint's weights (the oracle):
    `embed(ids, images)` -> inputs_embeds with the images' rows in place of the image
    tokens (the prompt already expanded), `generate(ids, images, n)` -> greedy ids."""

    def __init__(self, out_dir):
        import torch
        from safetensors.torch import load_file
        from transformers import (AutoImageProcessor, LlamaConfig, LlamaForCausalLM,
                                  Qwen2VLVisionConfig)
        from transformers.models.qwen2_vl.modeling_qwen2_vl import \
            Qwen2VisionTransformerPretrainedModel

        out = pathlib.Path(out_dir)
        cfg = json.loads((out / "config.json").read_text())
        state = load_file(str(out / "model.safetensors"))
        part = lambda p: {k[len(p):]: v for k, v in state.items() if k.startswith(p)}  # noqa: E731
        text = LlamaConfig(**cfg["text_config"])
        text._attn_implementation = "eager"
        self.llm = LlamaForCausalLM(text).eval()
        self.llm.load_state_dict(part("llm."))
        vision = Qwen2VLVisionConfig(**cfg["vision_config"])
        self.visual = Qwen2VisionTransformerPretrainedModel._from_config(
            vision, dtype=torch.float32).eval()
        self.visual.load_state_dict(part("visual."))
        self.norm = torch.nn.LayerNorm(self.llm.config.hidden_size).eval()
        self.norm.load_state_dict(part("norm."))
        self.processor = AutoImageProcessor.from_pretrained(str(out))
        self.image_token = cfg["image_token_index"]

    def image_rows(self, image):
        import torch
        with torch.no_grad():
            p = self.processor(images=[image], return_tensors="pt")
            out = self.visual(p["pixel_values"], grid_thw=p["image_grid_thw"])
            return self.norm(out.pooler_output)

    def expand(self, ids: list[int], images) -> list[int]:
        """The prompt with each placeholder repeated once per image row."""
        out, rows = [], iter([self.image_rows(im).shape[0] for im in images])
        for t in ids:
            out += [t] * next(rows) if t == self.image_token else [t]
        return out

    def generate(self, ids: list[int], images, max_new_tokens: int
                 ) -> tuple[list[int], list[float]]:
        """Greedy ids after the prompt (no EOS stop), and each step's top-1 minus top-2
        logit margin (tests/reference.py's convention)."""
        import torch
        full = self.expand(ids, images)
        with torch.no_grad():
            x = self.llm.get_input_embeddings()(torch.tensor([full]))
            if images:
                rows = torch.cat([self.image_rows(im) for im in images])
                x[0, torch.tensor(full) == self.image_token] = rows
            out = self.llm(inputs_embeds=x, use_cache=True)
            return greedy_loop(self.llm, out, max_new_tokens)
