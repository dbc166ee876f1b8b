"""A Hugging Face tokenizer without transformers, and so without torch.

`HFTokenizer.from_dir(path)` loads from a model directory what transformers 5's
`AutoTokenizer.from_pretrained(path)` loads for a fast tokenizer, and gives the same results
on everything zserve uses: encode, decode, convert_ids_to_tokens, the special tokens and their
ids, len() (added tokens included), and apply_chat_template rendered by jinja2 the way
transformers renders it. transformers 5 imports torch on import (~4 s and ~300 MB per
process); the tokenizer, detokenizer and API processes need neither. tests/test_hf_tokenizer.py
holds the two side by side.

What is reproduced, read from transformers 5.24 (tokenization_utils_base.py,
tokenization_utils_tokenizers.py, models/auto/tokenization_auto.py,
models/qwen2/tokenization_qwen2.py, utils/chat_template_utils.py):

- The pipeline is tokenizer.json's (transformers' TokenizersBackend), with one exception:
  where AutoTokenizer picks Qwen2Tokenizer (config.json model_type "qwen2" always; or
  tokenizer_class Qwen2Tokenizer), that class rebuilds the pipeline from tokenizer.json's
  vocabulary and merges with Qwen's NFC normalizer and pre-tokenizer regex. Real Qwen
  checkpoints spell the same pipeline in their tokenizer.json; our tiny qwen2 does not.
  Other classes that rebuild their pipeline (LlamaTokenizer for SentencePiece-style Llama-2,
  GPT2Tokenizer, ...) and remote code (auto_map) are not reproduced: for them the file is
  followed, which is what their rebuild is meant to equal.
- Special tokens come from tokenizer_config.json (special_tokens_map.json too when the
  config has no added_tokens_decoder), and each named or extra special token that is not
  already an added token becomes one, marked special, as transformers adds them at load.
  The `add_bos_token` / `add_eos_token` keys are ignored when there is a tokenizer.json:
  BOS/EOS on encode come from its post-processor alone.
- encode never truncates or pads (transformers' defaults). decode is the backend's;
  `spaces_between_special_tokens` is accepted and ignored, as transformers' fast tokenizers
  ignore it; clean_up_tokenization_spaces applies only to non-BPE models, as there.
- Chat templates: chat_template.jinja and additional_chat_templates/*.jinja over
  tokenizer_config.json's `chat_template` (a string or a list of named templates), rendered
  in an ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks) with loopcontrols,
  `{% generation %}`, the tojson filter, the raise_exception / strftime_now / dict /
  namespace globals, and the special tokens (bos_token, eos_token, ...) as variables.
  Unlike transformers, a render is bounded in time and size (TemplateLimitError; see
  "chat templates: bounded").

generation_config.json is not read: nothing a tokenizer does depends on it (the scheduler
reads its eos ids). Not thread-safe to mutate; encode and decode do not mutate.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES, in its order.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")

# models/qwen2/tokenization_qwen2.py
_QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"""
                r"""\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# A chat template's render, bounded (see "chat templates: bounded" below): past either
# limit it fails with TemplateLimitError.
RENDER_SECONDS = 5.0        # 100k tiny messages (an 8 MB body) render in ~1.5 s on a busy core
RENDER_CHARS = 1 << 26      # 64 Mi characters: past any context window's worth of text


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus what transformers keeps beside it.

    `special_tokens` maps attribute names (bos_token, eos_token, ..., and model-specific
    ones such as image_token) to tokens; with `extra_special_tokens` and `added_tokens`
    (declared added tokens, re-added as transformers does) they are made added tokens of
    `backend` here, so the backend is modified: pass one this object may own.
    """

    def __init__(self, backend: Tokenizer, special_tokens: dict | None = None,
                 extra_special_tokens=(), added_tokens=(), chat_template=None,
                 clean_up_tokenization_spaces: bool = False, clean_up_for_bpe: bool = False,
                 split_special_tokens: bool = False):
        self._tok = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._extra = list(extra_special_tokens)
        self.chat_template = chat_template      # str, {name: str}, or None
        self.render_seconds, self.render_chars = RENDER_SECONDS, RENDER_CHARS
        self._clean_up = clean_up_tokenization_spaces and (
            clean_up_for_bpe or type(backend.model).__name__ != "BPE")
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = split_special_tokens
        self._add_tokens(list(added_tokens))

    def _add_tokens(self, tokens_to_add: list) -> None:
        """TokenizersBackend.__init__: every declared added token, then each named or extra
        special token that is not an added token yet; named ones are marked special."""
        encoder = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        encoder += [str(t) for t in tokens_to_add]
        for token in [*self._special.values(), *self._extra]:
            if str(token) not in encoder and token not in tokens_to_add:
                tokens_to_add.append(token)
        named = [str(t) for t in self._special.values()]
        tokens = []
        for token in tokens_to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            tokens.append(token)
        if tokens:
            self._tok.add_tokens(tokens)

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """What AutoTokenizer.from_pretrained(path) loads, from the same files."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are "
                                    f"supported)")
        config, explicit = _tokenizer_config(path)
        qwen2 = _loads_as_qwen2(config, _read_json(path / "config.json"))
        backend, in_file = _qwen2_backend(path, config) if qwen2 else _file_backend(path)
        added = _declared_added_tokens(config, in_file, path, explicit)
        special, extra = _special_tokens(config, added, explicit, qwen2)
        tok = cls(backend, special, extra, added, _chat_template(config),
                  clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces")),
                  clean_up_for_bpe=bool(config.get(
                      "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")),
                  split_special_tokens=bool(config.get("split_special_tokens")))
        if qwen2:   # Qwen2Tokenizer.__init__ ends by (re-)adding every special token
            tok._tok.add_tokens([AddedToken(t, special=True) for t in tok.all_special_tokens])
        return tok

    # ---- what the processes use ---------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tok

    def __len__(self) -> int:
        """The vocabulary with the added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without the added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A token's id; the unk token's for an unknown one (None without an unk token)."""
        if not isinstance(tokens, str):
            return [self.convert_tokens_to_ids(t) for t in tokens]
        found = self._tok.token_to_id(tokens)
        if found is None and self._special.get("unk_token") is not None:
            return self._tok.token_to_id(str(self._special["unk_token"]))
        return found

    # ---- special tokens -----------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (bos_token, ..., model-specific ones) as strings."""
        return {k: str(v) for k, v in self._special.items()}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(),
                                   *(str(t) for t in self._extra)]))

    @property
    def all_special_ids(self) -> list[int | None]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def special_token_id(self, name: str) -> int | None:
        """The id of a named special token, e.g. "eos_token"; None if it has none."""
        token = self._special.get(name)
        return None if token is None else self.convert_tokens_to_ids(str(token))

    @property
    def bos_token_id(self) -> int | None:
        return self.special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.special_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.special_token_id("pad_token")

    # ---- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tools: list[dict] | None = None, **template_kwargs) -> str:
        """The rendered conversation (transformers' apply_chat_template(tokenize=False)),
        to be encoded with add_special_tokens=False. `tools`: OpenAI tool definitions, for
        templates that render them; `template_kwargs`: extra template variables (a chat
        request's chat_template_kwargs, e.g. enable_thinking). Raises ValueError without a
        template, jinja2's errors (TemplateError from raise_exception) on a failing one,
        TemplateLimitError on one that runs past `render_seconds` or whose output (or any
        value it builds) would pass `render_chars` characters (see "chat templates:
        bounded"). The bounds are attributes, not arguments: template_kwargs come from
        clients."""
        template = self._template(tools)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens_map, **template_kwargs}
        return _render(_compile(template), _Budget(self.render_seconds, self.render_chars),
                       messages=messages, tools=tools, documents=None,
                       add_generation_prompt=add_generation_prompt, **variables)

    def uses_tools(self, tools: list[dict] | None = None) -> bool:
        """Whether the chat template renders `tools` at all (else the model never sees
        them, and the caller must describe them another way)."""
        try:
            return "tools" in self._template(tools)
        except ValueError:
            return False

    def _template(self, tools: list[dict] | None = None) -> str:
        """PreTrainedTokenizerBase.get_chat_template(None, tools)."""
        template = self.chat_template
        if isinstance(template, dict):
            if tools and "tool_use" in template:
                return template["tool_use"]
            if "default" not in template:
                raise ValueError(f"This model has multiple chat templates with no default: "
                                 f"{sorted(template)}.")
            return template["default"]
        if template is None:
            raise ValueError("This tokenizer has no chat template.")
        return template


