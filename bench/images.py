"""Images in: one image and a question per request, zserve against transformers on the same
checkpoint in the same run (and llama.cpp's llama-server --mmproj where given).

    python -m bench.images [--model-path DIR] [--num-requests 32] [--output-len 32]
        [--single 4] [--skip-hf] [--json PATH]
        [--llama-server BIN --llama-model TEXT.gguf --llama-mmproj MMPROJ.gguf
         --llama-threads 2]

Without --model-path, a SmolVLM-256M-shaped checkpoint with seeded random weights is built
(once) in /tmp/smolvlm-256m-bench (Idefics3ForConditionalGeneration, as SmolVLM-256M's own
config says, with SmolLM2's tokenizer plus SmolVLM's markers): SigLIP-B/16 at 512 pixels (12 layers, width 768) and a
pixel shuffle of 4 (64 image tokens), a SmolLM2-135M decoder (30 layers, width 576); its
processor does not split images into tiles (one 512 x 512 tile a request, as a CPU server
would be set up), so each image is 64 tokens plus the markers.

Workload (seeded random 640 x 480 images, different per request; greedy, EOS ignored):
- 32 at once, cold: every image new to the server: its encoder runs once per request;
- 32 at once, warm: the same images again, with a different first line of text, so the
  prefix cache misses from the start and only the image embedding cache is warm;
- one at a time, cold and warm, over the first --single images.
Each phase reports time to first token (p50: the image's decoding, preprocessing, encoder
and the prompt's prefill), decode rate per request (tokens/s after the first) and output
throughput. transformers runs the same requests: one at a time (processor + generate), and
the 32 as one padded batch.

With --llama-server, llama.cpp's llama-server serves the same weights as a GGUF pair (the
text model and its --mmproj projector, made from the checkpoint by llama.cpp's
convert_hf_to_gguf.py, `--mmproj` for the second; bench/README.md), and both servers get
the same cold requests through /v1/chat/completions (one image part, one text part;
streamed, EOS ignored): 32 at once and one at a time, each server started fresh.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import pathlib
import statistics
import sys
import time

import httpx
import numpy as np
from PIL import Image

from tests.server import Server

DEFAULT_DIR = "/tmp/smolvlm-256m-bench"
SIGLIP_B16_512 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, image_size=512, patch_size=16)


def build_checkpoint(out: pathlib.Path) -> pathlib.Path:
    """The SmolVLM-256M shape, seeded normal(0, 0.02) weights (transformers' own init)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import \
        Idefics3ImageProcessorPil

    from bench.make_checkpoint import SMOLLM2_135M
    from checkpoints import tiny_vision
    from launch import default_model, gguf_sidecar

    out.mkdir(parents=True, exist_ok=True)
    # SmolLM2's own tokenizer (from the default model's file), with SmolVLM's markers
    # added as SmolVLM-256M adds them: llama.cpp's converter knows its pre-tokenizer.
    tok = AutoTokenizer.from_pretrained(gguf_sidecar(default_model()))
    tok.add_special_tokens({"additional_special_tokens": list(tiny_vision.SMOLVLM_TOKENS)})
    tok.chat_template = tiny_vision.SMOLVLM_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    torch.manual_seed(0)
    config = Idefics3Config(vision_config=SIGLIP_B16_512,
                           text_config={**SMOLLM2_135M, "model_type": "llama",
                                        "vocab_size": len(tok),
                                        # SmolVLM-256M's own: how llama.cpp's converter
                                        # finds the text model
                                        "architectures": ["VLlama3ForCausalLM"]},
                           scale_factor=4, image_token_id=tok.convert_tokens_to_ids("<image>"))
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 512},
                                      max_image_size={"longest_edge": 512},
                                      do_image_splitting=False)
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Idefics3Processor", "image_seq_len": model.model.image_seq_len,
         "image_processor": images.to_dict()}, indent=2, sort_keys=True))
    return out


def pictures(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):          # smooth-ish content: noise upsampled, so PNG is not huge
        small = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
        out.append(Image.fromarray(small).resize((640, 480), Image.Resampling.BILINEAR))
    return out


def b64png(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def prompt(tag: str) -> str:
    return f"{tag}\nUser:<image>What is in this picture?<end_of_utterance>\nAssistant:"


# ---- zserve ---------------------------------------------------------------------------------

async def sse_frames(client: httpx.AsyncClient, path: str, body: dict):
    """The JSON frames of a streamed POST, to `data: [DONE]`."""
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def one_request(client: httpx.AsyncClient, text: str, image: str,
                      output_len: int) -> dict:
    body = {"text": text, "image_data": image, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0,
                                "ignore_eos": True}}
    t0 = time.monotonic()
    first, last = None, None
    async for frame in sse_frames(client, "/generate", body):
        if first is None and frame["output_ids"]:
            first = time.monotonic()
        last = frame
    end = time.monotonic()
    n = len(last["output_ids"])
    return {"ttft": first - t0, "e2e": end - t0, "tokens": n,
            "decode_rate": (n - 1) / (end - first) if n > 1 and end > first else None,
            "prompt_tokens": last["meta_info"]["prompt_tokens"],
            "cached_tokens": last["meta_info"]["cached_tokens"]}


