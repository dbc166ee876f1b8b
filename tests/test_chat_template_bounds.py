"""A chat template's render is bounded (tokenization/hf_tokenizer.py, "chat templates:
bounded"): in time (RENDER_SECONDS) and in the size of what it builds (RENDER_CHARS). A
heavy template used to hold the only tokenizer worker for minutes; now it fails at once,
or at the time bound, with TemplateLimitError, and the server answers 400 and goes on."""

from __future__ import annotations

import threading
import time

import pytest

from tokenization.hf_tokenizer import (RENDER_CHARS, RENDER_SECONDS, HFTokenizer,
                                         TemplateLimitError)

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HANG = 60           # seconds after which a render counts as hung (the bound is far below)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return HFTokenizer.from_dir(tiny_model("llama"))


def render(tok, template: str, seconds: float = RENDER_SECONDS, chars: int = RENDER_CHARS,
           **kwargs):
    """tok's render of MESSAGES with `template` within those bounds, in a thread: (result or
    exception, seconds). A render still running after HANG seconds fails the test instead
    of hanging it."""
    out, tok.chat_template = {}, template
    tok.render_seconds, tok.render_chars = seconds, chars

    def run():
        start = time.monotonic()
        try:
            out["value"] = tok.apply_chat_template(MESSAGES, **kwargs)
        except Exception as e:      # noqa: BLE001 - the test looks at which
            out["value"] = e
        out["seconds"] = time.monotonic() - start
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG)
    assert not worker.is_alive(), f"the template still renders after {HANG} s"
    return out["value"], out["seconds"]


def test_a_loop_nest_stops_at_the_time_bound(tok):
    """10^10 empty iterations: minutes before, the time bound now."""
    err, seconds = render(tok, NESTED, seconds=0.5)
    assert isinstance(err, TemplateLimitError), err
    assert "it ran for more than 0.5 s" in str(err)
    assert seconds < 0.5 + 5.0


def test_the_default_bound_is_render_seconds(tok):
    err, seconds = render(tok, NESTED)
    assert isinstance(err, TemplateLimitError), err
    assert f"more than {RENDER_SECONDS:g} s" in str(err)
    assert RENDER_SECONDS <= seconds


def test_a_billion_item_range_is_refused_at_once(tok):
    """The brief's case: jinja's sandbox already caps range() at 100,000 items."""
    err, _ = render(tok, "{% for i in range(10**9) %}x{% endfor %}")
    assert isinstance(err, OverflowError) and "Range too big" in str(err)


def test_recursion_without_end_stops_at_the_time_bound(tok):
    template = ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                "{% endmacro %}{{ f(40) }}")
    err, _ = render(tok, template, seconds=0.5)
    assert isinstance(err, TemplateLimitError), err


@pytest.mark.parametrize("expression", [
    '"x" * 10**9', '[1, 2] * 10**9', '"%999999999d" % 1', '"%*d" % (999999999, 1)',
    '"{:>999999999}".format(1)', '"a".ljust(999999999)', '"a"|center(999999999)',
    '"a"|indent(999999999)', '"%*d"|format(999999999, 1)', '"ab".replace("", "x" * 6 * 10**7)',
    '"ab"|replace("", "x" * 6 * 10**7)', "2 ** 100000000"])
def test_a_value_too_big_to_build_is_refused_before_it_is_built(tok, expression):
    err, seconds = render(tok, "{{ " + expression + " }}", chars=10 ** 7)
    assert isinstance(err, TemplateLimitError), err
    assert seconds < 5.0, seconds


def test_template_variables_cannot_lift_the_bounds(tok):
    """chat_template_kwargs come from clients and become template variables."""
    err, _ = render(tok, NESTED, seconds=0.5, render_seconds=1e9, max_seconds=1e9)
    assert isinstance(err, TemplateLimitError), err


def test_the_output_is_bounded(tok):
    template = "{% for m in messages %}{% for i in range(1000) %}{{ m.content }}{% endfor %}" \
               "{% endfor %}"
    err, _ = render(tok, template, chars=5000)
    assert isinstance(err, TemplateLimitError)
    assert "the rendered conversation would be over 5000 characters" in str(err)
    text, _ = render(tok, template, chars=10000)
    assert text == "hi" * 1000 + "hello" * 1000 + "bye" * 1000


def test_loops_still_know_their_length_and_filters_still_work(tok):
    template = ("{% for m in messages if m.role == 'user' %}{{ loop.index }}/{{ loop.length }}"
                "{{ '!' if loop.last }} {{ m.content|upper|replace('I', '1') }} "
                "{% else %}none{% endfor %}{{ '%s-%d'|format('a', 2) }} {{ '{:>3}'.format(7) }}"
                "{{ [3, 1, 2]|sort|join(',') }}{{ {'k': messages|length}|tojson }}"
                "{{ (10**12)|tojson }}")              # a big number is not a big size
    text, _ = render(tok, template, chars=1000)
    assert text == "1/2 H1 2/2! BYE a-2   71,2,3{\"k\": 3}1000000000000"


@pytest.mark.e2e
def test_the_server_answers_400_and_keeps_serving(tiny_model, tmp_path, launch):
    (tmp_path / "heavy.jinja").write_text(NESTED)
    server = launch(tiny_model("llama"), "--chat-template", str(tmp_path / "heavy.jinja"))
    start = time.monotonic()
    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert time.monotonic() - start < RENDER_SECONDS + 30
    assert r.json()["error"]["message"].startswith(
        f"The chat template failed on these messages: it ran for more than "
        f"{RENDER_SECONDS:g} s")
    assert server.generate(text="hello", sampling_params={"max_new_tokens": 1}) \
        .status_code == 200
