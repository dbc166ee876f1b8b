"""End to end: one model across two "nodes" on this machine: two launch.py invocations,
node ranks 0 and 1, loopback addresses, --tp-size 2 (rank 0 on node 0, rank 1 on node 1).

Node 0 serves greedy outputs equal to transformers'; SIGKILL of node 1's launcher (its rank
goes with it) takes node 0 down non-zero, leaving no process of either node.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from tests.reference import assert_greedy_match, greedy_reference
from tests.server import REPO, Server, free_port, wait_until
from tests.test_lifecycle import gone

pytestmark = pytest.mark.e2e

MAX_NEW = 12


def port_pair() -> int:
    """A free port P whose P + 1 (the node link) is free too."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    pytest.fail("no two free adjacent ports")


def node_flags(port: int, rank: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr",
            f"127.0.0.1:{port}", "--tp-size", "2"]


@pytest.fixture
def nodes(tiny_model, tmp_path):
    """(node 0 as a Server, node 1's launcher process); node 1 starts first, as it may."""
    port = port_pair()
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, str(REPO / "launch.py"), "--model-path", str(tiny_model("llama")),
         "--log-level", "info", *node_flags(port, 1)],
        cwd=REPO, env={"OMP_NUM_THREADS": "1", **os.environ, "TMPDIR": str(tmp_path)},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        node0 = Server(tiny_model("llama"), *node_flags(port, 0), tmpdir=tmp_path)
    except BaseException:
        node1.kill()
        raise
    node0.node1 = node1
    node0.node1_log = tmp_path / "node1.log"
    try:
        yield node0
    finally:
        node1.kill()
        node1.wait(10)
        node0.kill()
        log.close()


def test_two_nodes_serve_one_model_and_a_lost_node_takes_the_server_down(nodes, tiny_model):
    node1 = psutil.Process(nodes.node1.pid)
    follower = [p for p in node1.children() if p.cmdline()[:1] == ["zserve::scheduler-tp1"]]
    assert len(follower) == 1, node1.children()      # rank 1 runs under node 1's launcher
    ps = [[5, 6, 7, 8], list(range(20, 60)), [300, 2, 9]]
    outs = nodes.generate_ok(input_ids=ps, sampling_params={
        "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True})
    for p, out in zip(ps, outs):
        ref, margins = greedy_reference(tiny_model("llama"), p, MAX_NEW)
        assert_greedy_match(out["output_ids"], ref, margins)

    procs = [psutil.Process(nodes.proc.pid), *nodes.children, node1, *follower]
    node1.kill()                        # the whole node: its launcher, then its rank
    assert nodes.proc.wait(timeout=15) != 0, nodes.logs()
    assert gone(procs, 10.0), [p for p in procs if p.is_running()]
    assert "The node 1 process died" in nodes.logs()
    assert not list(nodes.log_path.parent.glob("zserve-*/"))
    wait_until(lambda: nodes.node1.poll() is not None, 10, "node 1's launcher to be reaped")
