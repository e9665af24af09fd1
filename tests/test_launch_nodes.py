"""Several nodes launched by hand (``launch.nnodes=2`` and a rendezvous endpoint, torchrun's agents), each in a
network namespace of its own (tests/netns.py), with no GLOO_SOCKET_IFNAME: as on hosts whose name resolves to a
loopback address (this machine's, Debian's 127.0.1.1, many containers), which no other node can reach. The launcher
takes each node's address and gloo's interface from its route to the endpoint (launcher/network.py), and the node
that owns the endpoint's address hosts the rendezvous store."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
from pathlib import Path

import pytest
from loguru import logger

from decent_train.launcher.launch import _AfterTheWorkers
from decent_train.launcher.network import NodeAddress, this_node

from .jobs import COMMAND, free_port
from .netns import INTERFACE, nodes, nodes_available

REASON = nodes_available()
needs_nodes = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@needs_nodes
def test_a_node_finds_its_address_towards_the_endpoint_and_whether_it_hosts_the_store() -> None:
    with nodes(2) as network:
        first, second = network.nodes
        port = free_port()
        assert first.call(lambda: this_node(first.address, port)) == NodeAddress(first.address, INTERFACE, True)
        assert second.call(lambda: this_node(first.address, port)) == NodeAddress(second.address, INTERFACE, None)

        def with_port_taken() -> NodeAddress:  # another agent on this node hosts the store already: torch's client
            with socket.create_server((first.address, port)):
                return this_node(first.address, port)

        assert first.call(with_port_taken) == NodeAddress(first.address, INTERFACE, None)
        assert first.call(lambda: this_node("localhost", port)) == NodeAddress()  # agents on one host: torch's way


@pytest.mark.slow
@needs_nodes
def test_two_nodes_whose_hostname_is_loopback_train_together(tmp_path: Path) -> None:
    """Before launcher/network.py: no agent hosted the store (torch matches the endpoint against the hostname's
    addresses), and both nodes gave up after launch.rdzv_store_timeout_s. Each node's output must be free of torch's
    exit-barrier race too (launch.py: _AfterTheWorkers)."""
    run_dir, port = tmp_path / "run", free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    with nodes(2) as network:
        first, second = network.nodes
        args = [str(COMMAND), "model=mlp", "steps=20", "eval_every=0", "logger=jsonl", "logger.progress_bar=false",
                "launch.nproc_per_node=1", "launch.nnodes=2", f"launch.rdzv_endpoint={first.address}:{port}",
                "launch.rdzv_id=two-nodes", "launch.rdzv_store_timeout_s=30", f"hydra.run.dir={run_dir}"]
        outputs = [tmp_path / f"node{i}.out" for i in range(2)]
        launches = [node.popen(args, env=env, cwd=tmp_path, stdout=out.open("w"), stderr=subprocess.STDOUT)
                    for node, out in zip((first, second), outputs)]
        for launch in launches:
            try:
                launch.wait(timeout=150)
            except subprocess.TimeoutExpired:
                pass
        first.kill()
        second.kill()
    for launch, out in zip(launches, outputs):
        text = out.read_text()
        assert launch.returncode == 0, f"exit {launch.returncode}:\n{text}"
        assert "Traceback" not in text and "exit barrier" not in text, text
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["world_size"], result["steps"]) == (2, 20)
    # each node's launcher logs to a file of its own, named after its host (both hosts are this one here)
    assert not (run_dir / "launcher.log").exists()
    assert " workers on cpu" in (run_dir / f"launcher-{socket.gethostname()}.log").read_text()


def test_torchs_exit_barrier_race_goes_to_the_launcher_log_not_the_terminal() -> None:
    """The race (launch.py: _AfterTheWorkers) showed in 1 of 8 two-node runs above: logged here through torch's own
    loggers, as its agent logs it. What passes a logger's filters reaches its handlers (the terminal's, where torch
    or the user set one): a handler of the test's own sees any other record of theirs, not these two."""
    _AfterTheWorkers.install()
    seen: list[str] = []
    sink = logger.add(lambda message: seen.append(str(message)), level="DEBUG")
    passed: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: passed.append(record.getMessage())  # type: ignore[method-assign]
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    rendezvous = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    for torch_logger in (agent, rendezvous):
        torch_logger.addHandler(handler)
    try:
        try:
            raise ConnectionError("Failed to recv, got 0 bytes")
        except ConnectionError:
            agent.exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.01)
        rendezvous.warning("The node 'n_1_0' has failed to shutdown the rendezvous 'r' due to an error of type %s.",
                           "X")
        agent.warning("Another warning of the agent")
    finally:
        logger.remove(sink)
        for torch_logger in (agent, rendezvous):
            torch_logger.removeHandler(handler)
    assert passed == ["Another warning of the agent"], passed
    assert sum("after the workers" in line for line in seen) == 2, seen
