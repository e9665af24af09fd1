"""The node harness (tests/netns.py) against what the kernel reports: sockets between namespaces, the time a round
trip or a transfer takes against the delay's (netem's or the delay line's) and tbf's settings, processes'
namespaces and liveness from /proc, and `ip` listings after the block. No training launches: the node tests of
issue 39 stand on these."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest

from .netns import (PREFIX, Network, Node, delay_line_available, netem_available, nodes,
                    nodes_available)

REASON = nodes_available()
pytestmark = [pytest.mark.alone, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
SILENT_S = 1.0  # how long a probe waits where the node must not answer
ANSWER_S = 10.0  # how long it may wait where the node must answer (a loaded machine; ARP and TCP retrying after heal)


def listener(network: Network, node: Node | None) -> socket.socket:
    """A listening TCP socket on ``node`` (None: the root namespace, the coordinator's place), on a free port."""
    server = node.socket() if node else socket.socket()
    server.bind((node.address if node else network.root_address, 0))
    server.listen()
    server.settimeout(ANSWER_S)
    return server


def connect(client: socket.socket, server: socket.socket, timeout_s: float = ANSWER_S) -> socket.socket:
    """Connect ``client`` to ``server`` within ``timeout_s``; the server's end of the connection."""
    client.settimeout(timeout_s)
    client.connect(server.getsockname())
    conn, _ = server.accept()
    conn.settimeout(ANSWER_S)
    return conn


def round_trip(client: socket.socket, conn: socket.socket) -> float:
    """Seconds for 4 bytes from the client to the server's end and back (asserting they come back unchanged)."""
    start = time.monotonic()
    client.sendall(b"ping")
    received = conn.recv(4)
    conn.sendall(received)
    echoed = client.recv(4)
    elapsed = time.monotonic() - start
    assert received == echoed == b"ping"
    return elapsed


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def names_of(pid: int) -> list[str]:
    """What `ip` lists for the run of process ``pid`` (read here, not through the harness)."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.split()
    return [name for name in namespaces + links if re.match(rf"{PREFIX}{pid}[a-z]", name)]


def test_two_nodes_talk_through_the_switch_and_reach_the_root_namespace() -> None:
    with nodes(2) as network:
        a, b = network.nodes
        server = listener(network, a)
        client = b.socket()
        conn = connect(client, server)
        assert conn.getpeername()[0] == b.address  # the kernel saw it come from b's interface, not from loopback
        round_trip(client, conn)
        coordinator = listener(network, None)
        from_a = a.socket()
        conn = connect(from_a, coordinator)
        assert conn.getpeername()[0] == a.address
        round_trip(from_a, conn)


def test_a_process_started_on_a_node_runs_in_its_namespace_and_reaches_the_coordinator() -> None:
    with nodes(1) as network:
        (node,) = network.nodes
        coordinator = listener(network, None)
        coordinator.settimeout(30)  # the process starts Python first
        host, port = coordinator.getsockname()
        proc = node.popen([sys.executable, "-c", f"import socket; socket.create_connection(('{host}', {port}), 10)"
                                                 ".sendall(b'here')"])
        conn, (peer, _) = coordinator.accept()
        conn.settimeout(10)
        assert conn.recv(4) == b"here" and peer == node.address
        assert proc.wait(10) == 0


# what delays the links: netem where the kernel has it, the delay line (TAPs) otherwise; each tested where it runs
DELAYS = [pytest.param("netem", marks=pytest.mark.skipif(netem_available() is not None,
                                                          reason=netem_available() or "")),
          pytest.param("userspace", marks=pytest.mark.skipif(delay_line_available() is not None,
                                                              reason=delay_line_available() or ""))]


def round_trips(delay_ms: float, delay_by: str | None) -> tuple[float, float]:
    """The shortest of 3 round trips between two nodes, and from a node to the root namespace, in seconds."""
    with nodes(2, delay_ms=delay_ms, delay_by=delay_by) as network:
        assert network.delay_by == (delay_by if delay_ms else None)
        a, b = network.nodes
        server = listener(network, a)
        client = b.socket()
        conn = connect(client, server)
        between_nodes = min(round_trip(client, conn) for _ in range(3))
        coordinator = listener(network, None)
        client = a.socket()
        conn = connect(client, coordinator)
        to_coordinator = min(round_trip(client, conn) for _ in range(3))
    return between_nodes, to_coordinator


@pytest.mark.parametrize("delay_by", DELAYS)
def test_a_round_trip_takes_twice_the_configured_delay(delay_by: str) -> None:
    delay_s = 0.02
    undelayed = round_trips(0, None)
    delayed = round_trips(delay_s * 1000, delay_by)
    assert max(undelayed) < 0.005, undelayed  # the delay is the harness's, not the machine's
    for measured in delayed:  # each way crosses one delay (the sender's)
        assert 2 * delay_s <= measured < 3 * delay_s, delayed


@pytest.mark.parametrize("delay_by", [None, *DELAYS])
def test_a_transfer_takes_as_long_as_the_configured_rate(delay_by: str | None) -> None:
    rate_mbit, size = 16, 1_000_000
    burst = max(32 * 1024, rate_mbit * 1e6 / 8 / 100)  # what tbf may send at once (tests/netns.py's _tbf)
    with nodes(2, rate_mbit=rate_mbit, delay_ms=5 if delay_by else 0, delay_by=delay_by) as network:
        a, b = network.nodes
        server = listener(network, b)
        client = a.socket()
        conn = connect(client, server)
        conn.settimeout(10)
        start = time.monotonic()
        sender = threading.Thread(target=client.sendall, args=(b"x" * size,))
        sender.start()
        received = b""
        while len(received) < size:
            received += conn.recv(1 << 16)
        elapsed = time.monotonic() - start
        sender.join()
    assert received == b"x" * size  # every byte, none twice (TSO frames cross the delay line whole)
    floor = (size - burst) * 8 / (rate_mbit * 1e6)  # tbf's rate; TCP's headers only add to it
    assert floor <= elapsed < 2 * floor + 0.5, elapsed


def test_a_cut_node_is_silent_both_ways_while_the_others_talk_and_answers_again_when_healed() -> None:
    with nodes(3) as network:
        a, b, c = network.nodes
        on_a, on_c, coordinator = listener(network, a), listener(network, c), listener(network, None)
        before = b.socket()
        open_to_a = connect(before, on_a)
        round_trip(before, open_to_a)
        on_the_node = a.popen([sys.executable, "-c", "import time; time.sleep(60)"])

        a.cut()
        before.sendall(b"ping")  # the kernel takes it: silence, not an error, as in a partition
        open_to_a.settimeout(SILENT_S)
        with pytest.raises(TimeoutError):
            open_to_a.recv(4)
        with pytest.raises(TimeoutError):
            connect(b.socket(), on_a, SILENT_S)
        with pytest.raises(TimeoutError):
            connect(a.socket(), coordinator, SILENT_S)  # a has lost the coordinator too
        b_to_c = b.socket()
        round_trip(b_to_c, connect(b_to_c, on_c))
        c_to_coordinator = c.socket()
        round_trip(c_to_coordinator, connect(c_to_coordinator, coordinator))

        assert on_the_node.poll() is None, "cut() ended a process on the node"
        a.heal()
        b_to_a = b.socket()
        round_trip(b_to_a, connect(b_to_a, on_a))
        a_to_coordinator = a.socket()
        round_trip(a_to_coordinator, connect(a_to_coordinator, coordinator))


PARENT_OF_A_SLEEPER = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    time.sleep(60)
""")


