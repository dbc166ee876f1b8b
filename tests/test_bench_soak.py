"""bench/soak.py against the tiny llama server: an abort-only mix, where every client's
stream holds its connection while it asks for its own abort, finishes by itself."""

from __future__ import annotations

import json
import time

import pytest

from bench import soak

pytestmark = pytest.mark.e2e


def test_abort_heavy_soak_finishes(llama_server, tmp_path):
    # Before the aborts had a client of their own, `concurrency` aborts at once waited
    # forever for a connection of a pool the streams they abort held: until the pool
    # timeout (--request-timeout), then every one failed.
    out = tmp_path / "soak.json"
    t0 = time.monotonic()
    code = soak.main(["--base-url", llama_server.url, "--duration", "3", "--warmup", "1",
                      "--concurrency", "2", "--mix", "abort=1", "--request-timeout", "60",
                      "--drain-timeout", "30", "--json", str(out)])
    elapsed = time.monotonic() - t0
    result = json.loads(out.read_text())
    assert code == 0, result["first_errors"]
    assert result["ok"]["abort"] == result["started"]["abort"] > 2
    assert result["checks"]["deadline"]["ok"]
    assert elapsed < 60          # 3 + 1 s of load, the idle checks; nothing waited for a pool
