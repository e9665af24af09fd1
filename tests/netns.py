"""Nodes on one machine: one network namespace per node, linked to a switch, so a test can kill a node or cut it off
the network as a cluster would lose it (issue 39, part 7). A test helper, not part of the package.

The layout, for ``nodes(n)``; every name starts with ``dtn<pid><letter>`` so parallel runs never collide and a later
run can tell a crashed run's leftovers (its pid is gone) from a live run's:

    root namespace (the test, the coordinator)  <tag>r 10.A.B.1/24 ──veth── coord ┐
                                                                                 br0 in namespace <tag>s (the switch)
    namespace <tag>n0 (node 0): eth0 10.A.B.2/24 ──────────────────veth── p0 ┤
    namespace <tag>n1 (node 1): eth0 10.A.B.3/24 ──────────────────veth── p1 ┘

The bridge sits in a namespace of its own, not in the root namespace: a bridge in the root namespace passes its
frames through the root's iptables FORWARD chain when br_netfilter is loaded (``bridge-nf-call-iptables``), and a
host with Docker drops them there; a namespace of its own has empty chains. The root namespace still gets an address
on the nodes' /24, so a coordinator in the test's own namespace is reachable from every node at ``root_address``.

Shaping: ``delay_ms`` (netem) on every sender's egress, the nodes' ``eth0`` and the root's ``<tag>r``, so every
packet crosses one delay whichever pair talks (node to node and node to coordinator alike: a round trip takes twice
``delay_ms``); ``rate_mbit`` (tbf) on each node's link both ways (its ``eth0`` out, its switch port in); the root's
link is not rate-limited.

``Node.cut()`` puts tc's ``blackhole`` qdisc on both ends of the node's link: the kernel drops every packet there and
tells the sender it was sent, so TCP sees silence (retransmits, then a timeout) as in a real partition, both ways and
to the coordinator too, while the node's processes run on. ``ip link set down`` would not do: a local sender gets
ENETUNREACH at once, which no real partition gives. blackhole is in every kernel with tc (no module such as
sch_netem, which some kernels lack); iptables is not installed everywhere.

Use (a coordinator in the test's namespace, an agent per node; names from docs/fault-tolerance.md)::

    with nodes(3, delay_ms=1, rate_mbit=1000) as network:
        endpoint = f"launch.rdzv_endpoint={network.root_address}:{port}"
        coordinator = subprocess.Popen([..., "fault_tolerance.role=coordinator", endpoint, ...])
        agents = [node.popen([..., "fault_tolerance.role=agent", endpoint, ...]) for node in network.nodes]
        network.nodes[2].kill()   # or .cut(), then .heal(); network.add_node() for a spare
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

PREFIX = "dtn"  # every namespace and root-namespace link the harness makes starts with it
LEFTOVER = re.compile(rf"{PREFIX}(\d+)[a-z]")  # the pid of the run that made a name
INTERFACE = "eth0"  # a node's interface, inside its namespace (the same name in each)
CLONE_NEWNET = 0x40000000  # from <sched.h>: setns() into a network namespace
T = TypeVar("T")

_contexts = itertools.count()  # tells apart the networks one process makes, nested or one after another


def _ip(*args: str) -> str:
    """Run ``ip``/``tc`` (``args[0]``); a failure raises with the command and what it said, on one line."""
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _tbf(rate_mbit: float) -> list[str]:
    """tc's token bucket at ``rate_mbit``; its burst is 10 ms of the rate (at least 32 KiB: 1 ms ticks at most)."""
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]


def _shape(namespace: str | None, device: str, delay_ms: float, rate_mbit: float | None) -> None:
    """Put the delay (netem) and the rate (tbf, under netem when both) on ``device``'s egress; nothing if neither."""
    tc = ["tc", *(["-n", namespace] if namespace else []), "qdisc", "replace", "dev", device]
    if delay_ms > 0:
        _ip(*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", "limit", "100000")
        if rate_mbit:
            _ip(*tc, "parent", "1:1", "handle", "10:", *_tbf(rate_mbit))
    elif rate_mbit:
        _ip(*tc, "root", *_tbf(rate_mbit))


def _unshape(namespace: str, device: str) -> None:
    """Back to the device's default qdisc (a veth's is none)."""
    subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True)


