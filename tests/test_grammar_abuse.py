"""End to end: no grammar a client (or a forger on the scheduler's socket) sends can take a
process down, stall the others, or get a 500.

Each pathological grammar class found by probing (issue 20) goes to a live server: deep
`$defs` reference chains (on /generate and in chat `response_format`), `allOf` chains, GBNF
and Lark rule chains, grammars past llguidance's lexer and parser limits, nested JSON sent as
a string, and chains that crash llguidance's validation outright (they kill the grammar
checker child, never a serving process). Every answer is a 400 naming the problem, or an
output that obeys the grammar; meanwhile a bystander's plain requests keep answering.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest

from tests.server import serving, wait_idle
from tests.test_ipc_robustness import CHILDREN, push
from wire.codec import encode
from wire.messages import TokenizedRequest
from wire.sampling import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH, SamplingParams

pytestmark = pytest.mark.e2e

BYSTANDER_LIMIT = 1.0       # seconds a bystander's 4-token request may take (issue 20, check 1)


def defs_chain(n: int, rich: bool = False) -> dict:
    """A $ref chain n deep: d0 -> d1 -> ... -> an integer (rich: objects with properties
    on the way, which cost llguidance ~3x the stack per level)."""
    if rich:
        defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"},
                                                           "y": {"type": "string"}},
                          "required": ["x"]} for i in range(n)}
    else:
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def crashing_chain() -> dict:
    """The longest plain $ref chain under MAX_GRAMMAR_CHARS: ~27,000 levels, more than the
    checker's stack holds (~3.2 KB a level: grammars/llg.py)."""
    n = MAX_GRAMMAR_CHARS // 37 - 50
    return defs_chain(n)


def allof_chain(n: int) -> str:
    """As JSON text: Python's json module cannot even encode it (nor can a client's)."""
    return '{"allOf":[' * n + '{"type":"integer"}' + "]}" * n


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)),
                      f'r{n} ::= "a"'])


def lark_chain(n: int) -> str:
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "a"'])


RECURSIVE_REQUIRED = {"$defs": {"node": {"type": "object",
                                         "properties": {"child": {"$ref": "#/$defs/node"}},
                                         "required": ["child"]}},
                      "$ref": "#/$defs/node"}

# (sampling_params, what a 400 must say, or None where a correct output is also fine)
CASES = {
    "defs-1000-rich": ({"json_schema": defs_chain(1000, rich=True)}, None),
    "defs-crash": ({"json_schema": crashing_chain()}, "crashed the grammar checker"),
    "allof-5000": ({"json_schema": allof_chain(5000)}, f"at most {MAX_SCHEMA_DEPTH} levels"),
    "gbnf-5000": ({"ebnf": gbnf_chain(5000)}, None),
    "lark-5000": ({"ebnf": lark_chain(5000)}, None),
    "regex-repeat": ({"regex": "a{1000}{1000}"}, "too many expressions"),
    "recursive-required": ({"json_schema": RECURSIVE_REQUIRED}, "past a limit"),
    "ebnf-repeat": ({"ebnf": 'root ::= "a"{1000000}'}, "past a limit"),
    "alternatives-20k": ({"ebnf": "root ::= " + " | ".join(f'"w{i}"' for i in range(20000))},
                         "items"),
    "nested-string": ({"json_schema": "[" * 5000}, f"at most {MAX_SCHEMA_DEPTH} levels"),
    "too-long": ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, f"at most {MAX_GRAMMAR_CHARS}"),
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grammar-abuse")
    with serving(tiny_model("llama"), tmpdir=tmp) as s:
        (s.ipc_dir,) = tmp.glob("zserve-*/")
        s.model = str(tiny_model("llama"))      # the served id: the model path
        yield s


class Bystander:
    """A client sending plain 4-token requests one after another; `worst` is the slowest."""

    def __init__(self, url: str):
        self.url, self.worst, self.count = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                t = time.monotonic()
                r = c.post("/generate", json={"text": "a bystander", "sampling_params": {
                    "max_new_tokens": 4, "ignore_eos": True, "temperature": 0}})
                assert r.status_code == 200, r.text
                self.worst = max(self.worst, time.monotonic() - t)
                self.count += 1

    def __enter__(self) -> "Bystander":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        deadline = time.monotonic() + 60
        while self.count == 0 and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)                # at least one request answered meanwhile
        self._stop.set()
        self._thread.join()


