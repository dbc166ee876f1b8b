"""Micro-benchmark of the wire codec (wire/codec.py) on the frame that matters most.

    python -m bench.codec [--outputs 64] [--repeat 11]

The frame: one scheduler step's TokenBatch of `--outputs` outputs (what the detokenizer
receives every step): each with 1-4 new ids, a FinishReason on every 8th (length, stop
token, stop string or abort, in turn), DecodeParams and a queue time on every 16th (a
request's first output), and the SchedulerLoad. Times encode, decode (with the decoder of
the inbox that receives it) and a round trip with timeit, best of `--repeat` repeats, per
call in microseconds; then the same frame as plain python lists through msgpack.packb /
unpackb (no types, no checks: the floor of any msgpack codec) as a baseline, and the ratio.
"""

from __future__ import annotations

import argparse
import random
import timeit

import msgpack

from wire import codec
from wire import messages as m


def token_batch(n: int, seed: int = 0) -> m.TokenBatch:
    rng = random.Random(seed)
    finishes = [m.FinishReason("length", length=128), m.FinishReason("stop", matched_token=2),
                m.FinishReason("stop", matched_str="\n\n"),
                m.FinishReason("abort", message="Aborted by the client.")]
    outputs = []
    for i in range(n):
        first = i % 16 == 0
        outputs.append(m.TokenOutput(
            rid=f"{rng.getrandbits(64):x}",
            new_ids=[rng.randrange(49152) for _ in range(rng.randint(1, 4))],
            finish=finishes[(i // 8) % 4] if i % 8 == 7 else None,
            prompt_tokens=rng.randrange(1, 2048), cached_tokens=rng.randrange(0, 512),
            queue_time=rng.random() / 10 if first else None,
            decode=m.DecodeParams(stop=["</s>"]) if first else None))
    load = m.SchedulerLoad(seq=123456, running=n, queued=7, kv_total=65536, kv_free=12000,
                           kv_evictable=3000, prompt_tokens_total=10**9,
                           generated_tokens_total=10**8, retracted_total=3, rejected_total=1)
    return m.TokenBatch(outputs=outputs, load=load)


def as_lists(value):
    """The same frame as plain python lists: what a codec without types would handle."""
    if isinstance(value, m.TokenBatch):
        return [codec.TAGS[m.TokenBatch], *as_lists_fields(value)]
    return value


def as_lists_fields(struct) -> list:
    out = []
    for name in struct.__struct_fields__:
        v = getattr(struct, name)
        if hasattr(v, "__struct_fields__"):
            v = as_lists_fields(v)
        elif isinstance(v, list):
            v = [as_lists_fields(x) if hasattr(x, "__struct_fields__") else x for x in v]
        out.append(v)
    return out


def best_us(fn, repeat: int) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outputs", type=int, default=64)
    p.add_argument("--repeat", type=int, default=11)
    args = p.parse_args()

    batch = token_batch(args.outputs)
    frame = codec.encode(batch)
    inbox = codec.DETOKENIZER_INBOX
    assert inbox.decode(frame) == batch

    plain = as_lists(batch)
    plain_frame = msgpack.packb(plain, use_bin_type=True)
    assert msgpack.unpackb(plain_frame, raw=False) == plain

    rows = {
        "encode": (lambda: codec.encode(batch),
                   lambda: msgpack.packb(plain, use_bin_type=True)),
        "decode": (lambda: inbox.decode(frame),
                   lambda: msgpack.unpackb(plain_frame, raw=False)),
        "round trip": (lambda: inbox.decode(codec.encode(batch)),
                       lambda: msgpack.unpackb(msgpack.packb(plain, use_bin_type=True),
                                               raw=False)),
    }
    print(f"TokenBatch of {args.outputs} outputs: {len(frame)} bytes "
          f"(plain lists: {len(plain_frame)} bytes); best of {args.repeat}, us per call")
    print(f"{'':12} {'wire.codec':>11} {'msgpack lists':>14} {'ratio':>7}")
    for name, (ours, base) in rows.items():
        a, b = best_us(ours, args.repeat), best_us(base, args.repeat)
        print(f"{name:12} {a:11.1f} {b:14.1f} {a / b:7.2f}")


if __name__ == "__main__":
    main()
