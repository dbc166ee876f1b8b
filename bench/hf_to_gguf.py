"""Run llama.cpp's convert_hf_to_gguf.py on a bench checkpoint (bench/make_checkpoint.py),
so that llama-server runs the same weights zserve serves from the safetensors directory.

    python -m bench.hf_to_gguf --converter .../llama.cpp/convert_hf_to_gguf.py \\
        /tmp/gemma3-270m --outtype f32 --outfile /tmp/gemma3-270m-f32.gguf

Everything after the converter's path is the converter's own arguments, passed through.

Three changes, all about the bench checkpoints' tokenizer. First, they carry checkpoints/tiny.py's small byte-level BPE
tokenizer, whose pre-tokenizer the converter does not know (it identifies one by hashing
the ids a fixed text encodes to, and refuses an unknown hash: "BPE pre-tokenizer was not
recognized"). Here an unknown one is written as "gpt-2" (byte-level BPE with GPT-2's
split, what the tiny tokenizer is closest to) instead of failing. The benchmark sends
token ids, never text, so the tokenizer never touches what is measured; weights, hyper-
parameters and every known tokenizer are converted exactly as the converter does.
Second, the Gemma 3 converter cuts the embedding down to the rows the tokenizer has (in
google/gemma-3-270m those are all 262144: the cut only drops padding rows of the larger
Gemma 3 models); the tiny tokenizer has 759, so the cut would leave llama.cpp a different,
smaller model than zserve's. Here the embedding is kept whole when it has exactly the
config's vocab_size rows, as the real checkpoint's is; the token list is padded to that
size by the converter itself. Third, the converter marks the ids past the tokenizer's
(its "[PAD123]" padding) unused, and llama-server streams nothing for an unused token: a
random-weight model's output is almost all such ids (259 of every 262 in Gemma 3's
vocabulary), so every token of a request would come in its last chunk and the client's
TTFT and TPOT would say nothing. Here they are normal tokens whose text is their name, so
each streams as it is made, as zserve's frames carry every id.

The converter imports its own gguf-py (vendored next to it), not the venv's `gguf`
package, as it does when run directly; this module imports nothing of zserve's.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import re
import runpy
import sys

FALLBACK_PRE = "gpt-2"


def _patch_pre_tokenizer() -> None:
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("hf-to-gguf").warning(
                "unknown BPE pre-tokenizer (a bench checkpoint's tiny tokenizer): written "
                "as %r; the benchmark sends token ids, so it is never used", FALLBACK_PRE)
            return FALLBACK_PRE

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


def _patch_padding_tokens() -> None:
    import gguf
    from conversion import base

    original = base.TextModel.get_vocab_base
    pad = re.compile(r"\[PAD\d+\]")

    def get_vocab_base(self):
        tokens, toktypes, tokpre = original(self)
        toktypes = [gguf.TokenType.NORMAL if t == gguf.TokenType.UNUSED
                    and pad.fullmatch(str(tok)) else t for tok, t in zip(tokens, toktypes)]
        return tokens, toktypes, tokpre

    base.TextModel.get_vocab_base = get_vocab_base


def _patch_gemma3_embedding() -> None:
    from conversion.gemma import Gemma3Model

    original = Gemma3Model.modify_tensors

    def modify_tensors(self, data_torch, name, bid):
        if ("embed_tokens.weight" in name
                and data_torch.shape[0] == self.hparams.get("vocab_size")):
            # what the original does after its cut: no norm shift on the embedding
            yield from super(Gemma3Model, self).modify_tensors(data_torch, name, bid)
            return
        yield from original(self, data_torch, name, bid)

    Gemma3Model.modify_tensors = modify_tensors


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--converter", required=True, type=pathlib.Path,
                   help="llama.cpp's convert_hf_to_gguf.py")
    args, rest = p.parse_known_args(argv)
    converter = args.converter.expanduser().absolute()
    if not converter.is_file():
        p.error(f"--converter {converter}: no such file")
    here = converter.parent
    # As the converter sets itself up: its directory (the `conversion` package) and its
    # own gguf-py first.
    sys.path[:0] = [str(here), str(here / "gguf-py")]
    _patch_pre_tokenizer()
    _patch_gemma3_embedding()
    _patch_padding_tokens()
    sys.argv = [str(converter), *rest]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
