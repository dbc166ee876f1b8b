"""The grammar checker: llguidance's validation of a grammar, run in a child process so that
a grammar that crashes the native code (a stack overflow, a panic that aborts) or runs for
too long costs a 400, not a serving process.

Each serving process that checks grammars (a tokenizer worker, a scheduler) owns one
`Checker`: a child started on the first grammar, that lives as long as its owner and dies
with it (its stdin closes; PR_SET_PDEATHSIG where the owner is killed). The child reads
requests on its stdin into a queue and answers each, in order, on its stdout; frames are a
4-byte big-endian length and a msgpack array (nothing pickled): [seq, kind, text] in,
[seq, verdict] out, where the verdict is "" for a valid grammar or the client-facing error;
a child's first frame is [READY, ""], once it has imported llguidance (a check's time runs
from then, not from the spawn).
Validation runs on a thread of llg.CHECK_STACK bytes.

Invariant (kept by `Checker`): `pending` holds every submitted check without a verdict, in
the order the child answers them, so its head is the one the child is working on. When the
child dies, the head is what killed it: it gets the verdict, the child is restarted and the
rest are sent again. A head that runs past `timeout` seconds is refused the same way.

`Checker` is driven two ways: the tokenizer polls `fileno()` with its inbox and calls
`collect()` (checks run while it serves other requests); the scheduler's compile threads call
`check()`, which blocks (one at a time, under a lock).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import msgpack

log = logging.getLogger(__name__)

CHECK_TIMEOUT = 10.0        # seconds one validation may take (measured: ~1-100 ms usually)
CHECK_NICE = 10             # the child's OS nice value above its owner's
READY = 0                   # the seq of the frame a child sends once it is ready (checks: 1..)
_LEN = struct.Struct(">I")
_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass
class Pending:
    seq: int
    kind: str
    text: str
    started: float          # when the child began it (its submission, or the verdict before)


class Checker:
    """A client of one checker child. Not thread-safe except `check()`."""

    def __init__(self, timeout: float = CHECK_TIMEOUT):
        self.timeout = timeout
        self.pending: deque[Pending] = deque()
        self.proc: subprocess.Popen | None = None
        self._buf = bytearray()
        self._seq = 0
        self._lock = threading.Lock()
        self.crashes = 0            # checks that killed the child or ran out of time

    # -- the child ------------------------------------------------------------------------

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "grammars.checker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=_ROOT, bufsize=0, close_fds=True)
        self._buf.clear()
        os.set_blocking(self.proc.stdout.fileno(), False)

    def _send(self, p: Pending) -> None:
        data = msgpack.packb([p.seq, p.kind, p.text])
        try:
            self.proc.stdin.write(_LEN.pack(len(data)) + data)
        except (BrokenPipeError, OSError):
            pass                    # the child is gone: collect() sees its EOF

    def _restart(self, verdict: str) -> list[tuple[int, str]]:
        """The head killed the child (or timed out): it gets `verdict`, the rest go again."""
        head = self.pending.popleft()
        self.crashes += 1
        log.warning("grammar check %d refused: %s", head.seq, verdict)
        self.close()
        if self.pending:
            self._start()
            now = time.monotonic()
            for p in self.pending:
                p.started = now
                self._send(p)
        return [(head.seq, verdict)]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
            self.proc = None

    # -- the polled interface -----------------------------------------------------------------

    def submit(self, kind: str, text: str) -> int:
        """Queue a check; its verdict comes from `collect()` under the returned number."""
        if self.proc is None:
            self._start()
        self._seq += 1
        p = Pending(self._seq, kind, text, time.monotonic())
        self.pending.append(p)
        self._send(p)
        return p.seq

    def fileno(self) -> int | None:
        """The fd that is readable when verdicts (or the child's death) are there to collect."""
        return self.proc.stdout.fileno() if self.proc is not None and self.pending else None

    def wait_s(self) -> float | None:
        """Seconds until the head check's time runs out (None: nothing pending)."""
        if not self.pending:
            return None
        return max(0.0, self.pending[0].started + self.timeout - time.monotonic())

    def collect(self) -> list[tuple[int, str]]:
        """The verdicts that have arrived, and those of checks that killed the child or ran
        out of time; never blocks."""
        out: list[tuple[int, str]] = []
        while self.pending and self.proc is not None:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not chunk:                                   # the child died
                code = self.proc.wait()
                name = signal.Signals(-code).name if code < 0 else f"exit {code}"
                out += self._restart(f"The grammar crashed the grammar checker ({name}): it "
                                     f"is too deep or too large for llguidance.")
                continue
            self._buf += chunk
            out += self._frames()
        if self.pending and self.wait_s() == 0:
            out += self._restart(f"The grammar took more than {self.timeout:g} s to check "
                                 f"(the limit).")
        return out

    def _frames(self) -> list[tuple[int, str]]:
        out = []
        while len(self._buf) >= 4:
            n = _LEN.unpack_from(self._buf)[0]
            if len(self._buf) < 4 + n:
                break
            seq, verdict = msgpack.unpackb(bytes(self._buf[4:4 + n]))
            del self._buf[:4 + n]
            if seq == READY:                # a new child has imported what it needs: the
                if self.pending:            # head's time starts now, not at the spawn
                    self.pending[0].started = time.monotonic()
                continue
            head = self.pending.popleft()
            assert head.seq == seq, "the checker answers in order"
            if self.pending:
                self.pending[0].started = time.monotonic()
            out.append((seq, verdict))
        return out

    # -- the blocking interface -----------------------------------------------------------------

    def check(self, kind: str, text: str) -> str:
        """The verdict on one grammar ("" if valid), waiting for it."""
        with self._lock:
            seq = self.submit(kind, text)
            while True:
                for got, verdict in self.collect():
                    if got == seq:
                        return verdict
                fd = self.fileno()
                if fd is not None:
                    select.select([fd], [], [], self.wait_s())


class Verdicts:
    """The checker's verdicts by (kind, text), LRU-bounded: a grammar sent again (an agent's
    tool schema on every turn, a client retrying one that crashed the checker) is checked
    once. Keys hold a digest, not the text."""

    def __init__(self, size: int = 256):
        self.size = size
        self._d: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    @staticmethod
    def key(kind: str, text: str) -> tuple[str, bytes]:
        return kind, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def get(self, kind: str, text: str) -> str | None:
        k = self.key(kind, text)
        verdict = self._d.get(k)
        if verdict is not None:
            self._d.move_to_end(k)
        return verdict

    def put(self, kind: str, text: str, verdict: str) -> None:
        self._d[self.key(kind, text)] = verdict
        while len(self._d) > self.size:
            self._d.popitem(last=False)


# ---- the child ----------------------------------------------------------------------------

def _read_exact(f, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main() -> None:
    """The child: requests from stdin into a queue (so the owner's writes never wait on a
    validation), verdicts in order on stdout; exits when stdin closes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)                  # PR_SET_PDEATHSIG: die with the owner
    if os.getppid() == 1:
        return
    try:
        import setproctitle
        setproctitle.setproctitle("zserve::grammar-checker")
    except ImportError:
        pass
    os.nice(CHECK_NICE)                            # the model's steps come first
    from grammars.llg import CHECK_STACK, client_message, validate_here
    work: queue.Queue = queue.Queue()
    # Frames go out on a private copy of the pipe; fd 1 becomes stderr, so that nothing the
    # library (or Python) prints can land inside a frame.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)

    def answer() -> None:
        while (item := work.get()) is not None:
            seq, kind, text = item
            try:
                verdict = validate_here(kind, text)
            except BaseException as e:    # noqa: BLE001 - a Rust panic is a BaseException
                verdict = (f"The grammar could not be checked: {type(e).__name__}: "
                           f"{client_message(str(e))}")
            data = msgpack.packb([seq, verdict])
            out.write(_LEN.pack(len(data)) + data)
            out.flush()
        os._exit(0)

    data = msgpack.packb([READY, ""])
    out.write(_LEN.pack(len(data)) + data)
    out.flush()
    threading.stack_size(CHECK_STACK)
    threading.Thread(target=answer, name="check", daemon=True).start()
    inp = sys.stdin.buffer
    while (head := _read_exact(inp, 4)) is not None:
        body = _read_exact(inp, _LEN.unpack(head)[0])
        if body is None:
            break
        work.put(msgpack.unpackb(body))
    os._exit(0)


if __name__ == "__main__":
    main()
