"""A node that cannot join its job's rendezvous ends in one line naming ``launch.rdzv_endpoint``, within
``launch.rdzv_store_timeout_s``: the fault is caused, a listener at the endpoint that is not a rendezvous store (a
wrong port), not mocked."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decent_train.config import LaunchConfig
from decent_train.launcher.launch import check_rendezvous_endpoint, torchrun_command

from .jobs import decent_train, start, worker_pids

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)


@pytest.fixture
def foreign_service() -> Iterator[int]:
    """A port on this host where something else answers (an HTTP server's refusal), as a mistyped port would find."""
    server = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()

    def answer() -> None:
        server.settimeout(0.2)
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stopping.set()
    thread.join()
    server.close()


@pytest.mark.slow
def test_a_foreign_service_at_the_endpoint_fails_in_one_line_within_the_store_timeout(
        tmp_path: Path, foreign_service: int) -> None:
    endpoint = f"127.0.0.1:{foreign_service}"  # loopback: this node would host the store, but the port is taken
    start = time.monotonic()
    proc = decent_train("launch.nnodes=2", f"launch.rdzv_endpoint={endpoint}", "launch.rdzv_id=t",
                        "launch.rdzv_store_timeout_s=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not [line for line in proc.stderr.splitlines() if "frame #" in line or line.startswith(("[W", "[E"))], (
        proc.stderr)  # torch's C++ retries, each with its stack, before the line
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"decent-train: error: launch.rdzv_endpoint={endpoint}: no rendezvous store answered"), last
    assert "launch.rdzv_store_timeout_s=2 s" in last, last
    assert elapsed < 45, f"{elapsed:.0f} s: the store timeout (2 s) did not bound the wait"
    assert not (tmp_path / "run" / "logs").exists()  # no worker started


@pytest.mark.parametrize("endpoint, expected", [
    ("node1:0", "a port in 1..65535"),
    ("node1:http", "a port in 1..65535"),
    ("no-such-host.invalid:29500", "cannot resolve the host 'no-such-host.invalid'"),
])
def test_bad_endpoints_are_refused_in_one_line(endpoint: str, expected: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_rendezvous_endpoint(LaunchConfig(rdzv_endpoint=endpoint))
    message = str(refused.value)
    assert message.startswith(f"launch.rdzv_endpoint={endpoint}") and expected in message and "\n" not in message


@pytest.mark.parametrize("endpoint", ["", "localhost:29500", "127.0.0.1", "[::1]:29500"])
def test_endpoints_this_node_resolves_pass(endpoint: str) -> None:
    check_rendezvous_endpoint(LaunchConfig(rdzv_endpoint=endpoint))


def test_torchrun_command_carries_the_store_timeout(tmp_path: Path) -> None:
    """A cluster script's torchrun waits as long as the launcher would (torch reads ``read_timeout``)."""
    cfg = LaunchConfig(nnodes=2, rdzv_endpoint="node1:29400", rdzv_id="j", rdzv_store_timeout_s=7)
    conf = next(a for a in torchrun_command(cfg, tmp_path / "c.yaml") if a.startswith("--rdzv-conf="))
    assert "read_timeout=7" in conf.split("=", 1)[1].split(","), conf
    default = LaunchConfig(nnodes=2, rdzv_endpoint="node1:29400", rdzv_id="j")
    assert not any(a.startswith("--rdzv-conf=") for a in torchrun_command(default, tmp_path / "c.yaml"))


@pytest.mark.slow
def test_the_workers_keep_torchs_cpp_messages(tmp_path: Path) -> None:
    """The launcher silences torch's C++ log for itself only: the environment torch is imported in for the workers
    (the forkserver they are forked from) holds no ``TORCH_CPP_LOG_LEVEL`` unless the user's did (their NCCL and gloo
    warnings are theirs to see)."""
    for users in (None, "INFO"):
        run_dir = tmp_path / f"run-{users}"
        proc = start("launch.nproc_per_node=1", "steps=100000", "logger=jsonl", f"hydra.run.dir={run_dir}",
                     cwd=tmp_path, env={"TORCH_CPP_LOG_LEVEL": users} if users else None)
        try:
            deadline = time.monotonic() + 120
            while not (pids := worker_pids(run_dir)) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert pids, proc.communicate()[1] if proc.poll() is not None else "no worker within 120 s"
            forkserver = (Path("/proc") / str(pids[0]) / "stat").read_text().rsplit(")", 1)[1].split()[1]
            assert b"multiprocessing.forkserver" in (Path("/proc") / forkserver / "cmdline").read_bytes()
            environ = (Path("/proc") / forkserver / "environ").read_bytes().split(b"\0")
            levels = [item for item in environ if item.startswith(b"TORCH_CPP_LOG_LEVEL=")]
            assert levels == ([f"TORCH_CPP_LOG_LEVEL={users}".encode()] if users else []), levels
        finally:
            proc.kill()
            proc.communicate()
