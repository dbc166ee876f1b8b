"""Tiny, reproducible model checkpoints: the server's built-in demo model and the tests' model.

This module owns three things:
- CORPUS, a fixed multilingual text carried in the code, and `build_tokenizer`, which trains
  a byte-level BPE tokenizer on it (ChatML chat template, `<s>` prepended on encode);
- `build_tiny_checkpoint`, which writes a tiny Llama / Qwen2 / Qwen3 / Mistral model (or
  SmolLM3, Qwen3-MoE, Mixtral: `_FAMILY_CONFIG`) with seeded random weights as an ordinary
  Hugging Face directory (config.json, generation_config.json, model.safetensors in float32,
  tokenizer files);
- `ensure_checkpoint`, which builds one such directory once into a cache and returns it.

Everything is a pure function of the code, the seed and the library versions: no clocks, no
host names, no hash-order dependence. Weights come from integer draws of a seeded torch
generator (exact on every CPU), so two machines produce bit-identical files.

The weights are random but scaled so that greedy decoding is well defined (median top-1 /
top-2 logit margin ~2.4, near-ties < 1e-3 in about 1 step of 1000) and does not collapse
into repeating one token, which makes "our greedy == transformers' greedy" a meaningful
test. About a third of generated tokens are lone bytes of multi-byte UTF-8 characters, which
exercises incremental detokenization. The flip side: at temperature 1 the next-token
distribution is peaked (top-1 probability ~0.8), so sampling tests that want variety should
raise the temperature.

CLI: python -m checkpoints.tiny --family llama --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import pathlib
import shutil
import tempfile

from wire.model_path import zserve_cache

# Bump when anything below changes the files produced; it names the cache directory.
CHECKPOINT_VERSION = 2   # 2: RANDOM_WEIGHTS.txt marks the directory

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

# Special tokens take ids 0..4 in this order.
BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# Trainer cap: 256 byte symbols + 5 specials + merges. With min_frequency=2 the trainer
# runs out of pairs first, at 754 tokens (493 merges) for this CORPUS.
TOKENIZER_VOCAB_SIZE = 800

# ChatML, as Qwen uses it. No BOS in the template: the rendered prompt is meant to be
# encoded with add_special_tokens=False (what apply_chat_template(tokenize=True) does).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The lazy dog did not mind; it was a warm
afternoon, and the fox was an old friend. They met every day by the river, where the water
ran slow and clear over smooth grey stones.

A language model reads a sequence of tokens and predicts the next one. To serve it well, a
server batches many requests together, keeps the key and value tensors of past tokens in a
cache, and streams the generated text back to each client as soon as it is ready. When the
memory runs out, some requests are paused and resumed later, and their output stays the same.

Once upon a time, in a small town at the edge of the forest, there lived a baker who woke
every morning at four o'clock. She made bread, rolls and little cakes with honey, and the
whole street smelled of them. People came from far away to buy her bread, and she always
said: "Thank you, come again tomorrow!"

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1000 1024 2048 4096 65536.
Pi is about 3.14159, e is about 2.71828, and the square root of 2 is about 1.41421.
On 2024-03-15 at 09:30:00 the price rose from $19.99 to $24.50 (+22.56%), then fell -3.2%.
Call +1 (555) 010-2368 or write to team@example.com before 5:00 pm.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]

class Cache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.items: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        return self.items.get(key)

for (int i = 0; i < n; i++) { sum += a[i] * b[i]; }
if (x != NULL && x->next == NULL) { return -1; }
SELECT id, name FROM users WHERE age >= 18 ORDER BY name;
{"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0.0}

Français : « Où est la bibliothèque ? » demanda-t-elle. Le garçon répondit : « Là-bas, à côté
du café. » Les élèves étudient l'histoire, la géographie et les mathématiques. Ça va très bien,
merci ! Noël approche, et la forêt est couverte de neige.
Deutsch: Die Straße ist schön, und die Bäume blühen. Über den Brücken fahren Fahrräder.
Grüße aus München! Größe, Höhe und Länge werden gemessen.
Español: ¿Dónde está la estación? ¡Qué día tan bonito! El niño comió una manzana en el jardín.
Mañana será otro día. La canción del corazón.
Português: A informação está disponível. Não há problema, obrigado. São Paulo é uma cidade.
Italiano: Perché la città è così bella? Però il caffè è più buono qui.
Polski, čeština, română: Łódź, Kraków, Žluťoučký kůň úpěl ďábelské ódy. Știință și țară.
Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир! Как дела? Спасибо, хорошо.

中文：今天天气很好，我们去公园散步吧。语言模型可以生成文本，也可以回答问题。
我喜欢读书，也喜欢写字。北京是中国的首都，上海是一个很大的城市。
人工智能正在改变世界。谢谢你的帮助！你好，世界！中文的字符在UTF-8中占三个字节。
日本語：今日はいい天気ですね。東京は日本の首都です。私は本を読むのが好きです。
ありがとうございます。こんにちは、世界！カタカナとひらがなと漢字を使います。
ラーメンとすしが大好きです。さくらの花がきれいに咲いています。
한국어: 안녕하세요, 세계! 감사합니다. 오늘은 날씨가 좋아요.

Emoji: 😀 😃 😄 😁 😂 🤣 😊 😍 🤔 🙏 🎉 🚀 🔥 ✨ 💡 🌍 🍣 🍜 🐍 🦀 ❤️ ✅ ⭐
Families and people: 👨‍👩‍👧‍👦 👩‍💻 👨‍🍳 🧑‍🚀 🏳️‍🌈 👍🏽 👋🏿 🙌🏻 👩🏾‍🔬
Flags: 🇯🇵 🇨🇳 🇫🇷 🇩🇪 🇺🇸 🇧🇷 🇰🇷. Keycaps: 1️⃣ 2️⃣ 3️⃣ #️⃣.
Mixed: I love 寿司 🍣 and ramen 🍜! C'est très bon 👍🏽. 你好 👋, こんにちは 🌸, naïve café résumé.
Symbols: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ↑ ↓ © ® ™ € £ ¥ ° ± × ÷ µ ½ ¼ ¾ • … — – “quotes” ‘single’.

The quick brown fox jumps over the lazy dog again, and again, and again. The dog sleeps.
Hello, world! Hello there. How are you today? I am fine, thank you. What is your name?
My name is Tiny. I am a small model. I can count: one, two, three, four, five, six, seven.
The server said hello to the client, and the client said hello back to the server.
"""