# ---- loading helpers --------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _tokenizer_config(path: Path) -> tuple[dict, dict]:
    """tokenizer_config.json as transformers' _from_pretrained prepares it, with the chat
    template files; and the model-specific special tokens given as strings (image_token...)."""
    config = _read_json(path / "tokenizer_config.json")
    for key in ("init_inputs", "add_bos_token", "add_eos_token"):
        config.pop(key, None)
    templates = _template_files(path)
    if list(templates) == ["default"]:
        config["chat_template"] = templates["default"]
    elif templates:
        config["chat_template"] = templates
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    explicit = {k: config.pop(k) for k in list(config) if k not in NAMED_TOKENS
                and k.endswith("_token") and isinstance(config[k], str)}
    if isinstance(config.get("extra_special_tokens"), dict):
        explicit.update(config.pop("extra_special_tokens"))
    return config, explicit


def _loads_as_qwen2(config: dict, model_config: dict) -> bool:
    """Whether AutoTokenizer picks Qwen2Tokenizer (models/auto/tokenization_auto.py: the
    model type "qwen2" overrides whatever the config declares; qwen3's mapping applies
    only when nothing is declared)."""
    declared = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    model_type = model_config.get("model_type")
    return config.get("auto_map") is None and (
        model_type == "qwen2" or (declared or "").removesuffix("Fast") == "Qwen2Tokenizer"
        or (declared is None and model_type == "qwen3"))


