"""Grammars for constrained decoding, shared by the tokenizer (which checks a request's
grammar before it is queued) and the scheduler (which compiles it over the vocabulary):

    llg.py      a request's json_schema / regex / ebnf as an llguidance grammar, the limits
                checked before any native code sees it, client-facing errors
    checker.py  the grammar checker: a child process that runs llguidance's validation,
                so that no grammar can take down a process of ours

No torch, no sockets, no import of any *_proc package.
"""