def _in_namespace(path: str, work: Callable[[], T]) -> T:
    """Run ``work`` on a thread that entered the network namespace at ``path``; the caller's thread stays where it is.
    A socket belongs to the namespace it was made in, so a socket made this way talks from inside the node."""
    outcome: list = []

    def enter_and_work() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns({path}): {os.strerror(error)}")
            outcome.append(work())
        except BaseException as error:  # noqa: BLE001  (handed to the caller's thread below)
            outcome.append(error)
        finally:
            os.close(fd)

    thread = threading.Thread(target=enter_and_work)
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Node:
    """One node: a namespace with one interface (``eth0``, ``address``) to the switch, whose port is ``port``."""

    namespace: str
    address: str
    port: str  # the node's port on the switch (the other end of its veth), in namespace ``switch``
    switch: str
    delay_ms: float
    rate_mbit: float | None
    interface: str = INTERFACE
    processes: list[subprocess.Popen] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """The environment for a process on this node: ours, with gloo's and NCCL's sockets on the node's interface.
        Without GLOO_SOCKET_IFNAME gloo binds what the hostname resolves to, the host's address (or 127.0.0.1 from
        /etc/hosts), which no other node can reach: tests/test_netns.py shows it."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": self.interface, "NCCL_SOCKET_IFNAME": self.interface}

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the namespace, in a process group of its own (what ``kill()`` kills), with the
        environment ``env`` (default ``env()``; pass another to test a process's own choice of interface).
        ``ip netns exec`` execs ``argv`` in place: the Popen's pid is the process's."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv],
                                env=self.env() if env is None else env, start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def kill(self) -> None:
        """SIGKILL every process group this node started (an agent and the workers it started): the node is lost."""
        while self.processes:  # forgotten once killed: a reaped pid may be reused
            _kill_group(self.processes.pop())

    def socket(self, kind: socket.SocketKind = socket.SOCK_STREAM) -> socket.socket:
        """An IPv4 socket of the test's own, inside this node's namespace (for probes without a process)."""
        return _in_namespace(f"/var/run/netns/{self.namespace}", lambda: socket.socket(socket.AF_INET, kind))

    def cut(self) -> None:
        """Drop every packet to and from this node (module docstring: why blackhole); its processes run on."""
        _ip("tc", "-n", self.namespace, "qdisc", "replace", "dev", self.interface, "root", "blackhole")
        _ip("tc", "-n", self.switch, "qdisc", "replace", "dev", self.port, "root", "blackhole")

    def heal(self) -> None:
        """Undo ``cut()``: the link's shaping as it was made."""
        _unshape(self.namespace, self.interface)
        _unshape(self.switch, self.port)
        _shape(self.namespace, self.interface, self.delay_ms, self.rate_mbit)
        _shape(self.switch, self.port, 0, self.rate_mbit)