def test_kill_ends_every_process_of_the_node_and_no_other() -> None:
    with nodes(2) as network:
        a, b = network.nodes
        parent = a.popen([sys.executable, "-c", PARENT_OF_A_SLEEPER], stdout=subprocess.PIPE, text=True)
        child = int(parent.stdout.readline())
        other = b.popen([sys.executable, "-c", "import time; time.sleep(60)"])
        namespace = os.stat(f"/var/run/netns/{a.namespace}").st_ino
        for pid in (parent.pid, child):  # both run inside the node's namespace
            assert os.stat(f"/proc/{pid}/ns/net").st_ino == namespace
        assert alive(parent.pid) and alive(child)

        a.kill()
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert parent.returncode == -9
        assert not alive(child), "the node's agent died but its worker runs on"
        assert other.poll() is None, "another node's process was killed"


def test_nothing_is_left_after_the_block_even_when_it_fails() -> None:
    with pytest.raises(ZeroDivisionError):
        with nodes(2) as network:
            sleeper = network.nodes[0].popen([sys.executable, "-c", "import time; time.sleep(60)"])
            assert names_of(os.getpid())  # the listing does see what the harness made
            1 / 0
    assert names_of(os.getpid()) == []
    assert not alive(sleeper.pid)


A_RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from tests.netns import nodes
    with nodes(1):
        print("up", flush=True)
        time.sleep(60)
