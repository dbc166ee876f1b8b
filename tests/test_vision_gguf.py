"""A GGUF text model with llama.cpp's vision projector file (--mmproj): the tiny SmolVLM and
LLaVA written as the pairs llama.cpp's converters write (the text model as a llama GGUF;
the vision tower and projector as a "clip" GGUF under llama.cpp's tensor names: projector
type idefics3 as convert_hf_to_gguf.py --mmproj writes it, type mlp as the legacy
convert_image_encoder_to_gguf.py does, cut after the feature layer, fc1 named ffn_down),
served together, against transformers on the same weights with the projector's
processing (one image_size tile a picture)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from safetensors.torch import load_file, save_file

from models.vision.mmproj import TOWERS, tensor_names
from tests.reference import first_near_tie
from tests.server import serving
from tests.test_gguf import write_gguf
from tests.test_vision import CAT, WIDE, b64png, greedy

pytestmark = pytest.mark.e2e
N = 8


# the checkpoint's prefix of its text model and head -> a Llama checkpoint's
TEXT_NAMES = {"smolvlm": {"model.text_model.": "model.", "lm_head.": "lm_head."},
              "llava": {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}}


def text_dir(hf: Path, out: Path, family: str) -> Path:
    """The checkpoint's text model alone, as a Llama HF directory (write_gguf's input)."""
    out.mkdir()
    cfg = json.loads((hf / "config.json").read_text())
    text = {**cfg["text_config"], "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (out / "config.json").write_text(json.dumps(text))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(hf / f, out / f)
    state = load_file(str(hf / "model.safetensors"))
    renamed = {}
    for k, v in state.items():
        prefix = next((p for p in TEXT_NAMES[family] if k.startswith(p)), None)
        if prefix is not None:
            renamed[TEXT_NAMES[family][prefix] + k[len(prefix):]] = v
    save_file(renamed, str(out / "model.safetensors"))
    return out


def write_mmproj(hf: Path, out: Path, family: str) -> Path:
    """The vision tower and projector as llama.cpp's projector file of the family."""
    cfg = json.loads((hf / "config.json").read_text())
    v = cfg["vision_config"]
    llava = family == "llava"
    layers = v["num_hidden_layers"] + 1 + cfg["vision_feature_layer"] if llava \
        else v["num_hidden_layers"]                    # the legacy converter's cut
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_string("general.type", "mmproj")
    w.add_string("clip.projector_type", "mlp" if llava else "idefics3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", v.get("hidden_act") == "gelu")
    for key, value in (("embedding_length", v["hidden_size"]),
                       ("feed_forward_length", v["intermediate_size"]),
                       ("block_count", layers),
                       ("attention.head_count", v["num_attention_heads"]),
                       ("image_size", v["image_size"]), ("patch_size", v["patch_size"])):
        w.add_uint32(f"clip.vision.{key}", value)
    if not llava:
        w.add_uint32("clip.vision.projector.scale_factor", cfg["scale_factor"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v.get("layer_norm_eps", 1e-6))
    mean = [0.48145466, 0.4578275, 0.40821073] if llava else [0.5] * 3
    std = [0.26862954, 0.26130258, 0.27577711] if llava else [0.5] * 3
    w.add_array("clip.vision.image_mean", mean)
    w.add_array("clip.vision.image_std", std)
    state = load_file(str(hf / "model.safetensors"))
    arch = "LlavaForConditionalGeneration" if llava else "Idefics3ForConditionalGeneration"
    names = tensor_names(arch, layers)
    ffn = {"fc1": "ffn_down", "fc2": "ffn_up"} if llava else {"fc1": "ffn_up", "fc2": "ffn_down"}
    tower = TOWERS[arch]
    for i in range(layers):
        for ours, theirs in ffn.items():
            for kind in ("weight", "bias"):
                names[f"{tower}encoder.layers.{i}.mlp.{ours}.{kind}"] = \
                    f"v.blk.{i}.{theirs}.{kind}"
    stored = "" if llava else "model."               # LLaVA is saved without "model."
    for ours, theirs in names.items():
        w.add_tensor(theirs, state[stored + ours.removeprefix("vision.")].float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=["smolvlm", "llava"])
def pair(request, tiny_model, tmp_path_factory):
    family = request.param
    hf = tiny_model(family)
    d = tmp_path_factory.mktemp(f"pair-{family}")
    text = write_gguf(text_dir(hf, d / "text", family), d / f"{family}-text.gguf")
    return family, hf, text, write_mmproj(hf, d / f"mmproj-{family}.gguf", family)


def test_gguf_text_model_with_mmproj_equals_transformers(pair, tmp_path):
    from transformers import AutoTokenizer

    from checkpoints.tiny_vision import SmolVLMReference, reference
    family, hf, text, mmproj = pair
    if family == "smolvlm":         # one image_size tile a picture, as llama.cpp
        size = json.loads((hf / "config.json").read_text())["vision_config"]["image_size"]
        oracle = SmolVLMReference(hf, do_image_splitting=False, size={"longest_edge": size},
                                  max_image_size={"longest_edge": size})
    else:                           # the tiny LLaVA's processing is CLIP's at image_size
        oracle = reference(hf)
    tok = AutoTokenizer.from_pretrained(str(hf))
    texts, images = ["Look: <image> now", "Two <image> and <image>."], [[CAT], [WIDE, CAT]]
    with serving(text, "--mmproj", str(mmproj), tmpdir=tmp_path) as s:
        info = s.client.get("/model_info").json()
        assert info["has_image_understanding"] and \
            info["architecture"] == json.loads((hf / "config.json").read_text())[
                "architectures"][0].replace("SmolVLM", "Idefics3")
        outs = s.generate_ok(**greedy(text=texts, image_data=[[b64png(i) for i in ims]
                                                              for ims in images]))
    for t, ims, out in zip(texts, images, outs):
        want, margins = oracle.generate(tok(t).input_ids, ims, N)
        tie = first_near_tie(margins)
        n = N if tie is None else tie
        assert out["output_ids"][:n] == want[:n]
        assert out["meta_info"]["prompt_tokens"] == len(oracle.expand(tok(t).input_ids, ims))


def test_mmproj_needs_a_gguf_model_and_a_projector(pair, tmp_path):
    import subprocess
    import sys
    _, hf, text, mmproj = pair
    for model, proj, message in ((hf, mmproj, "pass the text model as a .gguf"),
                                 (text, text, "not a vision projector file"),
                                 (text, tmp_path / "nope.gguf", "no such file")):
        r = subprocess.run([sys.executable, "launch.py", "--model-path", str(model),
                            "--mmproj", str(proj), "--port", "1"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
