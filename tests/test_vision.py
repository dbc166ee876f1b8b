"""End to end: images in, on each tiny vision checkpoint (checkpoints/tiny_vision.py) against
its transformers reference (LLaVA: LlavaForConditionalGeneration; SmolVLM:
SmolVLMForConditionalGeneration, its tiles and Idefics3Processor's expansion; Qwen2-VL:
Qwen2VLForConditionalGeneration, its multimodal RoPE; Sarashina2-Vision, which
has no transformers class: the composition of Qwen2-VL's vision transformer, LayerNorm and
LlamaForCausalLM fed inputs_embeds): greedy ids on /generate (image_data) and on
/v1/chat/completions (image_url parts, through the openai SDK), one and two images per
prompt, single and batch; the prefix cache keyed by image; bad images are 400s."""

from __future__ import annotations

import base64
import io
import re
import struct
import zlib

import numpy as np
import ollama
import openai
import pytest
from PIL import Image

from checkpoints.tiny_vision import IMAGE, IMAGE_END, IMAGE_START, LLAVA_IMAGE, reference
from tests.reference import first_near_tie
from tests.server import serving, wait_idle

pytestmark = pytest.mark.e2e

N = 8                                   # greedy tokens compared
# How each family's prompts name an image, and the placeholder the server expands.
SLOTS = {"sarashina2_vision": (f"{IMAGE_START}{IMAGE}{IMAGE_END}", IMAGE),
         "llava": (LLAVA_IMAGE, LLAVA_IMAGE),
         "smolvlm": ("<image>", "<image>"),
         "qwen2_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>")}


def picture(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def b64png(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


CAT, DOG, WIDE = picture(90, 60, 1), picture(64, 64, 2), picture(200, 40, 3)


@pytest.fixture(scope="module", params=list(SLOTS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(tiny_model, family):
    return tiny_model(family)


@pytest.fixture(scope="module")
def oracle(model):
    return reference(model)


@pytest.fixture(scope="module")
def slot(family):
    return SLOTS[family][0]


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    CAT.save(d / "cat.png")
    return d


@pytest.fixture(scope="module")
def server(model, media_dir, tmp_path_factory):
    with serving(model, "--allowed-local-media-path", str(media_dir),
                 tmpdir=tmp_path_factory.mktemp("vision")) as s:
        yield s


def expected(oracle, ids: list[int], images: list[Image.Image]) -> tuple[list[int], int]:
    """The reference's greedy ids and how many of them to compare (up to a near-tie)."""
    want, margins = oracle.generate(ids, images, N)
    tie = first_near_tie(margins)
    return want, N if tie is None else tie


def greedy(**body) -> dict:
    return {**body, "sampling_params": {"max_new_tokens": N, "temperature": 0,
                                        "ignore_eos": True}}


@pytest.mark.parametrize("images", [[CAT], [CAT, WIDE]], ids=["one", "two"])
def test_generate_equals_reference(server, oracle, tokenizer, slot, images):
    text = "Look: " + " and ".join(slot for _ in images) + " what is it?"
    want, n = expected(oracle, tokenizer(text).input_ids, images)
    data = [b64png(im) for im in images]
    out = server.generate_ok(**greedy(text=text, image_data=data if len(data) > 1 else data[0]))
    assert out["output_ids"][:n] == want[:n]
    expanded = len(oracle.expand(tokenizer(text).input_ids, images))
    assert out["meta_info"]["prompt_tokens"] == expanded


def test_batch_equals_reference(server, oracle, tokenizer, slot):
    texts = [f"One {slot} here.", f"Two {slot} and {slot}.", "No image at all."]
    images = [[DOG], [WIDE, CAT], []]
    outs = server.generate_ok(**greedy(text=texts, image_data=[
        b64png(DOG), [b64png(WIDE), b64png(CAT)], None]))
    for text, ims, out in zip(texts, images, outs):
        want, n = expected(oracle, tokenizer(text).input_ids, ims)
        assert out["output_ids"][:n] == want[:n]


def test_input_ids_and_a_local_file(server, oracle, tokenizer, slot, media_dir):
    ids = tokenizer(f"File {slot} please").input_ids
    want, n = expected(oracle, ids, [CAT])
    out = server.generate_ok(**greedy(input_ids=ids, image_data=str(media_dir / "cat.png")))
    assert out["output_ids"][:n] == want[:n]


@pytest.mark.parametrize("images", [[DOG], [DOG, CAT]], ids=["one", "two"])
def test_chat_completions_with_image_url_parts(server, oracle, tokenizer, images):
    content = [{"type": "text", "text": "Compare "}]
    for im in images:
        content += [{"type": "image_url",
                     "image_url": {"url": f"data:image/png;base64,{b64png(im)}"}},
                    {"type": "text", "text": " with "}]
    template = [{"role": "user", "content": [
        {"type": "image"} if p["type"] == "image_url" else p for p in content]}]
    ids = tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    want, n = expected(oracle, list(ids), images)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}], max_tokens=N,
            temperature=0, extra_body={"ignore_eos": True})
    # The chat route's prompt is the template's: the same ids as transformers renders, so
    # its answer is the text of the greedy ids of that prompt, which are the reference's.
    ours = server.generate_ok(**greedy(input_ids=list(ids),
                                       image_data=[b64png(im) for im in images]))
    assert ours["output_ids"][:n] == want[:n]
    assert r.usage.prompt_tokens == ours["meta_info"]["prompt_tokens"]
    assert r.choices[0].message.content == tokenizer.decode(ours["output_ids"],
                                                            skip_special_tokens=True)


def test_ollama_images_as_the_chat_route_takes_them(server):
    """Ollama's base64 `images` on a message are image parts after its text: the answer is
    the chat route's for the same parts."""
    text, options = "Compare ", {"temperature": 0, "num_predict": N}
    r = ollama.Client(host=server.url).chat(model="default", options=options, messages=[
        {"role": "user", "content": text, "images": [b64png(CAT), b64png(DOG)]}])
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        want = client.chat.completions.create(model="default", max_tokens=N, temperature=0,
                                              messages=[{"role": "user", "content": [
            {"type": "text", "text": text}] + [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64png(im)}"}}
            for im in (CAT, DOG)]}])
    assert r.message.content == want.choices[0].message.content
    assert r.prompt_eval_count == want.usage.prompt_tokens


