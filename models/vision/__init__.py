"""Vision encoders: what turns one preprocessed image (media/processors.py) into the rows
the text decoder takes in place of the image's tokens, one module per family over shared
parts (qwen2_vl.py: Qwen2-VL's vision transformer).

    encoder = build_encoder(config)           # None for a text model
    rows = encoder(pixels, grid)              # [image tokens, decoder hidden]
    encoder.tokens(grid)                      # how many rows that is
    encoder.check(shape, grid)                # why a message's image cannot be its input
    encoder.image_token_id                    # the token whose positions take the rows

The decoder (models/llama.py CausalLM) holds the encoder as `vision`; the loader names its
parameters by `CHECKPOINT_NAMES` (where the checkpoint keeps the decoder, its head, and the
encoder). Encoders run in the model's dtype on its device, with torch's own layers (they
run once per new image, not per token; models/llama.py's kernels are the decoder's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from wire.model_path import VISION_ARCHITECTURES

from .clip import ClipVisionTransformer
from .qwen2_vl import ACTIVATIONS, Qwen2VisionTransformer
from .siglip import DEFAULTS as SIGLIP_DEFAULTS
from .siglip import Connector, VisionModel


@dataclass(frozen=True)
class CheckpointNames:
    """Where a family's checkpoint keeps its parts: the decoder's modules under `decoder`
    (our `layers.0...` is `{decoder}layers.0...`), its LM head as `head`, and the encoder's
    parameters under `encoder` (our `vision.X` is `{encoder}X`). `aliases`: prefixes other
    saves of the family use, each rewritten to ours before a name is looked up (the first
    that matches)."""

    decoder: str = "model."
    head: str = "lm_head"
    encoder: str = ""
    aliases: tuple[tuple[str, str], ...] = ()

    def canonical(self, key: str) -> str:
        for old, new in self.aliases:
            if key.startswith(old):
                return new + key[len(old):]
        return key


TEXT_NAMES = CheckpointNames()


class Projector(nn.Module):
    """LLaVA's multi_modal_projector: linear, activation, linear."""

    def __init__(self, width: int, hidden_size: int, act: str, bias: bool):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {act!r}")
        self.linear_1 = nn.Linear(width, hidden_size, bias=bias)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaEncoder(nn.Module):
    """LLaVA (transformers' LlavaForConditionalGeneration): CLIP's vision tower, the hidden
    states of `vision_feature_layer` (the class token dropped under the "default"
    strategy), then the projector. An image is one fixed-size crop: [C, S, S] pixels, no
    grid; every image makes the same number of rows."""

    names = CheckpointNames(decoder="language_model.model.", head="language_model.lm_head",
                            aliases=(("vision_tower.vision_model.", "vision_tower."),
                                     ("model.vision_tower.vision_model.", "vision_tower."),
                                     ("model.vision_tower.", "vision_tower."),
                                     ("model.multi_modal_projector.", "multi_modal_projector."),
                                     ("model.language_model.", "language_model.model."),
                                     ("lm_head.", "language_model.lm_head.")))

    def __init__(self, config: dict, hidden_size: int):
        super().__init__()
        layer = config.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: zserve takes one layer")
        self.layer = layer
        self.strategy = config.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {self.strategy!r}")
        self.vision_tower = ClipVisionTransformer(config.get("vision_config", {}))
        self.multi_modal_projector = Projector(
            self.vision_tower.cfg["hidden_size"], hidden_size,
            config.get("projector_hidden_act", "gelu"),
            config.get("multimodal_projector_bias", True))

    def tokens(self, grid: list[int]) -> int:
        return self.vision_tower.patches + (self.strategy == "full")

    def check(self, shape: list[int], grid: list[int]) -> str | None:
        c = self.vision_tower.cfg
        want = [c["num_channels"], c["image_size"], c["image_size"]]
        return None if shape == want and not grid else \
            f"pixels of shape {shape} are not one {want} crop"

    @torch.inference_mode()
    def forward(self, pixels: Tensor, grid: list[int]) -> Tensor:
        x = self.vision_tower(pixels, self.layer)
        return self.multi_modal_projector(x[1:] if self.strategy == "default" else x)


