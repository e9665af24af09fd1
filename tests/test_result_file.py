"""``result.json`` completed by several nodes' launchers at once (every node outside SLURM) is never read
half-written: each launcher renames a file of its own over it.

Caused, not mocked: 3 processes complete the same result 150 times each while reading it back, as the launchers of
three nodes sharing a run directory do. Oracle: every read parses as JSON with rank 0's entries intact. The plain
rewrite the launcher did before (``write_text`` in place) fails this (4 of 7 three-node torchrun runs did).
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from decent_train.launcher.job import complete_result

ROUNDS = 150
RANK0 = {"eval/accuracy": 0.97, "steps": 1200, "padding": "x" * 200_000}  # a write long enough to be seen mid-way


def _complete_many(path: str, node: int, errors: "multiprocessing.Queue[str]") -> None:
    for i in range(ROUNDS):
        try:
            result = complete_result(Path(path), wall=float(node * 1000 + i), changes=[{"node": node}])
            assert result["steps"] == RANK0["steps"] and result["padding"] == RANK0["padding"]
        except Exception as error:  # noqa: BLE001 -- any failure to read is the finding
            errors.put(f"node {node}, round {i}: {type(error).__name__}: {error}"[:200])
            return


def test_nodes_completing_the_result_at_once_never_read_it_half_written(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(RANK0, indent=2) + "\n")
    ctx = multiprocessing.get_context("fork")
    errors: multiprocessing.Queue[str] = ctx.Queue()
    nodes = [ctx.Process(target=_complete_many, args=(str(path), n, errors)) for n in range(3)]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join(120)
    assert all(node.exitcode == 0 for node in nodes)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found, found
    final = json.loads(path.read_text())
    assert final["membership_changes"][0]["node"] in range(3) and final["wall_time_s"] >= 0
    assert not list(tmp_path.glob("*.partial"))
