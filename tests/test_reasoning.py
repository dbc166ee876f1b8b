"""--reasoning-parser (api_proc/reasoning.py): whole outputs and streams split alike."""

from __future__ import annotations

import random

import pytest

from api_proc.reasoning import StreamSplitter, split

CASES = [   # (parser, output, reasoning, content)
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.\n", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "<think>still going", "still going", ""),
    ("qwen3", "a </think> b", None, "a </think> b"),        # no opening: all content
    ("deepseek-r1", "Hmm.</think>The answer.", "Hmm.", "The answer."),
    ("deepseek-r1", "<think>Hmm.</think>\nOK", "Hmm.", "OK"),
    ("deepseek-r1", "no end", "no end", ""),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_split(parser, text, reasoning, content):
    assert split(text, parser) == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_any_chunking_of_a_stream_gives_the_same_split(parser, text, reasoning, content):
    rng = random.Random(len(text))
    for _ in range(30):
        s = StreamSplitter(parser)
        r = c = ""
        i = 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 4))
            dr, dc = s.feed(text[i:j])
            r, c, i = r + dr, c + dc, j
        dr, dc = s.feed("", final=True)
        assert (r + dr, c + dc) == ((reasoning or ""), content)


def test_content_streams_without_waiting_for_the_end():
    s = StreamSplitter("qwen3")
    assert s.feed("Par") == ("", "Par")      # "P" cannot start "<think>": out at once
    assert s.feed("is") == ("", "is")
