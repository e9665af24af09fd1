"""Which of this node's workers ended first, watched as they end (pidfds; Linux 5.3 or later).

torch's agent reports one failure per node: the first failed worker it finds at its next look (every
``launch.monitor_interval``). A worker killed outright (SIGKILL, the kernel's out-of-memory killer) leaves no error,
and its peers fail on it within milliseconds ("Connection reset by peer"), usually before that look: the report then
names a peer, and the worker that was killed is never mentioned. The launcher says which ended first.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import threading

from decent_train.launcher.forking import children_running, processes

TITLE = re.compile(rb"^decent_train\.worker .* \(rank (\d+) of \d+\)")  # worker.take_the_launch's process title
LOOK_S = 0.1  # while not every worker is watched yet (starting, restarting): how often /proc is read


class ExitOrder(threading.Thread):
    """Watch this process's workers (forked from its forkserver, a child of it) and record the ranks in the order
    they end, per start of the workers. A context: started on entry, stopped on exit."""

    def __init__(self, workers: int) -> None:
        super().__init__(name="decent_train.exit_order", daemon=True)
        self.workers = workers  # per start of the workers: once that many are watched, /proc is not read again
        self.ended: list[int] = []  # ranks, in the order they ended, since the last start
        self._done = threading.Event()

    def __enter__(self) -> ExitOrder:
        if hasattr(os, "pidfd_open"):
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self.is_alive():
            self.join()

    def run(self) -> None:
        poller, watched, seen = select.epoll(), {}, set()
        try:
            while not self._done.is_set():
                if len(watched) < self.workers:
                    for pid, rank in _workers().items():
                        if pid in seen:
                            continue
                        seen.add(pid)
                        if not watched and len(seen) > self.workers:
                            self.ended = []  # a new start of the workers (a restart): its own order
                        with contextlib.suppress(OSError):  # (it ended already)
                            fd = os.pidfd_open(pid)
                            poller.register(fd, select.EPOLLIN)
                            watched[fd] = rank
                for fd, _ in poller.poll(LOOK_S):
                    self.ended.append(watched.pop(fd))
                    poller.unregister(fd)
                    os.close(fd)
        finally:
            for fd in watched:
                os.close(fd)
            poller.close()

    def first(self) -> int | None:
        """The rank of the worker that ended first in the last start, or None if none was seen ending."""
        return self.ended[0] if self.ended else None


def _workers() -> dict[int, int]:
    """pid -> rank of this process's workers: the children of its forkserver titled as a worker."""
    found = processes()
    servers = children_running(found, "multiprocessing.forkserver")
    return {int(pid): int(match[1]) for pid, (parent, title) in found.items()
            if parent in servers and (match := TITLE.match(title))}
