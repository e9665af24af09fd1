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

Shaping: ``delay_ms`` on every sender's egress, the nodes' ``eth0`` and the root's ``<tag>r``, so every packet
crosses one delay whichever pair talks (node to node and node to coordinator alike: a round trip takes twice
``delay_ms``); ``rate_mbit`` (tbf) on each node's link both ways (its ``eth0`` out, its switch port in); the root's
link is not rate-limited.

The delay is tc's netem where the kernel has it (module sch_netem). Where it does not, each link is a *delay line*
instead of a veth: a pair of TAP devices (the node's ``eth0`` and its switch port; the root's ``<tag>r`` and
``coord``) whose frames a small process of ours (``python tests/netns.py delay-line``, one per link) reads and
writes across, holding those the near end sent (node or root to the switch) ``delay_ms`` and passing the others
at once: the same one delay per packet as netem on the sender's egress, in order as a link keeps it. The TAPs carry
virtio-net headers with TSO and checksum offload on, as a VM's link does, so a bulk transfer crosses in 64 KiB
frames and the process costs little CPU. It lives in the switch namespace (removed with it, also as a leftover) and
dies with the process that made the network (PR_SET_PDEATHSIG: that *thread*; make networks from a thread that
outlives them); its taps vanish with it. ``Network.delay_by`` says which ("netem", "userspace", or None).

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
import select
import shutil
import signal
import socket
import string
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from fcntl import ioctl
from typing import Literal, TypeVar

PREFIX = "dtn"  # every namespace and root-namespace link the harness makes starts with it
LEFTOVER = re.compile(rf"{PREFIX}(\d+)[a-z]")  # the pid of the run that made a name
INTERFACE = "eth0"  # a node's interface, inside its namespace (the same name in each)
CLONE_NEWNET = 0x40000000  # from <sched.h>: setns() into a network namespace
# from <linux/if_tun.h>: a TAP without packet info, with a virtio-net header; TSO and checksum offload on
TUNSETIFF, TUNSETOFFLOAD, IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x400454CA, 0x400454D0, 0x0002, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
FRAME_MAX = 1 << 17  # a read's buffer: a 64 KiB TSO frame with its Ethernet and virtio-net headers fits
DelayBy = Literal["netem", "userspace"]
T = TypeVar("T")

_contexts = itertools.count()  # tells apart the networks one process makes, nested or one after another


def _ip(*args: str) -> str:
    """Run ``ip``/``tc`` (``args[0]``); a failure raises with the command and what it said, on one line."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True)
    except OSError as error:  # the program is missing (iproute2 not installed): the callers' "not available here"
        raise RuntimeError(f"{' '.join(args)} failed: {error}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _tbf(rate_mbit: float) -> list[str]:
    """tc's token bucket at ``rate_mbit``; its burst is 10 ms of the rate (at least 32 KiB: 1 ms ticks at most)."""
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]


def _shape(namespace: str | None, device: str, netem_ms: float, rate_mbit: float | None) -> None:
    """Put netem's delay and the rate (tbf, under netem when both) on ``device``'s egress; nothing if neither."""
    tc = ["tc", *(["-n", namespace] if namespace else []), "qdisc", "replace", "dev", device]
    if netem_ms > 0:
        _ip(*tc, "root", "handle", "1:", "netem", "delay", f"{netem_ms}ms", "limit", "100000")
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
        try:
            _setns(path)
            outcome.append(work())
        except BaseException as error:  # noqa: BLE001  (handed to the caller's thread below)
            outcome.append(error)

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


def _setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns({path}): {os.strerror(error)}")
    finally:
        os.close(fd)


def _open_tap(name: str) -> int:
    """A new TAP device ``name`` in the caller's namespace, non-blocking; it lasts as long as the descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    return fd


def _run_delay_line(parent: int, delay_ms: float, near: tuple[str, str], far: tuple[str, str]) -> None:
    """The delay line's process (module docstring): TAPs ``near`` and ``far`` as (namespace path or "", name); what
    ``near`` sends reaches ``far`` ``delay_ms`` later, what ``far`` sends reaches ``near`` at once. A FIFO of
    release times is enough (one constant delay: they come in order); poll() waits for a frame or the next
    release, whole milliseconds, the rest of a release's wait a sleep (poll's rounding would add up to 1 ms)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl: nobody else will end us
        sys.exit(1)
    taps = []
    for namespace, name in (near, far):
        if namespace:
            _setns(namespace)
        taps.append(_open_tap(name))
    near_fd, far_fd = taps
    print("ready", flush=True)  # the taps exist: the maker configures them
    delay_s = delay_ms / 1000
    held: deque[tuple[float, bytes]] = deque()
    poller = select.poll()
    for fd in taps:
        poller.register(fd, select.POLLIN)
    while True:
        wait_ms = None if not held else max(0, int((held[0][0] - time.monotonic()) * 1000))
        for fd, events in poller.poll(wait_ms):
            if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                sys.exit(f"delay line: tap {fd} failed (poll events {events:#x})")
            now = time.monotonic()
            for _ in range(256):  # a batch, then the releases due
                try:
                    frame = os.read(fd, FRAME_MAX)
                except BlockingIOError:
                    break
                if fd == near_fd:
                    held.append((now + delay_s, frame))
                else:
                    _send(near_fd, frame)
        if held and (early := held[0][0] - time.monotonic()) > 0 and early < 0.001:
            time.sleep(early)
        now = time.monotonic()
        while held and held[0][0] <= now:
            _send(far_fd, held.popleft()[1])


