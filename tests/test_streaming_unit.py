"""api_proc/streaming.changes without a server: admissions show nothing, silence yields
keep-alives, tokens are shown as they come."""

from __future__ import annotations

import asyncio

from api_proc import streaming
from api_proc.state import RequestState, is_admission
from wire.messages import FinishReason, TextOutput


def admission(rid: str) -> TextOutput:
    return TextOutput(rid, "", [], None, prompt_tokens=3)


def token(rid: str, text: str, tid: int, finish=None) -> TextOutput:
    return TextOutput(rid, text, [tid], finish, prompt_tokens=3, completion_tokens=1,
                      queue_time=0.01)


def test_admission_is_told_from_outputs():
    assert is_admission(admission("r"))
    assert not is_admission(token("r", "a", 1))
    assert not is_admission(TextOutput("r", "", [], FinishReason("abort", status_code=400)))
    held = TextOutput("r", "", [], None, queue_time=0.02)    # a token held for a stop string
    assert not is_admission(held)


def test_a_waiting_stream_gets_keep_alives_then_its_tokens(monkeypatch):
    monkeypatch.setattr(streaming, "KEEPALIVE_S", 0.02)

    async def run() -> list[list[int]]:
        state = RequestState("r")
        state.push(admission("r"))
        seen: list[list[int]] = []

        async def feed() -> None:
            await asyncio.sleep(0.1)                      # several keep-alive periods
            state.push(token("r", "a", 5))
            await asyncio.sleep(0.01)
            state.push(token("r", "b", 6, FinishReason("length", length=2)))

        feeder = asyncio.ensure_future(feed())
        async for changed in streaming.changes([state]):
            seen.append(changed)
        await feeder
        assert state.text == "ab" and state.finished
        assert state.timing.first_output_at is None      # the dispatcher stamps, not push
        return seen

    seen = asyncio.run(run())
    assert seen[0] == []                                  # no frame for the admission
    assert seen.count([]) >= 2 and seen[-1] == [0]
    assert [c for c in seen if c] in ([[0], [0]], [[0]])
