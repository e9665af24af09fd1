"""End this process's TCP connections to hosts declared lost, so that what waits on them fails now, not at a timeout.

Why: a peer process that dies closes its sockets (its kernel sends a reset), so a receive waiting on it fails at
once. A host cut off the network sends nothing: gloo waits for the message until its timeout (comm_timeout_s, minutes),
and it has no way to end a pending receive early (``ProcessGroup.abort()`` leaves the wait blocked, measured on torch
2.14). Once the coordinator has declared every member on that host lost, nothing more is wanted from it, so shutting
down the sockets whose peer is that host ends each wait with a closed connection, which the engine settles as a
missed message (``fault_tolerant=True``) like a dead peer's.

The live protocol (training/live.py) severs in two cases, both once the coordinator's plan has dropped members:
- a host all of whose members are lost (never this worker's own: members on this host die with a reset, and a hung
  one is killed by its node agent), whatever the worker is doing;
- every member's host, this worker's own included, when the worker is inside a record step's collectives of the
  epoch the plan ends: the members change at the next record step anyway, and a collective waiting on a member that
  already gave up on the step (its own collective with the lost one failed) would otherwise wait out its bound.
Only TCP connections are touched (AF_INET/AF_INET6 streams): a Unix socket (wandb's service) never is.
"""

from __future__ import annotations

import os
import socket

__all__ = ["sever_connections_to"]


def sever_connections_to(hosts: set[str], keep: frozenset[tuple[str, int]] = frozenset()) -> int:
    """Shut down every TCP connection of this process whose peer is one of ``hosts`` (IP addresses), except those
    to an (address, port) in ``keep`` (the store's); how many were shut down. Linux only (/proc); elsewhere 0."""
    if not hosts or not os.path.isdir("/proc/self/fd"):
        return 0
    severed = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            connection = socket.socket(fileno=os.dup(int(name)))  # a duplicate: closing it leaves the original
        except OSError:  # closed meanwhile, or not a socket Python can open
            continue
        try:
            if connection.type != socket.SOCK_STREAM or connection.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            host, port = connection.getpeername()[:2]
            host = host.removeprefix("::ffff:")  # an IPv4 peer of a dual-stack socket
            if host in hosts and (host, port) not in keep:
                connection.shutdown(socket.SHUT_RDWR)  # acts on the socket itself, which every duplicate shares
                severed += 1
        except OSError:  # not connected (a listener), or gone
            pass
        finally:
            connection.close()
    return severed