def _file_backend(path: Path) -> tuple[Tokenizer, dict[int, AddedToken]]:
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    return backend, backend.get_added_tokens_decoder()


def _special_tokens(config: dict, added: list[AddedToken], explicit: dict,
                    qwen2: bool) -> tuple[dict, list]:
    """The named special tokens (standard ones, then model-specific ones) and the extra
    ones; a named token that is a declared added token is that AddedToken."""
    config = _added_token_objects(config)
    by_content = {t.content: t for t in added}
    special = {k: config.get(k) for k in NAMED_TOKENS}
    for key, token in special.items():
        if token is not None and by_content:
            special[key] = by_content.get(str(token), token)
    if qwen2:   # Qwen2Tokenizer's defaults
        for key in ("unk_token", "eos_token", "pad_token"):
            if key not in config:
                special[key] = "<|endoftext|>"
    if "additional_special_tokens" in config and "extra_special_tokens" not in config:
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    auto = {k: v for k, v in config.items() if k not in NAMED_TOKENS and k.endswith("_token")
            and isinstance(v, (str, AddedToken))}
    return {**special, **auto, **explicit}, list(config.get("extra_special_tokens") or [])


def _chat_template(config: dict) -> str | dict | None:
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):      # named templates, as the config stores them
        return {t["name"]: t["template"] for t in template}
    return template


def _template_files(path: Path) -> dict[str, str]:
    """chat_template.jinja as "default", additional_chat_templates/NAME.jinja as NAME."""
    templates = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for file in extra.glob("*.jinja"):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    return templates


def _declared_added_tokens(config: dict, in_file: dict[int, AddedToken], path: Path,
                           explicit: dict) -> list[AddedToken]:
    """The added tokens transformers re-adds, by id: the config's added_tokens_decoder, or
    else tokenizer.json's (`in_file`), after merging special_tokens_map.json into `config`."""
    if "added_tokens_decoder" in config:
        declared = {int(i): AddedToken(**t) for i, t in config.pop("added_tokens_decoder").items()}
        return [declared[i] for i in sorted(declared)]
    for key, value in _read_json(path / "special_tokens_map.json").items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            merged = list(config.get("extra_special_tokens") or [])
            for token in value:
                if isinstance(token, dict):
                    token = AddedToken(**{k: v for k, v in token.items() if k != "special"},
                                       special=True)
                if token not in merged:
                    merged.append(token)
            value = merged
        config[key] = value
    if isinstance(config.get("extra_special_tokens"), dict):
        explicit.update(config.pop("extra_special_tokens"))
    return [in_file[i] for i in sorted(in_file)]