class Idefics3Encoder(nn.Module):
    """Idefics3 and SmolVLM: the SigLIP-shaped vision model over each tile of an image (its
    processor's tiles, the global one last: pixels [tiles, C, S, S], grid [rows, cols]),
    then the connector's pixel shuffle and projection: (S / patch)^2 / scale^2 rows per
    tile, in tile order."""

    names = CheckpointNames(decoder="model.text_model.", head="lm_head", encoder="model.")

    def __init__(self, config: dict, hidden_size: int):
        super().__init__()
        cfg = self.cfg = {**SIGLIP_DEFAULTS, **config.get("vision_config", {})}
        if cfg["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {cfg['hidden_act']!r}")
        self.scale = int(config.get("scale_factor", 2))
        self.vision_model = VisionModel(cfg)
        self.connector = Connector(cfg, self.scale, hidden_size)

    @property
    def tile_tokens(self) -> int:
        return (self.cfg["image_size"] // self.cfg["patch_size"]) ** 2 // self.scale ** 2

    def tokens(self, grid: list[int]) -> int:
        rows, cols = grid
        return (rows * cols + 1) * self.tile_tokens

    def check(self, shape: list[int], grid: list[int]) -> str | None:
        c = self.cfg
        if len(grid) != 2 or min(grid) < 0 or (grid[0] == 0) != (grid[1] == 0):
            return f"grid {grid} is not [rows, cols] of tiles"
        want = [grid[0] * grid[1] + 1, c["num_channels"], c["image_size"], c["image_size"]]
        return None if shape == want else f"pixels of shape {shape} are not {want} tiles"

    @torch.inference_mode()
    def forward(self, pixels: Tensor, grid: list[int]) -> Tensor:
        return self.connector(self.vision_model(pixels))


class Qwen2VLEncoder(nn.Module):
    """Qwen2-VL itself: its vision transformer and merger (whose output is the decoder's
    width), and its multimodal RoPE (`positions`): an image's token k (merged row-major,
    grid_w / merge to a row) sits at time 0, height k // width, width k % width, all
    offset by the text position where the image starts (the decoder's mrope_section says
    which frequencies take which)."""

    names = CheckpointNames(decoder="model.language_model.", head="lm_head", encoder="model.",
                            aliases=(("visual.", "model.visual."),       # older saves
                                     ("model.layers.", "model.language_model.layers."),
                                     ("model.embed_tokens.",
                                      "model.language_model.embed_tokens."),
                                     ("model.norm.", "model.language_model.norm.")))

    def __init__(self, config: dict, hidden_size: int):
        super().__init__()
        vision = config.get("vision_config", {})
        self.visual = Qwen2VisionTransformer({**vision,
                                              "hidden_size": vision.get("hidden_size",
                                                                        hidden_size)})

    def tokens(self, grid: list[int]) -> int:
        return self.visual.tokens(grid)

    def check(self, shape: list[int], grid: list[int]) -> str | None:
        return self.visual.check(shape, grid)

    def positions(self, grid: list[int]) -> tuple[list[list[int]], int]:
        """([t, h, w] offsets of each of the image's tokens, the text positions it takes)."""
        t, h, w = (grid[0], grid[1] // self.visual.merge, grid[2] // self.visual.merge)
        k = range(t * h * w)
        return ([[i // (h * w) for i in k], [i // w % h for i in k], [i % w for i in k]],
                max(h, w))

    @torch.inference_mode()
    def forward(self, pixels: Tensor, grid: list[int]) -> Tensor:
        return self.visual(pixels, grid)


class Sarashina2VisionEncoder(Qwen2VLEncoder):
    """Sarashina2-Vision (SGLang's sarashina2_vision.py): Qwen2-VL's vision transformer,
    its merger included, then a LayerNorm (torch's default eps) over the decoder's width;
    its Llama decoder takes plain positions (no multimodal RoPE)."""

    names = CheckpointNames(decoder="llm.model.", head="llm.lm_head", encoder="")

    def __init__(self, config: dict, hidden_size: int):
        super().__init__({"vision_config": {**config.get("vision_config", {}),
                                            "hidden_size": hidden_size}}, hidden_size)
        self.norm = nn.LayerNorm(hidden_size)

    @torch.inference_mode()
    def forward(self, pixels: Tensor, grid: list[int]) -> Tensor:
        return self.norm(self.visual(pixels, grid))


ENCODERS = {"Sarashina2VisionForCausalLM": Sarashina2VisionEncoder,
            "Qwen2VLForConditionalGeneration": Qwen2VLEncoder,
            "LlavaForConditionalGeneration": LlavaEncoder,
            "Idefics3ForConditionalGeneration": Idefics3Encoder,
            "SmolVLMForConditionalGeneration": Idefics3Encoder}


def build_encoder(config) -> nn.Module | None:
    """The vision encoder of a ModelConfig's model (None for a text model)."""
    arch = config.vision_architecture
    if arch is None:
        return None
    encoder = ENCODERS[arch](config.vision_config, config.hidden_size)
    encoder.image_token_id = VISION_ARCHITECTURES[arch].image_token_id(config.vision_config)
    return encoder


def checkpoint_names(config) -> CheckpointNames:
    if config.vision_architecture is None:
        return TEXT_NAMES
    return ENCODERS[config.vision_architecture].names