def _send(fd: int, frame: bytes) -> None:
    """Write a frame to a TAP; one the kernel refuses (its device down or full) is lost, as on a wire."""
    with contextlib.suppress(OSError):
        os.write(fd, frame)


def _start_delay_line(delay_ms: float, near: tuple[str, str], far: tuple[str, str]) -> subprocess.Popen:
    """Start the delay line's process for one link; back once its taps exist (else the error it gave)."""
    line = subprocess.Popen([sys.executable, os.path.abspath(__file__), "delay-line", str(os.getpid()),
                             str(delay_ms), *near, *far], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    if line.stdout.readline() != "ready\n":
        line.kill()
        raise RuntimeError(f"delay line {near[1]} -> {far[1]} failed: {line.communicate()[1].strip()[-500:]}")
    return line


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Node:
    """One node: a namespace with one interface (``eth0``, ``address``) to the switch, whose port is ``port``."""

    namespace: str
    address: str
    port: str  # the node's port on the switch (the other end of its veth), in namespace ``switch``
    switch: str
    netem_ms: float  # netem's delay on eth0 (0 where a delay line delays the link, or no delay)
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
        return self.call(lambda: socket.socket(socket.AF_INET, kind))

    def call(self, work: Callable[[], T]) -> T:
        """``work()`` on a thread inside this node's namespace: what it asks of the network, it asks the node's."""
        return _in_namespace(f"/var/run/netns/{self.namespace}", work)

    def cut(self) -> None:
        """Drop every packet to and from this node (module docstring: why blackhole); its processes run on."""
        _ip("tc", "-n", self.namespace, "qdisc", "replace", "dev", self.interface, "root", "blackhole")
        _ip("tc", "-n", self.switch, "qdisc", "replace", "dev", self.port, "root", "blackhole")

    def heal(self) -> None:
        """Undo ``cut()``: the link's shaping as it was made."""
        _unshape(self.namespace, self.interface)
        _unshape(self.switch, self.port)
        _shape(self.namespace, self.interface, self.netem_ms, self.rate_mbit)
        _shape(self.switch, self.port, 0, self.rate_mbit)


@dataclass
class Network:
    """The nodes, the switch and the root namespace's place on their /24 (``root_address``: the coordinator's);
    ``delay_by``: what delays the links (module docstring), None without a delay."""

    tag: str
    subnet: ipaddress.IPv4Network
    root_address: str
    root_link: str
    switch: str
    delay_ms: float
    rate_mbit: float | None
    delay_by: DelayBy | None
    nodes: list[Node] = field(default_factory=list)
    delay_lines: list[subprocess.Popen] = field(default_factory=list)  # their processes, one per link

    @property
    def netem_ms(self) -> float:
        return self.delay_ms if self.delay_by == "netem" else 0

    def link(self, near_namespace: str | None, near: str, far: str) -> None:
        """A link from ``near`` (in ``near_namespace``; None: the root's) to port ``far`` on the switch: a veth
        pair, or a delay line's two taps."""
        if self.delay_by == "userspace":
            near_path = f"/var/run/netns/{near_namespace}" if near_namespace else ""
            self.delay_lines.append(_start_delay_line(self.delay_ms, (near_path, near),
                                                      (f"/var/run/netns/{self.switch}", far)))
        else:
            _ip("ip", "link", "add", near, *(["netns", near_namespace] if near_namespace else []), "type", "veth",
                "peer", "name", far, "netns", self.switch)

    def delay_line_cpu_s(self) -> float:
        """CPU seconds the delay lines' processes have used so far (0 without them)."""
        return sum(_cpu_s(line.pid) for line in self.delay_lines)

    def add_node(self) -> Node:
        """One more node on the switch (a spare started mid-run), shaped as the others."""
        k = len(self.nodes)
        if k + 2 >= self.subnet.num_addresses - 1:
            raise ValueError(f"{self.subnet} holds no more nodes than {k}")
        namespace, port = f"{self.tag}n{k}", f"p{k}"
        address = str(self.subnet.network_address + k + 2)
        _ip("ip", "netns", "add", namespace)
        node = Node(namespace, address, port, self.switch, self.netem_ms, self.rate_mbit)
        self.nodes.append(node)  # from here on, removed with the network
        self.link(namespace, INTERFACE, port)
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
    for line in network.delay_lines:  # its taps go with it
        _kill_group(line)
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
def nodes(n: int, delay_ms: float = 0, rate_mbit: float | None = None,
          delay_by: DelayBy | None = None) -> Iterator[Network]:
    """``n`` nodes on one switch with the root namespace (module docstring: the layout and the shaping); everything
    is removed on the way out, whatever happens in the block (an exception, Ctrl-C). A run killed outright leaves
    its names behind; the next ``nodes()`` removes them. ``delay_by``: netem where the kernel has it, else the
    delay line (None); name one to have it (tests of the delay line on a kernel with netem)."""
    if not 1 <= n <= 200:
        raise ValueError(f"nodes(n={n}): n must be 1 to 200 (one /24)")
    if delay_ms > 0 and delay_by is None:
        delay_by = "netem" if netem_available() is None else "userspace"
    _remove_leftovers()
    sequence = next(_contexts)
    tag = f"{PREFIX}{os.getpid()}{string.ascii_lowercase[sequence % 26]}"
    subnet = _free_subnet(os.getpid() * 26 + sequence)
    network = Network(tag, subnet, str(subnet.network_address + 1), f"{tag}r", f"{tag}s", delay_ms, rate_mbit,
                      delay_by if delay_ms > 0 else None)
    try:
        _ip("ip", "netns", "add", network.switch)
        _ip("ip", "-n", network.switch, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", network.switch, "link", "set", "br0", "up")
        network.link(None, network.root_link, "coord")
        _ip("ip", "addr", "add", f"{network.root_address}/{subnet.prefixlen}", "dev", network.root_link)
        _ip("ip", "link", "set", network.root_link, "up")
        _ip("ip", "-n", network.switch, "link", "set", "coord", "master", "br0")
        _ip("ip", "-n", network.switch, "link", "set", "coord", "up")
        _shape(None, network.root_link, network.netem_ms, None)
        for _ in range(n):
            network.add_node()
        yield network
    finally:
        _remove(network)


@functools.cache
def nodes_available(delay: bool = False) -> str | None:
    """Why ``nodes()`` can't run here (``delay``: with a delay, netem's or the delay line's), or None: a test skips
    with the reason. Tries each piece once in a throwaway namespace, so the reason names the piece that is missing."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (iproute2) on PATH"
    try:
        with _probe() as probe:
            pieces = [
                ("a veth pair", ["ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb"]),
                ("a bridge", ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"]),
                ("tc's blackhole qdisc (for cut())",
                 ["tc", "-n", probe, "qdisc", "add", "dev", "va", "root", "blackhole"]),
                ("tc's tbf qdisc (for rate_mbit)", ["tc", "-n", probe, "qdisc", "add", "dev", "vb", "root", *_tbf(10)]),
            ]
            for what, command in pieces:
                try:
                    _ip(*command)
                except RuntimeError as error:
                    return f"this kernel cannot make {what}: {error}"
            try:
                _in_namespace(f"/var/run/netns/{probe}", lambda: None)
            except OSError as error:
                return f"cannot enter a network namespace from a thread: {error}"
    except RuntimeError as error:  # _probe()'s own `ip netns add`
        return f"cannot make a network namespace: {error}"
    if delay and netem_available() is not None and delay_line_available() is not None:
        return f"no delay: {netem_available()}; and {delay_line_available()}"
    return None


@functools.cache
def netem_available() -> str | None:
    """Why tc's netem can't delay here (the kernel lacks module sch_netem), or None."""
    try:
        probe_context = _probe()
        probe = probe_context.__enter__()
    except RuntimeError as error:
        return f"cannot make a network namespace: {error}"
    with contextlib.ExitStack() as cleanup:
        cleanup.push(probe_context)
        try:
            _ip("ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb")
            _ip("tc", "-n", probe, "qdisc", "replace", "dev", "va", "root", "netem", "delay", "1ms")
        except RuntimeError as error:
            return f"this kernel cannot make tc's netem qdisc (kernel module sch_netem): {error}"
    return None


@functools.cache
def delay_line_available() -> str | None:
    """Why the delay line can't run here (no TUN/TAP: /dev/net/tun), or None; starts one between two namespaces."""
    try:
        with _probe() as near, _probe() as far:
            try:
                line = _start_delay_line(1, (f"/var/run/netns/{near}", "ta"), (f"/var/run/netns/{far}", "tb"))
            except RuntimeError as error:
                return f"cannot make the delay line's TAP devices (/dev/net/tun): {error}"
            _kill_group(line)
    except RuntimeError as error:  # _probe()'s own `ip netns add`
        return f"cannot make a network namespace: {error}"
    return None


@contextlib.contextmanager
def _probe() -> Iterator[str]:
    """A throwaway namespace for the checks above, removed after (nodes_available() checks first that one can be
    made)."""
    probe = f"{PREFIX}{os.getpid()}z{next(_contexts)}"
    _ip("ip", "netns", "add", probe)
    try:
        yield probe
    finally:
        _remove_namespace(probe)


if __name__ == "__main__" and sys.argv[1:2] == ["delay-line"]:  # a link's delay line (_start_delay_line)
    _parent, _delay_ms, _near_namespace, _near, _far_namespace, _far = sys.argv[2:]
    _run_delay_line(int(_parent), float(_delay_ms), (_near_namespace, _near), (_far_namespace, _far))
