r"""A request's constraint as an llguidance grammar, and what is checked before native code
runs.

Why a checker process and big stacks: llguidance builds grammars recursively, about 3-9 KB of
native stack per level of a `$ref` chain, a rule chain or an `allOf` chain (measured: a
`$defs` chain of 2,560 references overflows the main thread's 8 MB and the process dies of
SIGSEGV). Nothing in Python can catch that, so (checker.py) every grammar is first validated
in a child process, on a thread of CHECK_STACK bytes, and a grammar that kills the child is
a 400; the scheduler then builds matchers only for grammars the checker passed, on threads
of COMPILE_STACK bytes (4x more: the build runs the same recursion as the validation, plus
work over the vocabulary that does not recurse on the grammar). Stacks are virtual memory:
only the pages a build touches are committed.

Limits (each a 400 that names it, checked in Python before llguidance sees the text):
MAX_GRAMMAR_CHARS of text, MAX_SCHEMA_DEPTH levels of JSON nesting in a schema (Python's
own json module recurses too). llguidance's own limits (lexer and parser sizes, nesting of
a Lark grammar) are found when a matcher is first built and its first mask computed
(`first_error`), and are a 400 too.

JSON is generated without free whitespace, with json.dumps' separators (", " and ": "): a
small model allowed any whitespace can loop on newlines until its length limit (xgrammar's
`any_whitespace` has the same failure). A schema can opt in with llguidance's own key,
`"x-guidance": {"whitespace_flexible": true}`. Keywords llguidance does not implement are
an error (its `lenient` option stays off): nothing in a schema is silently ignored.

A regex is matched whole (as if anchored), in Rust's regex syntax, with `\d`, `\w` and `\s`
meaning their ASCII classes (as in xgrammar and JSON Schema patterns): with Unicode classes
`\d{4}` let a model write "🯸🯸🯸🯸" (U+1FBF8, a segmented digit) for a year.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable

ASCII_CLASSES = "dws"       # regex \d, \w, \s mean [0-9], [0-9a-zA-Z_], [ \t\n\r\f\v]
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}
MAX_ERROR_CHARS = 500       # of an llguidance error quoted back to a client
CHECK_STACK = 64 << 20      # bytes of stack for a validation in the checker process
COMPILE_STACK = 256 << 20   # bytes of stack for the scheduler's matcher builds


class GrammarError(ValueError):
    """A grammar that is refused; the message is shown to the client (400)."""


# llguidance's errors can carry a dump of its parser state and the whole grammar (a matcher
# error), or a Rust panic with its backtrace: a client gets the reason, not the dump.
_ERROR_LINE = re.compile(r"^(?:Error|error): (.+)$", re.MULTILINE)
_DUMP_START = re.compile(r"<state>|<grammar>|\nstack backtrace:|\nnote: run with", re.I)


def client_message(message: str) -> str:
    """The reason in an llguidance error, without state dumps or backtraces, bounded."""
    found = _ERROR_LINE.findall(message)
    if found and "<state>" in message:
        message = found[-1]
    message = _DUMP_START.split(message, maxsplit=1)[0].strip()
    message = " ".join(message.split())
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return message or "no reason given"


def error(kind: str, message: str) -> GrammarError:
    what = "is past a limit of the grammar engine" if is_limit(message) else "does not compile"
    return GrammarError(f"The {KIND_NAMES.get(kind, kind)} {what}: {client_message(message)}")


def to_llguidance(kind: str, text: str) -> str:
    """The llguidance grammar for a request's constraint (kind: a wire.sampling.GRAMMAR_KEYS
    name). Native code: call it on a big stack (`on_stack`) in a process that may die of
    it. Raises GrammarError where the conversion itself fails."""
    import llguidance
    from llguidance import LLMatcher
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if kind == "regex":             # \d \w \s are ASCII (module docstring)
            return LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(text, ASCII_CLASSES)}/")
        if kind == "ebnf":              # GBNF (llama.cpp's, xgrammar's) or Lark
            return llguidance.grammar_from("ebnf", text)
    except ValueError as e:
        raise error(kind, str(e)) from None
    raise GrammarError(f"Unknown constraint kind {kind!r}.")


def validate_here(kind: str, text: str) -> str:
    """"" if the grammar is valid, else the client-facing error. Runs llguidance in this
    process: the checker's body, never called in a serving process."""
    from llguidance import LLMatcher
    try:
        problem = LLMatcher.validate_grammar(to_llguidance(kind, text))
    except GrammarError as e:
        return str(e)
    return str(error(kind, problem)) if problem else ""


def first_error(matcher, steps: int = 4) -> str:
    """llguidance's reason if a freshly built matcher cannot even start: its first masks, or
    consuming the first tokens they allow, hit a limit of the lexer or parser
    (`a{1000}{1000}`, 20,000 alternatives in one rule, a schema whose only instances are
    infinite); else "". Walks a copy `steps` tokens down (the lowest allowed id each time)."""
    m = matcher.deep_copy()
    for _ in range(steps):
        if m.is_error() or m.is_stopped():
            break
        mask = memoryview(m.compute_bitmask()).cast("I")
        token = next((32 * i + (w & -w).bit_length() - 1 for i, w in enumerate(mask) if w),
                     None)
        if token is None or m.is_error():
            break
        m.consume_token(token)
    return m.get_error() if m.is_error() else ""


_LIMIT_WORDS = re.compile(r"TooComplex|too many|Too many|max is|limit", re.I)


def is_limit(message: str) -> bool:
    """Does an llguidance matcher error say a limit was reached (the grammar's fault), not
    that a token was refused?"""
    return bool(_LIMIT_WORDS.search(message))


def on_stack(stack_bytes: int, fn: Callable, *args) -> Any:
    """fn(*args) on a fresh thread with a stack of stack_bytes; its result, or its
    exception re-raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:                 # re-raised in the caller's thread
            box["error"] = e

    with _STACK_LOCK:                              # stack_size is process-wide state
        old = threading.stack_size(stack_bytes)
        try:
            t = threading.Thread(target=run, name="grammar-stack", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


_STACK_LOCK = threading.Lock()
