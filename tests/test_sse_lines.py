"""End to end: an SSE frame is one line to every line reader. Text holding U+2028, U+2029
or U+0085 (which str.splitlines, hence httpx's iter_lines, splits on) comes escaped in the
frame's JSON (api_proc/boundary.dumps), on all three streaming routes."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

BREAKERS = "\u2028\u2029\u0085"
REGEX = "a\u2028b\u2029c\u0085d"        # the model must write exactly this


def frames(url: str, path: str, body: dict) -> list[dict]:
    out = []
    with httpx.Client(base_url=url, timeout=60) as c, \
            c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            assert line.startswith("data: "), repr(line)
            if line != "data: [DONE]":
                out.append(json.loads(line[len("data: "):]))
    return out


@pytest.mark.parametrize("route", ["generate", "completions", "chat"])
def test_streamed_text_with_line_separators_parses_line_by_line(llama_server, tiny_model,
                                                                route):
    model = str(tiny_model("llama"))
    if route == "generate":
        got = frames(llama_server.url, "/generate", {
            "text": "x", "sampling_params": {"regex": REGEX, "max_new_tokens": 32,
                                             "temperature": 0}})
        text = got[-1]["text"]
    elif route == "completions":
        got = frames(llama_server.url, "/v1/completions", {
            "model": model, "prompt": "x", "regex": REGEX, "max_tokens": 32,
            "temperature": 0})
        text = "".join(f["choices"][0]["text"] for f in got if f["choices"])
    else:
        got = frames(llama_server.url, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "x"}], "regex": REGEX,
            "max_tokens": 32, "temperature": 0})
        text = "".join(f["choices"][0]["delta"].get("content") or "" for f in got
                       if f["choices"])
    assert text == REGEX and all(c in text for c in BREAKERS)