# ---------------------------------------------------------------------------------------
# Tokenizer


def _train_tokenizer():
    """The trained `tokenizers.Tokenizer` (byte-level BPE over CORPUS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # GPT-2 style: the regex splits words/numbers/punctuation, bytes map to printable chars.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    # The trainer's merge order breaks count ties by pair ids, and ids are fixed by the
    # sorted byte alphabet, so the result does not depend on hash order or thread count
    # (tests/test_checkpoints.py rebuilds in a fresh process to check).
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def build_tokenizer(out_dir, extra_special: tuple[str, ...] = (),
                    chat_template: str = CHAT_TEMPLATE) -> None:
    """Train the byte-level BPE tokenizer on CORPUS and save it (transformers format).

    Special tokens <s> (bos), </s> (eos), <pad>, <|im_start|>, <|im_end|> get ids 0..4;
    `extra_special` ones (a vision model's image tokens) follow the trained vocabulary;
    encoding with add_special_tokens=True prepends <s>; the chat template is ChatML."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END, *extra_special],
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
        model_max_length=512,
    )
    hf_tok.save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------------------
# Models

# The common tiny shape; each family adds what makes it that family.
_BASE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
)

# Vary tying and head_dim across families so the loader's paths all get exercised:
# llama/qwen3 untied, qwen2/mistral tied; qwen2 has q/k/v biases (always, in transformers);
# qwen3 has head_dim 32 != 64 / 4 and per-head q_norm / k_norm. (A tied qwen3 at this size
# falls into loops under greedy decoding, hence untied, like the larger Qwen3 models.)
# Mistral's sliding window is off: at 512 positions it would never take effect anyway.
_FAMILY_CONFIG = {
    "llama": dict(tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "qwen2": dict(tie_word_embeddings=True, use_sliding_window=False),
    "qwen3": dict(tie_word_embeddings=False, head_dim=32, attention_bias=False,
                  use_sliding_window=False),
    "mistral": dict(tie_word_embeddings=True, sliding_window=None),
    # not in FAMILIES: Mistral with a window of 8 and head_dim 32 (decode rows on our
    # attention kernel, through the window's table), for tests/test_engine.py.
    "mistral_window": dict(tie_word_embeddings=True, sliding_window=8, head_dim=32),
    # not in FAMILIES (the shared test matrix): tests/test_smollm3.py builds it itself.
    # Every second layer without RoPE, so both kinds run in two layers.
    "smollm3": dict(tie_word_embeddings=False, no_rope_layer_interval=2),
    # Gemma (tests/test_gemma.py): a local then a global layer, a window of 8 positions so
    # every test prompt reaches past it, a query scale that is not head_dim's, GeGLU.
    # Gemma 2's score cap is low enough to bite (its models use 50). Untied: a tied
    # Gemma's logits would be the embedding scaled down by sqrt(hidden) (_init_weights).
    "gemma2": dict(tie_word_embeddings=False, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=8, attn_logit_softcapping=10.0, final_logit_softcapping=30.0,
                   hidden_activation="gelu_pytorch_tanh"),
    "gemma3": dict(tie_word_embeddings=False, head_dim=32, query_pre_attn_scalar=48,
                   sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                   hidden_activation="gelu_pytorch_tanh"),
    # not in FAMILIES either: tests/test_phi3.py. Phi-4-mini's partial rotary (0.75 of the
    # heads of 16: 12 dims, 6 frequencies) and Phi-3's longrope, with an original context of
    # 64 of the 512 positions, so that prompts and generations cross from the short factors
    # to the long ones (and an attention factor of sqrt(1 + ln 8 / ln 64)).
    "phi3": dict(tie_word_embeddings=False, sliding_window=None, partial_rotary_factor=0.75,
                 original_max_position_embeddings=64,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.0, 1.05, 1.1, 1.2, 1.4],
                                  "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}),
    # Mixtures of experts, not in FAMILIES either: tests/test_moe.py builds them. Qwen3-MoE:
    # 8 experts, top 2 of them as they come (norm_topk_prob off), its second layer dense;
    # Mixtral: 4 experts of intermediate_size, top 2 renormalized (always), every layer.
    "qwen3_moe": dict(tie_word_embeddings=False, head_dim=32, attention_bias=False,
                      use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1]),
    "mixtral": dict(tie_word_embeddings=False, sliding_window=None, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64),
}
# transformers' model_type where it is not the family's name.
_MODEL_TYPE = {"gemma3": "gemma3_text", "mistral_window": "mistral"}


