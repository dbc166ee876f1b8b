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

from .qwen2_vl import Qwen2VisionTransformer


@dataclass(frozen=True)
class CheckpointNames:
    """Where a family's checkpoint keeps its parts: the decoder's modules under `decoder`
    (our `layers.0...` is `{decoder}layers.0...`), its LM head as `head`, and the encoder's
    parameters under `encoder` (our `vision.X` is `{encoder}X`)."""

    decoder: str = "model."
    head: str = "lm_head"
    encoder: str = ""


TEXT_NAMES = CheckpointNames()


class Sarashina2VisionEncoder(nn.Module):
    """Sarashina2-Vision (SGLang's sarashina2_vision.py): Qwen2-VL's vision transformer,
    its merger included, then a LayerNorm (torch's default eps) over the decoder's width."""

    names = CheckpointNames(decoder="llm.model.", head="llm.lm_head", encoder="")

    def __init__(self, config: dict, hidden_size: int):
        super().__init__()
        self.image_token_id = int(config["image_token_index"])
        self.visual = Qwen2VisionTransformer({**config.get("vision_config", {}),
                                              "hidden_size": hidden_size})
        self.norm = nn.LayerNorm(hidden_size)

    def tokens(self, grid: list[int]) -> int:
        return self.visual.tokens(grid)

    def check(self, shape: list[int], grid: list[int]) -> str | None:
        return self.visual.check(shape, grid)

    @torch.inference_mode()
    def forward(self, pixels: Tensor, grid: list[int]) -> Tensor:
        return self.norm(self.visual(pixels, grid))


ENCODERS = {"Sarashina2VisionForCausalLM": Sarashina2VisionEncoder}


def build_encoder(config) -> nn.Module | None:
    """The vision encoder of a ModelConfig's model (None for a text model)."""
    if config.vision_architecture is None:
        return None
    return ENCODERS[config.vision_architecture](config.vision_config, config.hidden_size)


def checkpoint_names(config) -> CheckpointNames:
    if config.vision_architecture is None:
        return TEXT_NAMES
    return ENCODERS[config.vision_architecture].names
