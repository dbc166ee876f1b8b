"""A GGUF text model with llama.cpp's vision projector file (--mmproj): the tiny SmolVLM
written as the pair llama.cpp's convert_hf_to_gguf.py writes (its text model as a llama
GGUF, its vision tower and connector as a "clip" GGUF of projector type idefics3, under
llama.cpp's tensor names), served together, against transformers'
SmolVLMForConditionalGeneration on the same weights with the projector's processing (one
tile of image_size a picture)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from safetensors.torch import load_file, save_file

from models.vision.mmproj import tensor_names
from tests.reference import first_near_tie
from tests.server import serving
from tests.test_gguf import write_gguf
from tests.test_vision import CAT, WIDE, b64png, greedy

pytestmark = pytest.mark.e2e
N = 8


def text_dir(hf: Path, out: Path) -> Path:
    """The checkpoint's text model alone, as a Llama HF directory (write_gguf's input)."""
    out.mkdir()
    cfg = json.loads((hf / "config.json").read_text())
    text = {**cfg["text_config"], "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (out / "config.json").write_text(json.dumps(text))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(hf / f, out / f)
    state = load_file(str(hf / "model.safetensors"))
    save_file({k.replace("model.text_model.", "model."): v for k, v in state.items()
               if k.startswith(("model.text_model.", "lm_head."))},
              str(out / "model.safetensors"))
    return out


def write_mmproj(hf: Path, out: Path) -> Path:
    """The vision tower and connector as llama.cpp's idefics3 projector file."""
    cfg = json.loads((hf / "config.json").read_text())
    v = cfg["vision_config"]
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_string("general.type", "mmproj")
    w.add_string("clip.projector_type", "idefics3")
    w.add_bool("clip.has_vision_encoder", True)
    for key, value in (("embedding_length", v["hidden_size"]),
                       ("feed_forward_length", v["intermediate_size"]),
                       ("block_count", v["num_hidden_layers"]),
                       ("attention.head_count", v["num_attention_heads"]),
                       ("image_size", v["image_size"]), ("patch_size", v["patch_size"]),
                       ("projector.scale_factor", cfg["scale_factor"])):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v.get("layer_norm_eps", 1e-6))
    w.add_array("clip.vision.image_mean", [0.5] * 3)
    w.add_array("clip.vision.image_std", [0.5] * 3)
    state = load_file(str(hf / "model.safetensors"))
    for ours, theirs in tensor_names(v["num_hidden_layers"]).items():
        hf_name = "model." + ours.removeprefix("vision.")
        w.add_tensor(theirs, state[hf_name].float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    hf = tiny_model("smolvlm")
    d = tmp_path_factory.mktemp("pair")
    text = write_gguf(text_dir(hf, d / "text"), d / "smolvlm-text.gguf")
    return hf, text, write_mmproj(hf, d / "mmproj-smolvlm.gguf")


def test_gguf_text_model_with_mmproj_equals_transformers(pair, tmp_path):
    from transformers import AutoTokenizer

    from checkpoints.tiny_vision import SmolVLMReference
    hf, text, mmproj = pair
    size = json.loads((hf / "config.json").read_text())["vision_config"]["image_size"]
    oracle = SmolVLMReference(hf, do_image_splitting=False, size={"longest_edge": size},
                              max_image_size={"longest_edge": size})
    tok = AutoTokenizer.from_pretrained(str(hf))
    texts, images = ["Look: <image> now", "Two <image> and <image>."], [[CAT], [WIDE, CAT]]
    with serving(text, "--mmproj", str(mmproj), tmpdir=tmp_path) as s:
        info = s.client.get("/model_info").json()
        assert info["has_image_understanding"] and \
            info["architecture"] == "Idefics3ForConditionalGeneration"
        outs = s.generate_ok(**greedy(text=texts, image_data=[[b64png(i) for i in ims]
                                                              for ims in images]))
    for t, ims, out in zip(texts, images, outs):
        want, margins = oracle.generate(tok(t).input_ids, ims, N)
        n = first_near_tie(margins) or N
        assert out["output_ids"][:n] == want[:n]
        assert out["meta_info"]["prompt_tokens"] == len(oracle.expand(tok(t).input_ids, ims))


def test_mmproj_needs_a_gguf_model_and_a_projector(pair, tiny_model, tmp_path):
    import subprocess
    import sys
    hf, text, mmproj = pair
    for model, proj, message in ((hf, mmproj, "pass the text model as a .gguf"),
                                 (text, text, "not a vision projector file"),
                                 (text, tmp_path / "nope.gguf", "no such file")):
        r = subprocess.run([sys.executable, "launch.py", "--model-path", str(model),
                            "--mmproj", str(proj), "--port", "1"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