def _config(family: str, vocab_size: int, special_ids: dict[str, int], overrides: dict):
    from transformers import AutoConfig

    if family not in _FAMILY_CONFIG:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    kwargs = {**_BASE_CONFIG, **_FAMILY_CONFIG[family], **overrides}
    kwargs.update(vocab_size=vocab_size, bos_token_id=special_ids[BOS],
                  eos_token_id=special_ids[EOS], pad_token_id=special_ids[PAD])
    config = AutoConfig.for_model(_MODEL_TYPE.get(family, family), **kwargs)
    config.dtype = "float32"
    return config


def _stable_seed(seed: int, family: str, name: str) -> int:
    """A 63-bit seed for one parameter: independent of module order and of other params,
    and different per family (llama and mistral share parameter names)."""
    digest = hashlib.sha256(f"zserve-tiny:{family}:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _uniform(shape, seed: int):
    """Uniform [-1, 1) float32 from integer draws: exact, so identical on every CPU.

    (torch.randn's vectorized CPU path uses approximate log/cos that may differ between
    instruction sets; integer draws from the Mersenne Twister and the exact scaling below
    cannot.)"""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 1 << 24, tuple(shape), generator=gen, dtype=torch.int64)
    return (ints - (1 << 23)).to(torch.float32) * (2.0 ** -23)


# Per-parameter values, from U(-1, 1) draws u (std 1/sqrt(3)):
#  - embed_tokens and an untied lm_head: std 1 (sqrt(3) * u). The final norm's gain then
#    sets the logit spread for tied and untied models alike: logits have std about
#    FINAL_NORM_GAIN * sqrt(hidden_size) (~12), which gives clear greedy margins (median ~2.4).
#  - linear layers: LINEAR_GAIN / sqrt(fan_in) in std. A gain > 1 makes attention and MLP
#    matter next to the embedding in the residual stream, so continuations depend on the
#    context, vary across prompts, and do not just echo the input token (which a tied model
#    whose residual is dominated by its input embedding would do forever).
#  - other norms 1 + NORM_NOISE * u and biases BIAS_SCALE * u: non-trivial on purpose, so a
#    loader that drops a norm or a bias produces different greedy ids.
#  - a mixture of experts' router ("gate") is a linear layer too: its logits then have std
#    about LINEAR_GAIN, so the top experts stand clear of the rest (routing is decisive)
#    and each token's choice varies; each expert's stacked [E, out, in] weights
#    ("experts.gate_up_proj", "experts.down_proj") are E linear layers, scaled by fan-in.
LINEAR_GAIN = 4.0
FINAL_NORM_GAIN = 1.5
NORM_NOISE = 0.25
BIAS_SCALE = 0.5
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj",     # Phi-3 keeps q/k/v and gate/up fused
           "gate")                         # a mixture of experts' router


