"""A GGUF header cannot make the reader allocate or walk more than the file holds
(models/gguf.py: read_header). Every count and length in it is checked
against the bytes left in the file first; a forged one is a ValueError naming the file and
the bad value, and the launcher exits non-zero with that one line."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from models import gguf as zgguf

REPO = Path(__file__).resolve().parent.parent
HUGE = 2 ** 62


@pytest.fixture
def small_gguf(tmp_path) -> Path:
    """A valid little GGUF: strings, integers, a string array, a float array, two F32
    tensors."""
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("small")
    w.add_custom_alignment(32)
    w.add_context_length(64)
    w.add_token_list(["a", "b", "c"])
    w.add_token_scores([0.0, 1.0, 2.0])
    w.add_tensor("token_embd.weight", np.zeros((3, 4), np.float32))
    w.add_tensor("output_norm.weight", np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _after(raw: bytes, key: str) -> int:
    """The offset just past a length-prefixed string `key` in the header."""
    prefix = len(key).to_bytes(8, "little") + key.encode()
    return raw.index(prefix) + len(prefix)


def _patch(path: Path, offset: int, fmt: str, value: int) -> None:
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(bytes(raw))


# case -> (where to write what, given the file's bytes; the message expected)
CASES = {
    "tensor count": (lambda raw: (8, "<Q", HUGE),
                     rf"the GGUF header claims {HUGE} tensors, more than the \d+ bytes left"),
    "metadata count": (lambda raw: (16, "<Q", HUGE),
                       rf"the GGUF header claims {HUGE} metadata entries"),
    "key length": (lambda raw: (24, "<Q", HUGE),
                   rf"metadata key: a string of {HUGE} bytes at byte 24 runs past the end"),
    "string value": (lambda raw: (_after(raw, "general.name") + 4, "<Q", HUGE),
                     rf"a string of {HUGE} bytes .* \(key general\.name\)"),
    "array count": (lambda raw: (_after(raw, "tokenizer.ggml.scores") + 8, "<Q", HUGE),
                    rf"an array of {HUGE} items .* \(key tokenizer\.ggml\.scores\)"),
    "string array count": (lambda raw: (_after(raw, "tokenizer.ggml.tokens") + 8, "<Q", HUGE),
                           rf"an array of {HUGE} items .* \(key tokenizer\.ggml\.tokens\)"),
    "string array item": (lambda raw: (_after(raw, "tokenizer.ggml.tokens") + 16, "<Q", HUGE),
                          rf"a string of {HUGE} bytes .* \(key tokenizer\.ggml\.tokens\)"),
    "tensor name": (lambda raw: (_after(raw, "tokenizer.ggml.scores") + 28, "<Q", HUGE),
                    rf"tensor 0's name: a string of {HUGE} bytes"),
    "dimensions": (lambda raw: (_after(raw, "token_embd.weight"), "<I", 2 ** 31),
                   r"tensor token_embd\.weight has 2147483648 dimensions; GGUF allows at "
                   r"most 4"),
    "alignment": (lambda raw: (_after(raw, "general.alignment") + 4, "<I", 0),
                  r"general\.alignment 0 is not a power of two that fits the file"),
    "shape": (lambda raw: (_after(raw, "token_embd.weight") + 4, "<Q", HUGE),
              r"tensor token_embd\.weight lies past the end of the file"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_forged_count_or_length_is_one_line_naming_the_file(small_gguf, case):
    where, message = CASES[case]
    _patch(small_gguf, *where(small_gguf.read_bytes()))
    with pytest.raises(ValueError, match=message) as err:
        zgguf.read_header(small_gguf)
    assert str(err.value).startswith(f"{small_gguf}: ")
    assert "\n" not in str(err.value)


def test_any_corrupt_header_word_is_a_value_error(small_gguf):
    """Every 8-byte word of the header set to all ones, and every truncation of it: the
    reader answers or raises ValueError, nothing else (no OverflowError, no MemoryError)."""
    raw = small_gguf.read_bytes()
    end = zgguf.read_header(small_gguf).tensors["token_embd.weight"].offset
    bad = small_gguf.with_name("bad.gguf")
    variants = [raw[:n] for n in range(4, end)]
    variants += [raw[:i] + b"\xff" * 8 + raw[i + 8:] for i in range(4, end - 8)]
    for data in variants:
        bad.write_bytes(data)
        try:
            zgguf.read_header(bad)
        except ValueError as e:
            assert str(e).startswith(f"{bad}: "), e


def test_the_launcher_exits_with_the_bad_count(small_gguf):
    """The issue's case: a header claiming 2^62 tensors used to end the launcher with
    "Python int too large to convert to C ssize_t"."""
    _patch(small_gguf, 8, "<Q", HUGE)
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), "--model-path",
                        str(small_gguf)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == (f"zserve: --model-path {small_gguf}: the GGUF header claims {HUGE} "
                         f"tensors, more than the {small_gguf.stat().st_size - 24} bytes left "
                         f"in the file can hold (at least 24 bytes each): the file is "
                         f"corrupt or truncated"), r.stderr