def _added_token_objects(obj):
    """transformers' convert_added_tokens: {"__type": "AddedToken", ...} dicts, anywhere."""
    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in obj.items() if k != "__type"})
    if isinstance(obj, (list, tuple)):
        return [_added_token_objects(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _added_token_objects(v) for k, v in obj.items()}
    return obj


def _qwen2_backend(path: Path, config: dict) -> tuple[Tokenizer, dict[int, AddedToken]]:
    """Qwen2Tokenizer's pipeline over tokenizer.json's vocabulary and merges, with the
    file's post-processor (convert_to_native_format + Qwen2Tokenizer.__init__); and the
    file's added tokens, which the rebuilt backend does not have yet."""
    spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(BPE(vocab=model["vocab"], merges=merges, dropout=None, unk_token=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")),
                                 use_regex=False)])
    # The post-processor, read from the file without its vocabulary (as transformers does).
    minimal = {**spec, "added_tokens": [], "model": {
        **{k: v for k, v in model.items() if k not in ("vocab", "merges")},
        "vocab": {}, "merges": []}}
    post_processor = Tokenizer.from_str(json.dumps(minimal)).post_processor
    if post_processor is not None:
        tok.post_processor = post_processor
    in_file = {a["id"]: AddedToken(**{k: v for k, v in a.items() if k != "id"})
               for a in spec.get("added_tokens") or []}
    return tok, in_file


