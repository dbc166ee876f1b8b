"""`python launch.py --help` (wire/server_args.py: ServerArgs.parser): each flag's default
said once, where there is one to say, and the values of every flag with a fixed set."""

from __future__ import annotations

import dataclasses
import re

from wire.server_args import ServerArgs


def flag_help() -> dict[str, str]:
    """--flag -> its entry in --help (the flag line and its text), whitespace collapsed."""
    text = ServerArgs.parser().format_help()
    entries = re.split(r"\n(?=  -)", text.split("\noptions:\n", 1)[1])
    out = {}
    for entry in entries:
        flag = re.match(r"\s*(?:-h, )?(--[\w-]+)", entry).group(1)
        out[flag] = " ".join(entry.split())
    return out


def test_each_default_is_said_once():
    helps = flag_help()
    for f in dataclasses.fields(ServerArgs):
        entry = helps["--" + f.name.replace("_", "-")]
        assert entry.lower().count("default") <= 1, entry
        assert "(default: None)" not in entry and "(default: False)" not in entry, entry
        if f.default not in (None, False):
            assert "default" in entry.lower(), entry
    assert "HTTP port (default: 30000)." in helps["--port"]
    assert helps["--tokenizer-path"].endswith("Tokenizer directory (default: the model path).")


def test_flags_with_a_fixed_set_show_it():
    helps = flag_help()
    usage = " ".join(ServerArgs.parser().format_usage().split())
    for f in dataclasses.fields(ServerArgs):
        if "choices" in f.metadata:
            shown = "{" + ",".join(f.metadata["choices"]) + "}"
            flag = "--" + f.name.replace("_", "-")
            assert helps[flag].startswith(f"{flag} {shown}"), helps[flag]
            assert f"[{flag} {shown}]" in usage
    assert "--dtype {auto,float32,bfloat16,float16}" in usage
    assert "--port PORT" in usage                       # the others keep their metavar
