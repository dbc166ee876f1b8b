"""The grammar checker (grammars/checker.py) and the limits checked before llguidance runs
(grammars/llg.py, wire/sampling.py), without a server."""

from __future__ import annotations

import json
import select
import time

import pytest

from grammars.checker import Checker, Verdicts
from grammars.llg import client_message, is_limit, on_stack
from wire.sampling import MAX_SCHEMA_DEPTH, SamplingError, SamplingParams


def chain(n: int) -> str:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)),
                      f'r{n} ::= "a"'])


CRASH = chain(27_000)       # ~1 MB: ~86 MB of native stack to validate, the checker has 64


def drain(checker: Checker, n: int) -> dict[int, str]:
    got: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while len(got) < n and time.monotonic() < deadline:
        fd = checker.fileno()
        if fd is not None:
            select.select([fd], [], [], checker.wait_s())
        got.update(checker.collect())
    return got


def test_a_grammar_that_crashes_llguidance_costs_only_the_child():
    c = Checker()
    try:
        assert c.check("regex", "a+") == ""
        pid = c.proc.pid
        verdict = c.check("json_schema", CRASH)
        assert "crashed the grammar checker (SIGSEGV)" in verdict, verdict
        assert c.crashes == 1 and c.proc is None
        assert c.check("regex", "a+") == ""                     # a new child
        assert c.proc.pid != pid
        assert "does not compile" in c.check("regex", "(unclosed")
    finally:
        c.close()


def test_checks_queued_behind_a_crash_get_their_own_verdicts():
    c = Checker()
    try:
        first = c.submit("regex", "x+")
        crash = c.submit("json_schema", CRASH)
        after = [c.submit("regex", "(unclosed"), c.submit("ebnf", 'start: "a"')]
        got = drain(c, 4)
        assert got[first] == "" and "crashed" in got[crash]
        assert "does not compile" in got[after[0]] and got[after[1]] == ""
        assert not c.pending
    finally:
        c.close()


def test_a_check_that_runs_too_long_is_refused_and_the_next_one_runs():
    c = Checker(timeout=1.0)
    try:
        slow = c.submit("ebnf", gbnf_chain(5000))          # 4-5 s to validate, here
        fast = c.submit("regex", "a+")                     # ms, once its new child is up
        got = drain(c, 2)
        assert "took more than 1 s to check" in got[slow]
        assert got[fast] == ""
    finally:
        c.close()


def test_an_idle_checker_has_no_child_and_a_closed_one_leaves_none():
    c = Checker()
    assert c.proc is None and c.fileno() is None and c.wait_s() is None
    c.check("regex", "a")
    proc = c.proc
    c.close()
    assert proc.poll() is not None


def test_verdicts_are_an_lru_by_grammar():
    v = Verdicts(size=2)
    v.put("regex", "a", "")
    v.put("regex", "b", "bad")
    assert v.get("regex", "a") == ""                  # a is now the most recent
    v.put("regex", "c", "")
    assert v.get("regex", "b") is None and v.get("regex", "a") == ""
    assert v.get("ebnf", "a") is None                 # the kind is part of the key


def test_client_messages_drop_state_dumps_and_backtraces():
    dump = ("lexer error: too many expressions constructed\n<state>\nTokens: x\n"
            "Stop: LexerTooComplex\nError: lexer error: too many expressions constructed\n"
            "</state><grammar>\nstart: /a{1000}{1000}/\n</grammar>")
    assert client_message(dump) == "lexer error: too many expressions constructed"
    panic = ("thread panicked at src/x.rs:1:2: boom\nstack backtrace:\n 0: foo\n 1: bar")
    assert client_message(panic) == "thread panicked at src/x.rs:1:2: boom"
    assert len(client_message("x" * 10_000)) <= 503
    assert is_limit("Parser Error: Current row has 20001 items; max is 2000")
    assert not is_limit("Parser Error: token \"a\" doesn't satisfy the grammar")


def test_on_stack_returns_and_raises_as_the_call_would():
    assert on_stack(1 << 20, sum, [1, 2]) == 3
    with pytest.raises(ZeroDivisionError):
        on_stack(1 << 20, lambda: 1 / 0)


@pytest.mark.parametrize("text", ["[" * 5000, '{"a":' * 3000 + "1" + "}" * 3000,
                                  '{"allOf":[' * (MAX_SCHEMA_DEPTH + 1) + "{}" +
                                  "]}" * (MAX_SCHEMA_DEPTH + 1)])
def test_nested_schemas_are_refused_before_anything_recurses(text):
    with pytest.raises(SamplingError, match=f"at most {MAX_SCHEMA_DEPTH} levels"):
        SamplingParams.from_json({"json_schema": text})
    with pytest.raises(SamplingError, match=f"at most {MAX_SCHEMA_DEPTH} levels"):
        SamplingParams(json_schema=text).verify_grammar()       # a forged one, in the scheduler


def nested_arrays(levels: int) -> dict:
    """A schema of `levels` levels of JSON nesting (each level one object)."""
    schema: dict = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_the_depth_limit_is_exact():
    SamplingParams.from_json({"json_schema": nested_arrays(MAX_SCHEMA_DEPTH)})
    with pytest.raises(SamplingError, match="nested at most"):
        SamplingParams.from_json({"json_schema": nested_arrays(MAX_SCHEMA_DEPTH + 1)})