async def phase(url: str, requests: list, concurrent: bool) -> dict:
    """Run the requests (each `lambda client: coroutine`) all at once or one after another."""
    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=len(requests))) as client:
        t0 = time.monotonic()
        if concurrent:
            results = await asyncio.gather(*(make(client) for make in requests))
        else:
            results = [await make(client) for make in requests]
        return summary(results, time.monotonic() - t0)


def run_phase(url: str, texts: list[str], images: list[str], output_len: int,
              concurrent: bool) -> dict:
    """/generate requests, one per (text, image)."""
    return asyncio.run(phase(url, [
        lambda c, t=t, im=im: one_request(c, t, im, output_len)
        for t, im in zip(texts, images)], concurrent))


def summary(results: list[dict], wall: float) -> dict:
    rates = [r["decode_rate"] for r in results if r.get("decode_rate")]
    return {"requests": len(results), "wall_s": wall,
            "ttft_p50_s": statistics.median(r["ttft"] for r in results),
            "decode_tok_s_per_request": statistics.median(rates) if rates else None,
            "output_tok_s": sum(r["tokens"] for r in results) / wall,
            "prompt_tokens": results[0].get("prompt_tokens"),
            "cached_tokens_p50": statistics.median(r.get("cached_tokens") or 0
                                                   for r in results)}


def run_zserve(model: pathlib.Path, images: list[str], args) -> dict:
    server = Server(str(model), *args.server_args.split(), one_thread=False)
    try:
        url, n, s = server.url, args.num_requests, args.single
        run_phase(url, [prompt("warm-up")], images[-1:], 2, False)
        out = {
            "batch_cold": run_phase(url, [prompt(f"a{i}") for i in range(n)], images[:n],
                                    args.output_len, True),
            "batch_warm": run_phase(url, [prompt(f"b{i}") for i in range(n)], images[:n],
                                    args.output_len, True),
            "single_cold": run_phase(url, [prompt(f"c{i}") for i in range(s)],
                                     images[n:n + s], args.output_len, False),
            "single_warm": run_phase(url, [prompt(f"d{i}") for i in range(s)],
                                     images[n:n + s], args.output_len, False),
        }
        out["server_info"] = server.client.get("/server_info").json()
        return out
    finally:
        server.terminate()


# ---- the chat route: zserve and llama-server alike ---------------------------------------

async def one_chat(client: httpx.AsyncClient, image: str, output_len: int) -> dict:
    body = {"model": "default", "stream": True, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                {"type": "text", "text": "What is in this picture?"}]}]}
    t0 = time.monotonic()
    first, chunks, usage = None, 0, None
    async for frame in sse_frames(client, "/v1/chat/completions", body):
        usage = frame.get("usage") or usage
        delta = (frame.get("choices") or [{}])[0].get("delta") or {}
        if delta.get("content"):
            chunks += 1
            first = first or time.monotonic()
    end = time.monotonic()
    n = (usage or {}).get("completion_tokens") or chunks
    return {"ttft": first - t0, "e2e": end - t0, "tokens": n,
            "decode_rate": (n - 1) / (end - first) if n > 1 and end > first else None,
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def chat_phase(url: str, images: list[str], output_len: int, concurrent: bool) -> dict:
    """/v1/chat/completions requests, one per image."""
    return asyncio.run(phase(url, [lambda c, im=im: one_chat(c, im, output_len)
                                   for im in images], concurrent))


def chat_turn(url: str, images: list[str], args) -> dict:
    n, s = args.num_requests, args.single
    chat_phase(url, images[-1:], 2, False)                              # warm-up
    return {"batch": chat_phase(url, images[:n], args.output_len, True),
            "single": chat_phase(url, images[n:n + s], args.output_len, False)}


def run_llama_pair(model: pathlib.Path, images: list[str], args) -> dict:
    from bench.throughput import LlamaServer
    server = Server(str(model), *args.server_args.split(), one_thread=False)
    try:
        zs = chat_turn(server.url, images, args)
    finally:
        server.terminate()
    llama = LlamaServer(args.llama_server, args.llama_model, args.num_requests,
                        args.num_requests * 512, args.llama_threads,
                        extra=("--mmproj", args.llama_mmproj))
    try:
        ll = chat_turn(llama.url, images, args)
    finally:
        llama.stop()
    return {"zserve": zs, "llama": ll}


# ---- transformers ---------------------------------------------------------------------------

def hf_load(model: pathlib.Path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import \
        Idefics3ImageProcessorPil
    hf = AutoModelForImageTextToText.from_pretrained(str(model), dtype=torch.float32).eval()
    saved = json.loads((model / "processor_config.json").read_text())
    cfg = {k: v for k, v in saved["image_processor"].items() if k != "image_processor_type"}
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.padding_side = "left"
    proc = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**cfg), tokenizer=tok,
                             image_seq_len=saved["image_seq_len"])
    return hf, proc


