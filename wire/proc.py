"""What every child process does the same way: title, logging, signals, the ready report.

A child reports readiness (or the exception that stopped it) to launch.py over a pipe with
msgpack bytes; nothing is pickled. Children ignore SIGINT and SIGTERM: launch.py owns
shutdown (a Ctrl-C or a `kill` of the whole process group must not look like a crashed
child) and stops them with SIGKILL; they hold nothing that needs flushing. They also die
with their parent (PR_SET_PDEATHSIG), so a killed launcher never leaves orphans.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Callable

import msgpack
import setproctitle

PR_SET_PDEATHSIG = 1


def setup_child(name: str, log_level: str) -> None:
    setproctitle.setproctitle(f"zserve::{name}")
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"[%(asctime)s {name}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the launcher's supervisor still tears children down
    if os.getppid() == 1:        # the parent died before prctl took effect
        os._exit(1)


def report_ready(conn: Connection, info: dict | None = None) -> None:
    conn.send_bytes(msgpack.packb({"ok": True, "info": info or {}}))
    conn.close()


def run_child(name: str, log_level: str, conn: Connection,
              main: Callable[[Callable[[dict | None], None]], None]) -> None:
    """Run `main(ready)` in a child; any exception before or after ready ends the process
    with a non-zero exit, after telling the launcher why if it is still waiting."""
    setup_child(name, log_level)
    ready_sent = False

    def ready(info: dict | None = None) -> None:
        nonlocal ready_sent
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


def read_ready(conn: Connection) -> dict:
    msg = msgpack.unpackb(conn.recv_bytes())
    if not msg.get("ok"):
        raise RuntimeError(msg.get("error", "child failed to start"))
    return msg["info"]
