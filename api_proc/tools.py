"""Tool calling on /v1/chat/completions: what the model must produce for a tool_choice, and
how a model's text becomes OpenAI `tool_calls` (pure functions; openai_api.py wires them).

tool_choice:
- "none": no tools are offered; the reply is text.
- a named function ({"type": "function", "function": {"name": N}}): the output is
  constrained (a JSON-schema grammar, see `forced_schema`) to N's arguments, an object valid
  against its `parameters`; the reply is one tool call of N with that text as arguments.
- "required": the output is constrained to {"name": one of the tools, "arguments": {...}}
  (an anyOf over the tools); the reply is that call.
- "auto" (the default when tools are given): the model chooses; its text is parsed with the
  --tool-call-parser format of its family, and text outside the calls stays content.

Parsers (--tool-call-parser), the formats of the supported families' chat templates:
- `qwen`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks (Qwen2/3,
  and SmolLM3's "hermes" style);
- `llama3`: a JSON object {"name": ..., "parameters": {...}} (or "arguments"), optionally
  after `<|python_tag|>`; several separated by ";";
- `mistral`: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}.
A text that does not parse as calls is content: nothing is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("qwen", "llama3", "mistral")


class ToolError(ValueError):
    """A tools / tool_choice the client got wrong (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str = ""

    def to_json(self, index: int) -> dict:
        return {"index": index, "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools, tool_choice) -> tuple[list[dict], object]:
    """Validate `tools` and `tool_choice` as OpenAI defines them; returns the tools' function
    objects and the normalized choice ("none" | "auto" | "required" | a function name)."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools.", "tool_choice")
        return [], "none"
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list.", "tools")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": ..., \"parameters\": {{...}}}}}}.", "tools")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object.",
                            "tools")
        functions.append({**f, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools have duplicate function names.", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if name not in names:
            raise ToolError(f"tool_choice names a function that is not in tools: {name!r}.",
                            "tool_choice")
        return functions, name
    if choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                        "tool_choice")
    return functions, choice


def forced_schema(functions: list[dict], choice) -> dict | None:
    """The JSON schema the output must match for this choice (None: unconstrained)."""
    if choice in ("none", "auto"):
        return None
    by_name = {f["name"]: f["parameters"] for f in functions}
    if choice != "required":
        return by_name[choice]
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": name}, "arguments": params},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, params in by_name.items()]}


def forced_calls(text: str, choice) -> list[ToolCall]:
    """The call a constrained output stands for (choice: a name, or "required"); [] when
    the output is not a whole call (it stopped at max_tokens inside the JSON): the reply
    then keeps the text as content, with finish_reason "length"."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if choice != "required":
        return [ToolCall(choice, text.strip())] if isinstance(obj, dict) else []
    call = _call_obj(obj)
    return [call] if call is not None else []


# ---- parsing a model's own tool-call format ("auto") ---------------------------------------

_QWEN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output. Calls that do not parse stay in the content."""
    if parser == "qwen":
        calls, kept, last = [], [], 0
        for m in _QWEN.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        return "".join(kept).strip() if calls else text, calls
    if parser == "mistral":
        head, sep, rest = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        try:
            items = json.loads(rest.strip())
        except (ValueError, RecursionError):
            return text, []
        calls = [_call_obj(x) for x in (items if isinstance(items, list) else [items])]
        return (head.strip(), calls) if calls and None not in calls else (text, [])
    if parser == "llama3":
        calls = _json_objects(text.strip().removeprefix("<|python_tag|>"))
        return ("", calls) if calls else (text, [])
    raise ValueError(f"unknown tool-call parser {parser!r}")


def _call(text: str) -> ToolCall | None:
    try:
        return _call_obj(json.loads(text))
    except (ValueError, RecursionError):
        return None


def _json_objects(text: str) -> list[ToolCall] | None:
    """Calls written as JSON objects one after another, separated by ";" (Llama 3.x);
    None unless the whole text is such calls."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        call = _call_obj(obj)
        if call is None:
            return None
        calls.append(call)


def _call_obj(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):           # some models emit the arguments already as text
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def start_marker(parser: str) -> str | None:
    """Text that begins a tool call in this format (streaming holds text back from it)."""
    return {"qwen": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": None}[parser]