def _clean_up_tokenization(text: str) -> str:
    """PreTrainedTokenizerBase.clean_up_tokenization."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text


# ---- chat templates: transformers' jinja environment ------------------------------------------

@lru_cache(maxsize=16)
def _compile(template: str):
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment():
    """utils/chat_template_utils.py's _cached_compile_jinja_template, less the assistant-mask
    tracking (a `{% generation %}` block renders its body)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Not jinja's own filter, which escapes HTML characters.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # dict() without the dict class itself: no attribute access to break out with
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # A namespace that refuses underscore attributes (CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, but got {name!r}. Please rename the attribute.")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The budget's checks (see "chat templates: bounded") where a template spends: each
        loop item, call, filter and output chunk, and the operators that build big values."""
        intercepted_binops = frozenset(("*", "**", "%"))   # also keeps them from folding

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in list(tree.find_all(jinja2.nodes.For)):     # for x in guard(items)
                loop.iter = jinja2.nodes.Call(jinja2.nodes.Name(_LOOP_GUARD, "load"),
                                              [loop.iter], [], None, None, lineno=loop.lineno)
            tree.set_environment(self)
            return tree

        def call(self, context, obj, /, *args, **kwargs):
            if (budget := _BUDGET.get()) is None:
                return super().call(context, obj, *args, **kwargs)
            budget.tick()
            budget.check_method(obj, args)
            return budget.checked(super().call(context, obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            if (budget := _BUDGET.get()) is not None:
                budget.check_binop(operator, left, right)
            value = super().call_binop(context, operator, left, right)
            return value if budget is None else budget.checked(value)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    env.globals[_LOOP_GUARD] = _Guarded
    return env


# ---- chat templates: bounded -------------------------------------------------------------------
#
# A chat template is code from the model's files, run on every chat request in the one
# tokenizer worker (and in the API process for /tokenize): a heavy one (a loop nest, a
# string repeated a billion times) would stall every request behind it. jinja's sandbox
# bounds what a template may touch, and range() to 100,000 items, not what it may spend.
# So a render gets a budget: RENDER_SECONDS of time, checked at each loop item (every `for`
# iterates through _Guarded), call, filter and output chunk; and RENDER_CHARS characters,
# for the output and for any string or list a call, filter or operator returns, with the
# operations that would build a bigger one in a single step (`s * n`, `%` and format()
# widths, ljust/center/zfill, replace, int ** int) refused before they run. Past either,
# TemplateLimitError, which the tokenizer answers with a 400. Not bounded: the time of one
# step that is none of these (e.g. sorting a long list: linear-log in the request's size).

_LOOP_GUARD = "zserve_loop_guard"
_INT_BITS = 1 << 20         # the largest integer an operator may build (~315,000 digits)


class TemplateLimitError(RuntimeError):
    """A chat template ran past its time or size budget."""


class _Budget:
    __slots__ = ("seconds", "chars", "deadline")

    def __init__(self, seconds: float, chars: int):
        self.seconds, self.chars = seconds, chars
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"it ran for more than {self.seconds:g} s (zserve's "
                                     f"bound on rendering a chat template)")

    def refuse(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(f"{what} would be over {self.chars} characters (zserve's "
                                  f"bound on a chat template's output)")

    def checked(self, value):
        if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > self.chars:
            raise self.refuse(f"a value of {len(value)} items")
        return value

    def check_size(self, n: int, what: str) -> None:
        if n > self.chars:
            raise self.refuse(what)

    def check_method(self, obj, args: tuple) -> None:
        """A str method that builds a string bigger than its inputs, checked before it runs
        (str.format comes wrapped by the sandbox: its __wrapped__ is the method)."""
        method = getattr(obj, "__wrapped__", obj)
        receiver, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if not isinstance(receiver, str):
            return
        if name in ("ljust", "rjust", "center", "zfill") and args and type(args[0]) is int:
            self.check_size(args[0], f"{name}({args[0]})")
        elif name == "expandtabs":
            tab = args[0] if args and type(args[0]) is int else 8
            self.check_size(len(receiver) + receiver.count("\t") * tab, "expandtabs()")
        elif name == "replace" and len(args) >= 2:
            self.check_replace(receiver, *args[:2])
        elif name in ("format", "format_map"):
            self.check_format(receiver)

    def check_replace(self, s, old, new) -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            count = len(s) + 1 if not old else s.count(old)
            self.check_size(len(s) + count * (len(new) - len(old)), "replace()")

    def check_format(self, fmt: str) -> None:
        for _, _, spec, _ in string.Formatter().parse(fmt):
            if spec and ("{" in spec or any(int(n) > self.chars
                                            for n in re.findall(r"\d+", spec))):
                raise self.refuse(f"a field formatted as {spec[:40]!r}")

    def check_printf(self, fmt, args) -> None:
        if not isinstance(fmt, str):
            return
        for width, precision in re.findall(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?",
                                           fmt):
            for n in (width, precision):
                if n == "*":
                    values = args if isinstance(args, tuple) else (args,)
                    if any(type(v) is int and v > self.chars for v in values):
                        raise self.refuse("a %* field")
                elif n and int(n) > self.chars:
                    raise self.refuse(f"a %{n} field")

    def check_binop(self, operator: str, left, right) -> None:
        ints = type(left) is int and type(right) is int
        if operator == "*":
            if ints:
                if left.bit_length() + right.bit_length() > _INT_BITS:
                    raise TemplateLimitError(f"an integer over {_INT_BITS} bits")
                return
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and type(n) is int:
                    self.check_size(len(seq) * n, f"a sequence of {len(seq)} times {n}")
        elif operator == "**" and ints and right > 0 and abs(left) > 1:
            if right * abs(left).bit_length() > _INT_BITS:
                raise TemplateLimitError(f"an integer over {_INT_BITS} bits ({left} ** {right})")
        elif operator == "%":
            self.check_printf(left, right)


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("template_budget",
                                                                        default=None)


class _Guarded:
    """What a template's `for` iterates: the items, with the budget checked at each one (a
    sized iterable stays sized, for `loop.length`)."""
    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        budget = _BUDGET.get()
        for item in self.items:
            if budget is not None:
                budget.tick()
            yield item


def _bounded_filter(name: str, fn):
    """A filter with the budget checked around it. It takes the template's context (so jinja
    never runs it at compile time, outside any budget, to fold constants) and hands `fn`
    what fn asks for: the context, the eval context, the environment, or nothing."""
    import jinja2

    wants = getattr(getattr(fn, "jinja_pass_arg", None), "name", None)

    @jinja2.pass_context
    @functools.wraps(fn)
    def bounded(context, *args, **kwargs):
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
            if name in ("center", "indent"):        # their width: a size to build
                for v in (*args[1:], *kwargs.values()):
                    if type(v) is int:
                        budget.check_size(v, f"|{name}({v})")
            elif name == "format" and args:
                budget.check_printf(args[0], tuple(args[1:]))
            elif name == "replace" and len(args) >= 3:
                budget.check_replace(*args[:3])
        lead = {"context": (context,), "eval_context": (context.eval_ctx,),
                "environment": (context.environment,)}.get(wants, ())
        value = fn(*lead, *args, **kwargs)
        return value if budget is None else budget.checked(value)
    return bounded


def _render(template, budget: _Budget, **variables) -> str:
    """template.render(**variables) within `budget` (TemplateLimitError past it)."""
    token = _BUDGET.set(budget)
    try:
        parts, n = [], 0
        for part in template.generate(**variables):
            n += len(part)
            budget.check_size(n, "the rendered conversation")
            budget.tick()
            parts.append(part)
        return "".join(parts)
    finally:
        _BUDGET.reset(token)
