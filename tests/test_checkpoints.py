"""The tiny checkpoints and the greedy reference: builds are bit-reproducible, the tokenizer
round-trips any text, every family loads in transformers with clear greedy margins and
varied output, and the cache builds once."""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import subprocess
import sys

import pytest

from checkpoints import tiny
from tests.reference import assert_greedy_match, greedy_reference

REPO = pathlib.Path(__file__).resolve().parent.parent

PROMPTS = [
    "Hello, world!",
    "The quick brown fox",
    "今天天气很好",
    "def fibonacci(n):",
    "Emoji: 😀 🇯🇵 👨‍👩‍👧‍👦",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox.",
    "中文：今天天气很好，我们去公园散步吧。",
    "日本語：こんにちは、世界！カタカナと漢字。",
    "naïve café résumé, Łódź, Größe, ¿Dónde está? e\u0301 (combining acute)",
    "👨‍👩‍👧‍👦 👩🏾‍🔬 🏳️‍🌈 🇯🇵🇫🇷 1️⃣ #️⃣ ❤️ 👍🏽",
    "not in the corpus: 鬱 龘 𠜎 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ \u200b zero-width",
    "  leading spaces\n\ttabs\r\nand trailing  ",
    "def f(x: int) -> int:\n    return x ** 2  # 平方 🐍\n",
]


def _files(d: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
    """One seed-0 checkpoint per family, shared by the tests in this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: tiny.build_tiny_checkpoint(root / f, f) for f in tiny.FAMILIES}


# --- reproducibility --------------------------------------------------------------------


def test_rebuild_with_same_seed_is_bit_identical(built, tmp_path):
    again = _files(tiny.build_tiny_checkpoint(tmp_path / "again", "llama", seed=0))
    first = _files(built["llama"])
    assert set(again) >= {"config.json", "generation_config.json", "model.safetensors",
                          "tokenizer.json", "tokenizer_config.json"}
    assert again == first

    other = _files(tiny.build_tiny_checkpoint(tmp_path / "seed1", "llama", seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_build_in_another_process_is_bit_identical(built, tmp_path):
    # A fresh interpreter with a different hash seed, through the CLI: catches any
    # dependence on hash order (Python's or the Rust trainer's) or on process state.
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "checkpoints.tiny", "--family", "qwen3",
                    "--out", str(out)], cwd=REPO, env=env, check=True, capture_output=True)
    assert _files(out) == _files(built["qwen3"])


def test_families_have_distinct_weights(built):
    # llama and mistral share parameter names; the family is mixed into the seed.
    blobs = {f: (built[f] / "model.safetensors").read_bytes() for f in tiny.FAMILIES}
    assert len(set(blobs.values())) == len(blobs)


# --- tokenizer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(built["llama"]))


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


def test_tokenizer_specials_vocab_and_chat_template(tokenizer):
    assert 600 <= len(tokenizer) <= 1000
    assert tokenizer.convert_tokens_to_ids(tiny.SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>",
                                                                                "<pad>")
    # Every byte has its own token, and multi-byte text learned merges (CJK, emoji).
    vocab = tokenizer.get_vocab()
    from tokenizers.pre_tokenizers import ByteLevel
    assert all(ch in vocab for ch in ByteLevel.alphabet())
    assert len(tokenizer.encode("今天天气很好", add_special_tokens=False)) < 18

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not tokenizer.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(3) == 3 and ids.count(4) == 2  # specials are single tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\n你好\n" \
                                                             "assistant\n"


# --- models -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_family_loads_with_clear_greedy_margins(built, tokenizer, family):
    from transformers import AutoConfig, GenerationConfig

    from tests.reference import _load

    d = built[family]
    config = AutoConfig.from_pretrained(d)
    assert config.model_type == family
    assert (config.vocab_size, config.max_position_embeddings) == (len(tokenizer), 512)
    assert (config.bos_token_id, config.eos_token_id) == (0, 1)
    assert GenerationConfig.from_pretrained(d).eos_token_id == [1, 4]

    model = _load(d)  # the reference's cached copy
    names = set(dict(model.named_parameters()))
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == config.tie_word_embeddings == (family in ("qwen2", "mistral"))
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    if family == "qwen3":
        assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
        assert "model.layers.0.self_attn.q_norm.weight" in names

    margins, outputs = [], []
    for prompt in PROMPTS:
        ids, m = greedy_reference(d, tokenizer.encode(prompt), 48)
        margins += m
        outputs.append(ids)
    # Clear greedy choices: a typical margin is ~2 logits, near-ties are rare.
    assert statistics.median(margins) > 0.5
    assert sum(m < 1e-3 for m in margins) <= len(margins) // 100
    # No collapse: continuations vary within a prompt and across prompts.
    assert all(len(set(ids)) >= 12 for ids in outputs)
    assert len({tuple(ids) for ids in outputs}) == len(PROMPTS)


def test_greedy_reference_matches_hf_generate(built):
    import torch

    from tests.reference import _load

    prompt = [0, 300, 301, 302, 5, 77]
    ids, margins = greedy_reference(built["qwen2"], prompt, 24)
    assert len(ids) == len(margins) == 24 and min(margins) >= 0
    out = _load(built["qwen2"]).generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
        eos_token_id=None, pad_token_id=2)
    assert out[0, len(prompt):].tolist() == ids


def test_assert_greedy_match():
    ref = [5, 6, 7, 8]
    assert_greedy_match([5, 6, 7, 8], ref, [1.0, 1.0, 1.0, 1.0])
    # A near-tie at step 2: only steps 0..1 count, so later divergence or an early stop passes.
    assert_greedy_match([5, 6, 9, 9, 9], ref, [1.0, 1.0, 1e-5, 1.0])
    assert_greedy_match([5, 6], ref, [1.0, 1.0, 1e-5, 1.0])
    with pytest.raises(AssertionError, match="mismatch at step 1"):
        assert_greedy_match([5, 9, 7, 8], ref, [1.0, 1.0, 1e-5, 1.0])
    with pytest.raises(AssertionError, match="stopped after 1"):
        assert_greedy_match([5], ref, [1.0, 1.0, 1e-5, 1.0])
    with pytest.raises(AssertionError, match="length mismatch"):
        assert_greedy_match([5, 6, 7], ref, [1.0, 1.0, 1.0, 1.0])
    with pytest.raises(AssertionError, match="mismatch at step 3"):
        assert_greedy_match([5, 6, 7, 0], ref, [1.0, 1.0, 1.0, 1.0])


# --- cache ------------------------------------------------------------------------------


def test_ensure_checkpoint_builds_once(built, tmp_path):
    path = tiny.ensure_checkpoint("llama", root=tmp_path)
    assert path == tmp_path / f"tiny-llama-v{tiny.CHECKPOINT_VERSION}"
    assert _files(path) == _files(built["llama"])
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    assert tiny.ensure_checkpoint("llama", root=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dirs left behind


def test_ensure_checkpoint_uses_env_root(built, tmp_path, monkeypatch):
    monkeypatch.setenv("ZSERVE_CACHE", str(tmp_path / "env"))
    path = tiny.ensure_checkpoint("qwen2")
    assert path.parent == tmp_path / "env" and (path / "config.json").is_file()


def test_install_tolerates_a_concurrent_winner(built, tmp_path):
    final = tmp_path / "tiny-llama-v1"
    shutil.copytree(built["llama"], final)      # the other builder finished first
    mine = tmp_path / ".tiny-llama-v1.tmp-x"
    shutil.copytree(built["llama"], mine)
    assert tiny._install(mine, final) == final
    assert not mine.exists() and _files(final) == _files(built["llama"])
