"""Where this node is on the network, as the other nodes of a job reach it: the address and interface on its route to
the rendezvous endpoint (or the live coordinator), and whether the endpoint is this node's own.

Left to themselves, torch's agent and gloo ask the hostname: the workers' store is advertised at ``socket.getfqdn()``
and gloo binds what the hostname resolves to. Where that is a loopback address (``127.0.1.1`` in Debian's and Ubuntu's
/etc/hosts, ``127.0.0.1`` in many containers) every other node connects to itself and waits out its timeout; where it
is another network's, the rendezvous store goes unhosted when its endpoint is named by address (torch compares the
endpoint with the hostname's addresses only). The route to the endpoint names the one address every node must be
able to reach anyway."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from decent_train.training.live import address_towards

SIOCGIFADDR = 0x8915
GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"  # the interface gloo binds; set by the user, it is theirs


@dataclass(frozen=True)
class NodeAddress:
    """This node as the others reach it: ``address`` (torch's ``local_addr``: where the workers' store is advertised
    when this node's agent is rank 0), ``interface`` (gloo's ``GLOO_SOCKET_IFNAME``), and ``hosts_store``: True
    when this node must host the rendezvous store that torch's own test would not see as its (None: torch decides)."""

    address: str | None = None
    interface: str | None = None
    hosts_store: bool | None = None


def this_node(host: str, port: int) -> NodeAddress:
    """This node's :class:`NodeAddress` in a job whose rendezvous is at ``host:port``. All None for a loopback
    endpoint (agents on one host: the hostname's loopback answer is right there) or a route that cannot be told."""
    try:
        endpoint = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        address = address_towards(endpoint, port)
        if ipaddress.ip_address(endpoint).is_loopback or ipaddress.ip_address(address).is_loopback:
            return NodeAddress()
        hosts = address == endpoint and _port_free(endpoint, port)  # the endpoint is one of this node's addresses
        return NodeAddress(address, interface_named(address), True if hosts else None)
    except (OSError, IndexError, UnicodeError):
        return NodeAddress()


def interface_towards(host: str, port: str) -> str | None:
    """The network interface this host reaches ``host`` on (gloo binds there: ``GLOO_SOCKET_IFNAME``), or None for
    a loopback address or when it cannot be told."""
    try:
        address = address_towards(host, int(port))
        return None if address.startswith("127.") else interface_named(address)
    except OSError:
        return None


def interface_named(address: str) -> str | None:
    """The name of the interface that has the IPv4 ``address``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # asks for each interface's address
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
                if socket.inet_ntoa(packed[20:24]) == address:
                    return name
    return None


def _port_free(address: str, port: int) -> bool:
    """Whether nothing on this host listens on ``address:port`` yet. Taken, another agent here hosts the store, and
    torch's client finds it there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: a TIME_WAIT is no owner
        try:
            probe.bind((address, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
    return True
