"""What every child process does the same way: title, logging, signals, the ready report,
and dying (tidily) with the launcher.

A child reports readiness (or the exception that stopped it) to launch.py over a pipe with
msgpack bytes; nothing is pickled. Just before, it gives the heap its start-up freed back to
the system (return_freed_heap): a tokenizer's load alone leaves ~29 MB of freed pages
resident in each process that holds one. Children ignore SIGINT and SIGTERM: launch.py owns
shutdown (a Ctrl-C or a `kill` of the whole process group must not look like a crashed
child) and stops them with SIGKILL; they hold nothing that needs flushing. Nor anything
the system keeps for them: no multiprocessing Lock, Event, Queue or Semaphore (each is a
named POSIX semaphore, unlinked only by a finalizer that a SIGKILLed or `os._exit`ed
process never runs, so the launcher's resource tracker would report it leaked at every
shutdown). tqdm makes one for its first bar unless given a lock: the GGUF loader gives it
a thread lock.

Children die with their parent, and leave no ipc directory behind. A launcher that exits
normally stops its children and removes the directory itself; a SIGKILLed one cannot, so
each child watches its parent: a daemon thread blocks on a pidfd of the launcher (readable
once the launcher has exited), then removes the ipc directory and `os._exit(1)`s. A thread,
not a signal handler: Python runs handlers only on the main thread and only between
bytecodes, so a handler could wait behind a zmq poll that the signal did not interrupt
(the kernel may deliver it to any of the child's threads), whereas the thread needs only
the GIL, which the main thread releases while it polls or runs a torch op, and every few
milliseconds while it runs Python code. Where pidfd_open is unavailable (not Linux, an old
kernel, a seccomp filter) children fall back to PR_SET_PDEATHSIG with SIGKILL: no orphans,
but no cleanup either.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import multiprocessing
import os
import select
import shutil
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Callable

import msgpack
import setproctitle

PR_SET_PDEATHSIG = 1


def setup_child(name: str, log_level: str, ipc_dir: str | None = None) -> None:
    """ipc_dir: removed by this child if the launcher dies without removing it (None: the
    child only exits)."""
    setproctitle.setproctitle(f"zserve::{name}")
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"[%(asctime)s {name}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(name, ipc_dir)


def watch_parent(name: str, ipc_dir: str | None) -> None:
    """Exit (after removing ipc_dir) as soon as the parent process is gone."""
    parent = multiprocessing.parent_process()        # None when not started by multiprocessing
    parent_pid = parent.pid if parent is not None else os.getppid()

    def leave() -> None:
        # Plain os.write: the main thread may hold the logging lock; this must not wait on it.
        os.write(2, f"[zserve::{name}] the launcher is gone: removing {ipc_dir} and "
                    f"exiting\n".encode(errors="replace"))
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        os._exit(1)

    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:                      # it died before we could watch it
        leave()
    except (AttributeError, OSError):               # no pidfds here: at least die with it
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # not Linux: the launcher's supervisor still tears children down
    else:
        def watch() -> None:
            select.select([pidfd], [], [])          # readable once the parent has exited
            leave()
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    # The pid could name another process if the parent died (and was reaped) before
    # pidfd_open; then we are no longer its child.
    if os.getppid() != parent_pid:
        leave()


def report_ready(conn: Connection, info: dict | None = None) -> None:
    conn.send_bytes(msgpack.packb({"ok": True, "info": info or {}}))
    conn.close()


def run_child(name: str, log_level: str, conn: Connection,
              main: Callable[[Callable[[dict | None], None]], None],
              ipc_dir: str | None = None) -> None:
    """Run `main(ready)` in a child; any exception before or after ready ends the process
    with a non-zero exit, after telling the launcher why if it is still waiting. ipc_dir:
    see setup_child."""
    setup_child(name, log_level, ipc_dir)
    ready_sent = False

    def ready(info: dict | None = None) -> None:
        nonlocal ready_sent
        return_freed_heap()
        report_ready(conn, info)
        ready_sent = True
    try:
        main(ready)
    except Exception:
        text = traceback.format_exc()
        logging.getLogger(name).error("fatal error:\n%s", text)
        if not ready_sent:
            try:
                conn.send_bytes(msgpack.packb({"ok": False, "error": text}))
            except OSError:
                pass
        os._exit(1)
    os._exit(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim      # glibc; not musl, not macOS
    except (OSError, AttributeError):
        return None


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere a
    no-op). glibc keeps a freed heap's pages resident for the life of the process: what a
    start-up (a model's load, a tokenizer's: tokenizer.json parsed twice) or a big answer
    freed would otherwise stay counted against the server."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


def read_ready(conn: Connection) -> dict:
    msg = msgpack.unpackb(conn.recv_bytes())
    if not msg.get("ok"):
        raise RuntimeError(msg.get("error", "child failed to start"))
    return msg["info"]