def hf_generate(hf, proc, texts: list[str], images: list[Image.Image], output_len: int
                ) -> tuple[float, float]:
    """(seconds to the first token, seconds in all) of one generate over these prompts."""
    import torch
    t0 = time.monotonic()
    inputs = proc(text=texts, images=[[im] for im in images], return_tensors="pt",
                  padding=True)
    first = []

    class Streamer:                     # notes when generate has its first token
        def put(self, value):
            if len(first) < 2:          # the prompt, then the first new token
                first.append(time.monotonic())

        def end(self):
            pass
    with torch.no_grad():
        hf.generate(**inputs, max_new_tokens=output_len, min_new_tokens=output_len,
                    do_sample=False, streamer=Streamer(), pad_token_id=2)
    end = time.monotonic()
    return first[-1] - t0, end - t0


def run_hf(model: pathlib.Path, images: list[Image.Image], args) -> dict:
    hf, proc = hf_load(model)
    n, s, out_len = args.num_requests, args.single, args.output_len
    hf_generate(hf, proc, [prompt("warm-up")], images[-1:], 2)
    single = []
    for i in range(s):
        ttft, e2e = hf_generate(hf, proc, [prompt(f"c{i}")], images[n + i:n + i + 1], out_len)
        single.append({"ttft": ttft, "e2e": e2e, "tokens": out_len,
                       "decode_rate": (out_len - 1) / (e2e - ttft)})
    ttft, e2e = hf_generate(hf, proc, [prompt(f"a{i}") for i in range(n)], images[:n], out_len)
    batch = [{"ttft": ttft, "e2e": e2e, "tokens": out_len,
              "decode_rate": (out_len - 1) / (e2e - ttft)}] * n
    return {"single": summary(single, sum(r["e2e"] for r in single)),
            "batch": summary(batch, e2e)}


# ---- report ---------------------------------------------------------------------------------

def table(report: dict) -> None:
    z, h, n = report["zserve"], report.get("transformers"), report["num_requests"]
    print(f"{'phase':<24}{'TTFT p50':>10}{'decode/req':>12}{'out tok/s':>11}"
          f"{'cached':>8}{'vs transformers':>17}")
    pairs = [(f"{n} at once, cold", "batch_cold", "batch"),
             (f"{n} at once, warm cache", "batch_warm", "batch"),
             ("one at a time, cold", "single_cold", "single"),
             ("one at a time, warm", "single_warm", "single")]
    for name, key, hkey in pairs:
        r = z[key]
        ratio = "" if h is None else f"{r['output_tok_s'] / h[hkey]['output_tok_s']:.2f}x"
        print(f"{name:<24}{r['ttft_p50_s']:>9.2f}s{r['decode_tok_s_per_request'] or 0:>12.1f}"
              f"{r['output_tok_s']:>11.1f}{r['cached_tokens_p50']:>8.0f}{ratio:>17}")
    pair = report.get("llama_pair")
    if pair is not None:
        print("\nthe chat route, cold, against llama-server --mmproj (the same weights, GGUF):")
        for name, key in ((f"{n} at once", "batch"), ("one at a time", "single")):
            zs, ll = pair["zserve"][key], pair["llama"][key]
            print(f"{name:<24} zserve TTFT {zs['ttft_p50_s']:.2f}s, "
                  f"{zs['decode_tok_s_per_request'] or 0:.1f} tok/s a request, "
                  f"{zs['output_tok_s']:.1f} out tok/s | llama-server TTFT "
                  f"{ll['ttft_p50_s']:.2f}s, {ll['decode_tok_s_per_request'] or 0:.1f}, "
                  f"{ll['output_tok_s']:.1f} | {zs['output_tok_s'] / ll['output_tok_s']:.2f}x")
    if h is not None:
        for name, key in ((f"transformers, {n} batched", "batch"),
                          ("transformers, one at a time", "single")):
            r = h[key]
            print(f"{name:<24}{r['ttft_p50_s']:>9.2f}s{r['decode_tok_s_per_request'] or 0:>12.1f}"
                  f"{r['output_tok_s']:>11.1f}")
    print(f"prompt tokens per request: {z['batch_cold']['prompt_tokens']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Images in: zserve vs transformers.")
    p.add_argument("--model-path", help="a SmolVLM checkpoint directory (default: the "
                   f"SmolVLM-256M-shaped random one, built in {DEFAULT_DIR})")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--single", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--server-args", default="", help="extra launch.py flags")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", help="write the report here too")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    p.add_argument("--llama-model", help="the text model as GGUF")
    p.add_argument("--llama-mmproj", help="its vision projector as GGUF (--mmproj)")
    p.add_argument("--llama-threads", type=int, default=2)
    args = p.parse_args(argv)
    model = pathlib.Path(args.model_path) if args.model_path else \
        build_checkpoint(pathlib.Path(DEFAULT_DIR))
    imgs = pictures(args.num_requests + args.single + 1)
    report = {"model": str(model), "num_requests": args.num_requests,
              "output_len": args.output_len,
              "zserve": run_zserve(model, [b64png(im) for im in imgs], args)}
    if args.llama_server:
        report["llama_pair"] = run_llama_pair(model, [b64png(im) for im in imgs], args)
    if not args.skip_hf:
        report["transformers"] = run_hf(model, imgs, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
