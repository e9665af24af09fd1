"""A receive waiting on a host cut off the network ends as soon as that host's connections are severed, not at gloo's
timeout (``engine/sever.py``). Two nodes as network namespaces (tests/netns.py); the fault is a real cut.

Oracle: the time the pending receive took to fail, against gloo's timeout (30 s here) and the moment of the sever
(2 s after the cut): the failure must come within a few seconds of the sever. And a control: the same wait with
nothing severed (``hosts`` empty) is still blocked well past that.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from .netns import nodes, nodes_available

REASON = nodes_available()
pytestmark = [pytest.mark.alone, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

RANK = textwrap.dedent("""
    import sys, threading, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from decent_train.engine.sever import sever_connections_to
    host, port, rank, peer_host, sever = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(1))  # the pair is connected
    store.set(f"ready/{rank}", "")
    if rank == 1:
        time.sleep(120)  # alive, silent: the test cuts this node off
    store.wait(["cut"])
    hosts = {peer_host} if sever == "yes" else set()
    threading.Timer(2.0, lambda: print("severed", sever_connections_to(hosts, frozenset({(host, port)})),
                                       flush=True)).start()
    start = time.monotonic()
    try:
        dist.recv(torch.zeros(1), 1)
        print("received", flush=True)
    except RuntimeError as error:
        print(f"failed after {time.monotonic() - start:.2f} s: {str(error)[:120]}", flush=True)
    import os
    os._exit(0)
""")


def run_pair(sever: bool, wait_s: float) -> tuple[str, int | None]:
    """Rank 0 waits on a receive from rank 1, whose node is then cut off; what rank 0 printed within ``wait_s``
    seconds of the cut, and its exit code (None: still waiting)."""
    import torch.distributed as dist

    with nodes(2) as network:
        store = dist.TCPStore(network.root_address, 0, None, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        waiting, silent = network.nodes
        ranks = [node.popen([sys.executable, "-c", RANK, network.root_address, str(store.port), str(rank),
                             network.nodes[1 - rank].address, "yes" if sever else "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank, node in enumerate((waiting, silent))]
        store.wait(["ready/0", "ready/1"], timedelta(seconds=60))
        silent.cut()
        store.set("cut", "")
        try:
            out, _ = ranks[0].communicate(timeout=wait_s)
            return out, ranks[0].returncode
        except subprocess.TimeoutExpired:
            ranks[0].kill()
            out, _ = ranks[0].communicate()
            return out, None


@pytest.mark.slow  # two processes importing torch in namespaces: 5-15 s
def test_a_receive_from_a_cut_off_host_fails_once_the_host_is_severed() -> None:
    out, code = run_pair(sever=True, wait_s=20)
    assert code == 0, out[-2000:]
    assert "severed 1" in out, out[-2000:]  # the one gloo connection to the peer, not the store's
    failed = float(out.split("failed after ")[1].split(" s")[0])
    assert 1.5 < failed < 6.0, out[-2000:]  # the sever comes 2 s after the cut; gloo's own timeout is 30 s


@pytest.mark.slow
def test_without_the_sever_the_receive_waits_on() -> None:
    """The control: the cut alone does not end the wait (so the test above measures the sever)."""
    out, code = run_pair(sever=False, wait_s=10)
    assert code is None and "failed" not in out and "received" not in out, out[-2000:]