def _init_weights(model, family: str, seed: int) -> None:
    """Overwrite every parameter with seeded, scaled uniform noise (see the rules above)."""
    import torch

    from models.config import GEMMA_FAMILIES   # (1 + weight) norms, embeddings x sqrt(d)

    sqrt3 = math.sqrt(3.0)
    with torch.no_grad():
        # named_parameters yields a tied lm_head once, as embed_tokens.
        for name, param in sorted(model.named_parameters()):
            u = _uniform(param.shape, _stable_seed(seed, family, name))
            # e.g. "q_proj" from "...self_attn.q_proj.weight"; a bare parameter names itself
            # ("gate_up_proj" from "...mlp.experts.gate_up_proj")
            parts = name.split(".")
            leaf = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
            offset = 1.0 if family in GEMMA_FAMILIES else 0.0   # Gemma: (1 + weight)
            if name == "model.norm.weight":
                value = FINAL_NORM_GAIN * (1.0 + NORM_NOISE * u) - offset
            elif name.endswith("norm.weight"):
                value = 1.0 + NORM_NOISE * u - offset
            elif name.endswith(".bias"):
                value = BIAS_SCALE * u
            elif leaf == "embed_tokens" and family in GEMMA_FAMILIES:   # std 1 x sqrt(d)
                value = sqrt3 * u / math.sqrt(param.shape[1])
            elif leaf in ("embed_tokens", "lm_head"):
                value = sqrt3 * u
            elif leaf in _LINEAR:
                value = LINEAR_GAIN * sqrt3 / math.sqrt(param.shape[-1]) * u   # fan-in
            else:
                raise RuntimeError(f"no init rule for parameter {name}")
            param.copy_(value)


def build_tiny_checkpoint(out_dir, family: str, seed: int = 0,
                          **config_overrides) -> pathlib.Path:
    """Write a tiny `family` model with seeded random weights, plus the tokenizer, to out_dir.

    family is one of FAMILIES; config_overrides replace config fields (e.g.
    num_hidden_layers=4, tie_word_embeddings=True). Returns out_dir as a Path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    special_ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    config = _config(family, len(tok), special_ids, config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    _init_weights(model, family, seed)
    model.eval()
    # Stop on </s> and, for chat, on <|im_end|> (as Qwen instruct models declare it).
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[BOS],
        eos_token_id=[special_ids[EOS], special_ids[IM_END]],
        pad_token_id=special_ids[PAD],
    )
    model.save_pretrained(str(out), safe_serialization=True)
    # The launcher warns when it serves a directory marked so (wire/model_path.py).
    (out / "RANDOM_WEIGHTS.txt").write_text(
        "zserve's tiny test checkpoint: seeded random weights, its text is gibberish.\n")
    return out


# ---------------------------------------------------------------------------------------
# Cache


def default_cache_root() -> pathlib.Path:
    """$ZSERVE_CACHE, else ~/.cache/zserve."""
    return zserve_cache()


def checkpoint_dir_name(family: str) -> str:
    return f"tiny-{family}-v{CHECKPOINT_VERSION}"


def _install(tmp: pathlib.Path, final: pathlib.Path) -> pathlib.Path:
    """Atomically move a finished build into place; if another builder won, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        # rename(2) onto an existing non-empty directory fails (ENOTEMPTY / EEXIST): a
        # concurrent builder got there first, and its directory is complete by construction.
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise
    return final


def ensure_checkpoint(family: str = "llama", root=None) -> pathlib.Path:
    """The cached tiny checkpoint for `family` (seed 0, default config; a text family of
    _FAMILY_CONFIG or a vision one of tiny_vision.VISION_FAMILIES), built on first use.

    Lives in root (default: default_cache_root()) / tiny-{family}-v{CHECKPOINT_VERSION}. The
    directory only ever appears complete: it is built under a temporary name in the same
    parent and renamed into place, so concurrent callers are safe."""
    from checkpoints.tiny_vision import BUILDERS, VISION_FAMILIES
    if family not in (*_FAMILY_CONFIG, *VISION_FAMILIES):
        raise ValueError(f"unknown family {family!r}; expected one of "
                         f"{(*_FAMILY_CONFIG, *VISION_FAMILIES)}")
    root = pathlib.Path(root) if root is not None else default_cache_root()
    root = root.expanduser().absolute()  # children may run with another cwd
    final = root / checkpoint_dir_name(family)
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache entry should be readable
        BUILDERS.get(family, build_tiny_checkpoint)(tmp, family)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _install(tmp, final)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight HF checkpoint.")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_checkpoint(args.out, args.family, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