@dataclass
class Network:
    """The nodes, the switch and the root namespace's place on their /24 (``root_address``: the coordinator's)."""

    tag: str
    subnet: ipaddress.IPv4Network
    root_address: str
    root_link: str
    switch: str
    delay_ms: float
    rate_mbit: float | None
    nodes: list[Node] = field(default_factory=list)

    def add_node(self) -> Node:
        """One more node on the switch (a spare started mid-run), shaped as the others."""
        k = len(self.nodes)
        if k + 2 >= self.subnet.num_addresses - 1:
            raise ValueError(f"{self.subnet} holds no more nodes than {k}")
        namespace, port = f"{self.tag}n{k}", f"p{k}"
        address = str(self.subnet.network_address + k + 2)
        _ip("ip", "netns", "add", namespace)
        node = Node(namespace, address, port, self.switch, self.delay_ms, self.rate_mbit)
        self.nodes.append(node)  # from here on, removed with the network
        _ip("ip", "link", "add", INTERFACE, "netns", namespace, "type", "veth", "peer", "name", port, "netns",
            self.switch)
        _ip("ip", "-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", INTERFACE)
        _ip("ip", "-n", namespace, "link", "set", INTERFACE, "up")
        _ip("ip", "-n", namespace, "link", "set", "lo", "up")
        _ip("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        _ip("ip", "-n", self.switch, "link", "set", port, "up")
        node.heal()  # the shaping
        return node


def _remove_namespace(name: str) -> None:
    """Kill whatever still runs inside (a namespace outlives its deletion while a process holds it), then delete."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _remove(network: Network) -> None:
    for node in network.nodes:
        node.kill()
    for node in network.nodes:
        _remove_namespace(node.namespace)
    subprocess.run(["ip", "link", "del", network.root_link], capture_output=True)
    _remove_namespace(network.switch)


def names_made_here() -> list[str]:
    """The namespaces and root-namespace links whose names start with the harness's prefix, any run's."""
    namespaces = [line.split()[0] for line in _ip("ip", "netns", "list").splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("ip", "-o", "link").splitlines()]
    return [name for name in [*namespaces, *links] if name.startswith(PREFIX)]


def _remove_leftovers() -> None:
    """Remove what a run that is gone (killed before its cleanup) left behind; a live run's names stay."""
    for name in names_made_here():
        match = LEFTOVER.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if subprocess.run(["ip", "link", "del", name], capture_output=True).returncode != 0:
            _remove_namespace(name)


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.128.0.0/9 that overlaps no address or route here, starting from one the seed picks (the pid:
    parallel runs start apart)."""
    used = []
    for line in _ip("ip", "-4", "-o", "addr").splitlines():
        used.append(ipaddress.ip_network(line.split()[3], strict=False))
    for line in _ip("ip", "-4", "route", "show", "table", "all").splitlines():
        destination = line.split()[0]
        if destination[0].isdigit():
            used.append(ipaddress.ip_network(destination, strict=False))
    for step in range(1 << 15):
        index = (seed + step) % (1 << 15)
        subnet = ipaddress.ip_network(f"10.{128 + index // 256}.{index % 256}.0/24")
        if not any(subnet.overlaps(network) for network in used):
            return subnet
    raise RuntimeError("no free /24 in 10.128.0.0/9 for the nodes")


@contextlib.contextmanager
def nodes(n: int, delay_ms: float = 0, rate_mbit: float | None = None) -> Iterator[Network]:
    """``n`` nodes on one switch with the root namespace (module docstring: the layout and the shaping); everything
    is removed on the way out, whatever happens in the block (an exception, Ctrl-C). A run killed outright leaves
    its names behind; the next ``nodes()`` removes them."""
    if not 1 <= n <= 200:
        raise ValueError(f"nodes(n={n}): n must be 1 to 200 (one /24)")
    _remove_leftovers()
    sequence = next(_contexts)
    tag = f"{PREFIX}{os.getpid()}{string.ascii_lowercase[sequence % 26]}"
    subnet = _free_subnet(os.getpid() * 26 + sequence)
    network = Network(tag, subnet, str(subnet.network_address + 1), f"{tag}r", f"{tag}s", delay_ms, rate_mbit)
    try:
        _ip("ip", "netns", "add", network.switch)
        _ip("ip", "-n", network.switch, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", network.switch, "link", "set", "br0", "up")
        _ip("ip", "link", "add", network.root_link, "type", "veth", "peer", "name", "coord", "netns", network.switch)
        _ip("ip", "addr", "add", f"{network.root_address}/{subnet.prefixlen}", "dev", network.root_link)
        _ip("ip", "link", "set", network.root_link, "up")
        _ip("ip", "-n", network.switch, "link", "set", "coord", "master", "br0")
        _ip("ip", "-n", network.switch, "link", "set", "coord", "up")
        _shape(None, network.root_link, delay_ms, None)
        for _ in range(n):
            network.add_node()
        yield network
    finally:
        _remove(network)


@functools.cache
def nodes_available(delay: bool = False) -> str | None:
    """Why ``nodes()`` can't run here (``delay``: with netem's delay), or None: a test skips with the reason.
    Tries each piece once in a throwaway namespace, so the reason names the piece that is missing."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (iproute2) on PATH"
    probe = f"{PREFIX}{os.getpid()}z"
    try:
        _ip("ip", "netns", "add", probe)
    except RuntimeError as error:
        return f"cannot make a network namespace: {error}"
    try:
        pieces = [
            ("a veth pair", ["ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb"]),
            ("a bridge", ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"]),
            ("tc's blackhole qdisc (for cut())", ["tc", "-n", probe, "qdisc", "add", "dev", "va", "root", "blackhole"]),
            ("tc's tbf qdisc (for rate_mbit)", ["tc", "-n", probe, "qdisc", "add", "dev", "vb", "root", *_tbf(10)]),
        ]
        if delay:
            pieces.append(("tc's netem qdisc (for delay_ms; kernel module sch_netem)",
                           ["tc", "-n", probe, "qdisc", "replace", "dev", "va", "root", "netem", "delay", "1ms"]))
        for what, command in pieces:
            try:
                _ip(*command)
            except RuntimeError as error:
                return f"this kernel cannot make {what}: {error}"
        try:
            _in_namespace(f"/var/run/netns/{probe}", lambda: None)
        except OSError as error:
            return f"cannot enter a network namespace from a thread: {error}"
        return None
    finally:
        _remove_namespace(probe)