def check_answer(r: httpx.Response, sampling: dict, fragment: str | None) -> None:
    if r.status_code == 400:
        message = r.json()["error"]["message"]
        assert fragment is None or fragment in message, message
        assert len(message) < 2000 and "<state>" not in message and "backtrace" not in message
        return
    assert fragment is None, f"{r.status_code} where a 400 saying {fragment!r} was due"
    assert r.status_code == 200, r.text
    out = r.json()
    if out["meta_info"]["finish_reason"]["type"] == "stop" and "json_schema" in sampling:
        jsonschema.validate(json.loads(out["text"]), sampling["json_schema"])


def assert_alive(server) -> None:
    for name in CHILDREN:
        p = server.child(name)
        assert p.is_running() and p.status() != "zombie", name
    assert server.proc.poll() is None
    assert server.client.get("/health").status_code == 200


def fresh(sampling: dict, k: int) -> dict:
    """The same grammar in a text not seen before (no cached verdict or compile): a comment
    or an alternative that changes nothing the test checks."""
    (key, value), = sampling.items()
    if key == "json_schema" and isinstance(value, dict):
        return {key: {**value, "$comment": f"try {k}"}}
    if key == "ebnf":
        return {key: ("# try %d\n" if "::=" in value else "// try %d\n") % k + value}
    if key == "regex":
        return {key: f"(?:{value})|zq{k}"}
    return sampling                             # refused before any grammar work anyway


@pytest.mark.parametrize("case", list(CASES))
def test_every_grammar_class_is_a_400_or_served(server, case):
    """The bystander's bound is checked on up to three fresh copies of the grammar: the
    rest of the suite shares this machine's two cores, so one request of the bystander's
    can stall for reasons of its own; a grammar that stalls the server stalls all three."""
    worst = []
    for k in range(3):
        sampling = fresh(CASES[case][0], k)
        with Bystander(server.url) as b:
            r = server.generate(text="Answer:", sampling_params={
                "max_new_tokens": 24, "temperature": 0, **sampling})
        check_answer(r, sampling, CASES[case][1])
        assert_alive(server)
        wait_idle(server)
        assert b.count > 0
        worst.append(b.worst)
        if b.worst < BYSTANDER_LIMIT:
            break
    assert min(worst) < BYSTANDER_LIMIT, worst


def test_a_deep_schema_object_in_the_body_is_a_400(server):
    """The allOf chain as an object in the body, not as a string (the JSON is built by hand:
    json.dumps recurses too deep for it)."""
    for n in (MAX_SCHEMA_DEPTH, 5000):
        body = ('{"text": "x", "sampling_params": {"max_new_tokens": 4, "json_schema": '
                + allof_chain(n) + "}}")
        r = server.client.post("/generate", content=body,
                               headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nested" in r.json()["error"]["message"], r.text
    assert_alive(server)


def test_chat_response_format_with_deep_schemas(server):
    for schema, fragment in ((defs_chain(1000, rich=True), None),
                             (crashing_chain(), "crashed the grammar checker")):
        r = server.client.post("/v1/chat/completions", json={
            "model": server.model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "deep", "schema": schema}}})
        if fragment is None:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
        assert_alive(server)


def test_a_grammar_that_crashed_the_checker_is_refused_again_at_once(server):
    """The verdict is cached: the second try costs no new checker crash."""
    sampling = {"json_schema": crashing_chain(), "max_new_tokens": 4}
    for _ in range(2):
        t = time.monotonic()
        r = server.generate(text="x", sampling_params=sampling)
        assert r.status_code == 400, r.text
    assert time.monotonic() - t < 5.0           # no second multi-second crash and restart


def test_forged_deep_grammars_reach_the_scheduler_and_it_lives(server):
    """Sent straight to the scheduler's socket (no tokenizer check): its own checker
    refuses them, and it goes on serving."""
    forged = [TokenizedRequest(f"forged-{i}", [5, 6], SamplingParams(max_new_tokens=4, **s))
              for i, s in enumerate([{"json_schema": json.dumps(crashing_chain())},
                                     {"ebnf": lark_chain(3000)},
                                     {"regex": "a{1000}{1000}"},
                                     {"json_schema": "[" * 5000}])]
    push(server, "scheduler", [encode(m) for m in forged])
    assert_alive(server)
    out = server.generate_ok(text="still here", sampling_params={"max_new_tokens": 3,
                                                                "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    wait_idle(server)
    logs = server.logs()
    assert "forged-0" in logs and "Traceback" not in logs