""")


def test_an_interrupted_run_cleans_up_and_a_killed_runs_leftovers_go_with_the_next_run() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [subprocess.Popen([sys.executable, "-c", A_RUN, repo], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        for run in runs:
            assert run.stdout.readline() == "up\n"
        interrupted, killed = runs
        killed.kill()  # no cleanup of its own can run
        killed.wait()
        assert names_of(killed.pid), "a SIGKILLed run leaves its namespaces: the premise"
        with nodes(1):
            assert names_of(killed.pid) == []  # the next run removed them
            assert names_of(interrupted.pid), "a live run's namespaces were removed"
        interrupted.send_signal(signal.SIGINT)  # Ctrl-C
        assert interrupted.wait(10) != 0
        assert names_of(interrupted.pid) == []
    finally:
        for run in runs:
            run.kill()
            run.wait()


A_DELAYED_RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from tests.netns import nodes
    with nodes(2, delay_ms=1, delay_by="userspace") as network:
        print(*(line.pid for line in network.delay_lines), flush=True)
        time.sleep(60)
""")


@pytest.mark.skipif(delay_line_available() is not None, reason=delay_line_available() or "")
def test_the_delay_lines_end_with_the_block_and_with_a_run_killed_outright() -> None:
    with nodes(2, delay_ms=1, delay_by="userspace") as network:
        lines = [line.pid for line in network.delay_lines]
        assert len(lines) == 3  # the root's link and each node's
        spare = network.add_node()  # a link of its own
        assert len(network.delay_lines) == 4
        client = spare.socket()
        server = listener(network, network.nodes[0])
        round_trip(client, connect(client, server))
        assert all(alive(pid) for pid in lines)
        lines.append(network.delay_lines[-1].pid)
    assert not any(alive(pid) for pid in lines)

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.Popen([sys.executable, "-c", A_DELAYED_RUN, repo], stdout=subprocess.PIPE, text=True)
    try:
        lines = [int(pid) for pid in run.stdout.readline().split()]
        assert len(lines) == 3 and all(alive(pid) for pid in lines)
        run.kill()  # no cleanup of its own: PR_SET_PDEATHSIG ends the lines
        run.wait()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in lines) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(alive(pid) for pid in lines), "a delay line outlived the run that made it"
    finally:
        run.kill()
        run.wait()
    with nodes(1):
        assert names_of(run.pid) == []  # its namespaces and root link went with the next run


def test_a_spare_node_added_mid_run_talks_to_the_others() -> None:
    with nodes(1) as network:
        first = network.nodes[0]
        server = listener(network, first)
        spare = network.add_node()
        assert spare.address not in (first.address, network.root_address)
        client = spare.socket()
        round_trip(client, connect(client, server))


GLOO_RANK = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(total.item(), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow  # two processes importing torch: 3 s on an idle machine, 13 s on a loaded one
def test_gloo_ranks_on_two_nodes_all_reduce_through_a_store_in_the_root_namespace() -> None:
    """The premise of the node tests: a store where the coordinator runs, and gloo between nodes with ``env()``'s
    GLOO_SOCKET_IFNAME (without it gloo binds what the hostname resolves to, not the node's interface)."""
    import torch.distributed as dist

    with nodes(2) as network:
        store = dist.TCPStore(network.root_address, 0, None, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        ranks = [node.popen([sys.executable, "-c", GLOO_RANK, network.root_address, str(store.port), str(rank)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank, node in enumerate(network.nodes)]
        outputs = [rank.communicate(timeout=60) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [float(out) for out, _ in outputs] == [3.0, 3.0]  # 1 + 2, each rank's contribution