def test_the_prefix_cache_is_keyed_by_the_image(server, oracle, tokenizer, family):
    server.client.post("/flush_cache")
    slot, placeholder = SLOTS[family]
    text = f"Cache {slot} test"
    first = server.generate_ok(**greedy(text=text, image_data=b64png(WIDE)))
    again = server.generate_ok(**greedy(text=text, image_data=b64png(WIDE)))
    prompt = first["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] == prompt - 1          # all but the last
    other = server.generate_ok(**greedy(text=text, image_data=b64png(DOG)))
    start = tokenizer(text).input_ids.index(tokenizer.convert_tokens_to_ids(placeholder))
    assert other["meta_info"]["cached_tokens"] == start               # up to the image only
    want, n = expected(oracle, tokenizer(text).input_ids, [DOG])
    assert other["output_ids"][:n] == want[:n]
    wait_idle(server)


def png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                               0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def test_bad_images_are_400s_naming_the_problem(server, slot, tmp_path):
    good = base64.b64decode(b64png(CAT))
    bad = {
        "truncated PNG": (base64.b64encode(good[:len(good) // 2]).decode(), "cannot be decoded"),
        "bomb header": (base64.b64encode(png_header_only(20000, 20000)).decode(),
                        "more than the limit of 40000000 pixels"),
        "wrong base64": ("@@@not-base64@@@", "neither valid base64"),
        "outside the dir": (str(tmp_path / "x.png"), "does not exist|outside the directory"),
        "etc passwd": ("/etc/passwd", "outside the directory"),
        "url": ("http://127.0.0.1:9/cat.png", "allow-remote-media"),
    }
    (tmp_path / "x.png").write_bytes(good)
    for name, (source, message) in bad.items():
        r = server.generate(text=f"Bad {slot}", image_data=source,
                            sampling_params={"max_new_tokens": 2})
        assert r.status_code == 400, name
        assert re.search(message, r.json()["error"]["message"]), (name, r.text)
    r = server.generate(text=f"Two {slot}{slot}", image_data=b64png(CAT))
    assert r.status_code == 400 and "2 image placeholder" in r.json()["error"]["message"]
    r = server.generate(text=f"None given {slot}", sampling_params={"max_new_tokens": 2})
    assert r.status_code == 400 and "1 image placeholder" in r.json()["error"]["message"]
    r = server.generate(text="none", image_data=[b64png(CAT)] * 17)
    assert r.status_code == 400 and "max-images-per-request" in r.json()["error"]["message"]
    assert server.client.get("/health").status_code == 200
    assert server.generate_ok(**greedy(text=f"Still {slot} alive", image_data=b64png(CAT)))
    wait_idle(server)


def test_model_cards_say_it_takes_images(server, llama_server):
    assert server.client.get("/model_info").json()["has_image_understanding"] is True
    card = server.client.get("/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]
    assert llama_server.client.get("/model_info").json()["has_image_understanding"] is False
    r = llama_server.generate(text="hi", image_data=b64png(CAT))
    assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]


@pytest.mark.parametrize("name", ["sarashina2_vision", "qwen2_vl"])
def test_tensor_parallel_with_prefill_chunks_cutting_through_images(tiny_model, tmp_path,
                                                                    name):
    """Two ranks: rank 0 encodes, the rows (and Qwen2-VL's multimodal RoPE positions)
    travel in the step's plan; chunks of 8 positions cut every image into pieces."""
    model = tiny_model(name)
    oracle, slot = reference(model), SLOTS[name][0]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))
    texts = [f"A {slot} b", f"Two {slot} then {slot}."]
    images = [[DOG], [WIDE, CAT]]
    with serving(model, "--tp-size", "2", "--chunked-prefill-size", "8",
                 tmpdir=tmp_path) as s:
        outs = s.generate_ok(**greedy(text=texts, image_data=[[b64png(i) for i in ims]
                                                              for ims in images]))
    for text, ims, out in zip(texts, images, outs):
        want, n = expected(oracle, tok(text).input_ids, ims)
        assert out["output_ids"][:n] == want[:n]
