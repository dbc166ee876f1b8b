"""--reasoning-parser: a thinking model's `<think>...</think>` text goes to
`reasoning_content`, the rest to `content` (OpenAI chat replies and their stream deltas).

- `qwen3`: the output thinks only if it begins with `<think>` (Qwen3's template leaves the
  opening to the model, and with enable_thinking false puts an empty block in the prompt).
- `deepseek-r1`: the output begins inside the thinking block (its template opens it in the
  prompt); a leading `<think>` is dropped if the model prints one anyway.
Reasoning ends at `</think>`; an output that stops before it is all reasoning.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek-r1")
OPEN, CLOSE = "<think>", "</think>"
MAX_HELD = 64       # characters of leading whitespace held while "<think>" may follow


def split(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    s = StreamSplitter(parser)
    reasoning, content = s.feed(text, final=True)
    return (reasoning if s.thought else None), content


class StreamSplitter:
    """feed(delta) -> (reasoning delta, content delta). Text that may be the start of a
    marker is held back until it is known not to be one (a marker's length, plus at most
    MAX_HELD characters of leading whitespace)."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.state = "start" if parser == "qwen3" else "opening"
        self.thought = parser != "qwen3"
        self.held = ""
        self.skip_newlines = False      # just past a marker: its newlines are not text

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = content = ""
        while text:
            if self.skip_newlines:
                text = text.lstrip("\n")
                self.skip_newlines = not text
                continue
            if self.state in ("start", "opening"):
                stripped = text.lstrip()
                if not final and (not stripped or OPEN.startswith(stripped)) \
                        and len(text) <= MAX_HELD:
                    self.held = text                    # may still become "<think>"
                    break
                if stripped.startswith(OPEN):
                    text, self.thought = stripped[len(OPEN):], True
                    self.state, self.skip_newlines = "reasoning", True
                else:
                    self.state = "reasoning" if self.state == "opening" else "content"
            elif self.state == "reasoning":
                i = text.find(CLOSE)
                if i >= 0:
                    reasoning += text[:i]
                    text, self.state = text[i + len(CLOSE):], "content"
                    self.skip_newlines = True
                    continue
                keep = 0 if final else _partial_suffix(text, CLOSE)
                reasoning += text[:len(text) - keep]
                self.held = text[len(text) - keep:]
                break
            else:
                content += text
                break
        return reasoning, content


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
