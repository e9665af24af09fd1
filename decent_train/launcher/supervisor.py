"""``fault_tolerance=live`` as one command: the coordinator (``coordinator.py``: the store and the plans) and, unless
this launch is the coordinator alone (``fault_tolerance.role=coordinator``), this node's agent (``node_agent.py``: it
starts and watches the workers) in a thread of the same process. On one node that is the whole run; on several,
every other node runs ``fault_tolerance.role=agent`` (``docs/fault-tolerance.md``, "Several nodes").

SIGINT, SIGTERM or SIGUSR1 to the launcher goes on to every worker as torchrun's path does (training/stop.py): they
stop at a step they agree on, with a checkpoint, and no replacement is started; a second Ctrl-C kills them.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from loguru import logger
from torch.distributed.elastic.multiprocessing.api import SignalException

from decent_train.config import TrainConfig
from decent_train.launcher.coordinator import WORKERS_FILE, Coordinator
from decent_train.launcher.launch import Interrupted, StopForwarding, format_command
from decent_train.launcher.node_agent import NodeAgent
from decent_train.training.stop import REQUEST_FILE

__all__ = ["WORKERS_FILE", "run_supervised"]


def run_supervised(cfg: TrainConfig, config_path: Path, run_dir: Path
                   ) -> tuple[list[dict[str, Any]], signal.Signals | None]:
    """Run the job under live membership until its workers finish or stop; the membership changes, and the stop
    signal the launcher received (None: none). Raises :class:`Interrupted` on a second Ctrl-C."""
    endpoint = cfg.launch.rdzv_endpoint
    port = int(endpoint.rsplit(":", 1)[1]) if endpoint else 0
    with StopForwarding(config_path.parent / REQUEST_FILE) as stopping:
        coordinator = Coordinator(cfg, run_dir, config_path.read_text(), port, stopping)
        address = endpoint or f"127.0.0.1:{coordinator.port}"
        agent, thread, failures = None, None, []
        if cfg.fault_tolerance.role == "both":
            agent = NodeAgent(cfg, config_path, address, stopping)
            agent.register()  # before the coordinator waits for it: its workers build while it registers

            def watch() -> None:
                try:
                    agent.run()
                except Exception as error:  # noqa: BLE001 - the coordinator sees the node fall silent; say why
                    failures.append(error)
                    logger.opt(exception=error).error(f"this node's agent failed: {error}")

            thread = threading.Thread(target=watch, name="decent_train-node-agent", daemon=True)
            thread.start()
        if cfg.launch.max_nodes > 1 or agent is None:
            logger.info(f"live coordinator at {endpoint or coordinator.address()}: start one agent on every other "
                        f"node with: {agent_command(cfg, endpoint or coordinator.address())}")
        try:
            changes = coordinator.run()
        except SignalException:  # a second Ctrl-C: the workers were killed
            raise Interrupted(signal.SIGINT) from None
        finally:
            if agent is not None and thread is not None:
                thread.join(timeout=5.0)
                agent.ended.set()
                agent.kill_all()
    return changes, stopping.received


def agent_command(cfg: TrainConfig, endpoint: str) -> str:
    """What each node runs to join this coordinator (the job itself comes from the coordinator)."""
    return format_command(["decent-train", "fault_tolerance=live", "fault_tolerance.role=agent",
                           f"launch.rdzv_endpoint={endpoint}", f"launch.rdzv_id={cfg.launch.rdzv_id}"])
