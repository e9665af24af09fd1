"""Time lost per node failure: live membership (``fault_tolerance=live``: a coordinator outside the nodes, an agent per
node) against torchrun's checkpoint-restart (``fault_tolerance=none``), on 3 nodes x 2 workers made of network
namespaces (tests/netns.py: a switch, tbf rate, a delay: netem where the kernel has sch_netem, else the harness's
userspace delay line). Issue 39, acceptance 5.

    python scripts/bench_node_failure.py --repeats 2 --steps 300 --at 175 --out bench/node_failure.json
    python scripts/bench_node_failure.py --from bench/node_failure.json   # the table again, from the runs

Four variants, each a real job on fresh namespaces, alternated in rounds (each round starts one variant later) so
that the machine's noise hits all alike:

- ``restart-base``: uninterrupted, ``fault_tolerance=none``, torchrun on each node with a c10d rendezvous at node 0
  (``launch.nnodes=2:3 launch.max_restarts=1``);
- ``restart``: as restart-base, one node SIGKILLed once metrics.jsonl reaches ``--at``: the survivors' workers fail,
  their agents meet again without it and restart from the newest checkpoint. A fixed ``launch.nnodes=3`` cannot go
  on: its rendezvous waits for a third node until its join timeout (600 s), so the restart path that survives a lost
  node is torchrun's elastic range, here 2:3, with the rendezvous timings ``--rdzv-keep-alive-s`` (a node silent for
  3 of them has left) and ``--rdzv-last-call-s`` (the wait for more nodes once 2 are in);
- ``live-base``: uninterrupted, ``fault_tolerance=live fault_tolerance.detect_s=--detect-s``, the coordinator in the
  root namespace, one agent per node (its baseline is restart-base: the live path's own overhead);
- ``live-kill``: as live-base, one node SIGKILLed at ``--at``: its 2 members leave in one change and the 4 others go
  on.

The node killed never holds rank 0 (whose records measure the stall) nor, under torchrun, the rendezvous (node 0):
losing those is another failure (acceptance 2), which the restart path does not survive at all. Killing a node:
SIGKILL to every process in its namespace and to its agent's process group at once, as a power loss would.

Each node has a hostname of its own (a UTS namespace, and /etc/netns/NODE/hosts naming every node, as a cluster's DNS
would): torchrun tells the workers their rank 0's address by hostname, which a shared hostname would resolve to the
host, unreachable from the nodes.

Per run, as scripts/bench_fault_tolerance.py measures it (its ``measure``): the seconds from the launch to rank 0's
result.json (``to_result_s``), eval/accuracy, the step the node was killed at, the steps trained twice, the live
runs' membership changes, and the stall from the timestamps of rank 0's records (beyond the run's median seconds per
step: across the restart, or around the membership change). Time lost: a variant's to_result_s minus its baseline's
in the same round, median and range over the rounds. On an oversubscribed machine 4 workers step faster than 6, so a
run that loses a node can finish before its baseline (a negative time lost); the stall is the loss itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/netns.py, the harness
# scripts/bench_fault_tolerance.py, beside this script: how a run's files are measured, shared
from bench_fault_tolerance import COMMAND, _s, alternated_rounds, rank0_records, spread, stalls, steps_logged  # noqa: E402
from bench_fault_tolerance import measure as measure_files  # noqa: E402

from tests.netns import LEFTOVER, PREFIX, Network, Node, netem_available, nodes, nodes_available  # noqa: E402

NODES, PER_NODE = 3, 2
# name: (path, whether a node is killed, the baseline it is compared with)
VARIANTS: dict[str, tuple[str, bool, str | None]] = {
    "restart-base": ("restart", False, None),
    "restart": ("restart", True, "restart-base"),
    "live-base": ("live", False, "restart-base"),
    "live-kill": ("live", True, "live-base"),
}


def job(steps: int, checkpoint_every: int) -> list[str]:
    """The overrides every run shares: the default job, shortened, one thread per worker (6 workers share the cores)."""
    return [f"steps={steps}", f"checkpoint.every={checkpoint_every}", "logger.progress_bar=false",
            "logger.wandb.mode=disabled", f"launch.nproc_per_node={PER_NODE}", "launch.threads_per_worker=1"]


def free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def hostnames(network: Network) -> Any:
    """Every node's hosts file (``ip netns exec`` mounts /etc/netns/NODE/hosts over /etc/hosts) naming every node by
    its namespace's name, the hostname ``on_node`` gives it; removed on the way out."""
    hosts = "127.0.0.1 localhost\n" + "".join(f"{node.address} {node.namespace}\n" for node in network.nodes)
    for folder in Path("/etc/netns").glob(f"{PREFIX}*"):  # a run killed outright left them: its pid is gone
        if (made_by := LEFTOVER.match(folder.name)) and not Path(f"/proc/{made_by[1]}").exists():
            shutil.rmtree(folder, ignore_errors=True)
    try:
        for node in network.nodes:
            folder = Path("/etc/netns") / node.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts)
        yield
    finally:
        for node in network.nodes:
            shutil.rmtree(Path("/etc/netns") / node.namespace, ignore_errors=True)


def on_node(node: Node, argv: list[str], console: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """``argv`` on ``node`` under the node's own hostname; its console into ``console``. No *_SOCKET_IFNAME: a real
    node's processes find their interface themselves (the hostname resolves to the node's address)."""
    env = {key: value for key, value in os.environ.items() if "SOCKET_IFNAME" not in key}
    command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', node.namespace, *argv]
    with console.open("w") as out:
        return node.popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)


def kill_node(node: Node) -> None:
    """SIGKILL every process in the node's namespace, then its process groups: the node is lost."""
    listed = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True).stdout.split()
    for pid in listed:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    node.kill()


def members_of(agent_dir: Path) -> list[int]:
    """The live members an agent started (its launcher.log names them)."""
    log = agent_dir / "launcher.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if "workers (members" in line:
            return [int(m) for m in line.split("(members ")[1].split(")")[0].split(", ")]
    return []


def holds_rank_0(node: Node) -> bool | None:
    """Whether a torchrun worker with RANK=0 runs in the node's namespace (None: its workers are not up yet)."""
    listed = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True).stdout.split()
    workers = 0
    for pid in listed:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"decent_train.worker" in cmdline:
            workers += 1
            if b"RANK=0" in environ:
                return True
    return False if workers else None


def victim(path: str, network: Network, root: Path) -> int | None:
    """The node to kill: not node 0 (torchrun's rendezvous), not the one holding rank 0; None while unknown."""
    for k in range(1, NODES):
        if path == "live":
            members = members_of(root / f"agent{k}")
            if members and 0 not in members:
                return k
        elif holds_rank_0(network.nodes[k]) is False:
            return k
    return None


def run_one(name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One job of ``name`` under ``root`` on fresh namespaces; the node, if any, killed once records reach ``--at``."""
    path, kill, _ = VARIANTS[name]
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run_dir = root / "run"
    shared = [*job(args.steps, args.checkpoint_every), f"hydra.run.dir={run_dir}"]
    run: dict[str, Any] = {"variant": name, "run_dir": str(run_dir), "load_before": os.getloadavg()[0]}
    with nodes(NODES, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as network, hostnames(network):
        if path == "live":
            endpoint = f"{network.root_address}:{free_port(network.root_address)}"
            common = [str(COMMAND), "fault_tolerance=live", f"launch.rdzv_endpoint={endpoint}", "launch.rdzv_id=bench"]
            command = [*common, "fault_tolerance.role=coordinator", f"launch.nnodes={NODES}",
                       f"fault_tolerance.detect_s={args.detect_s:g}", *shared]
            consoles = [root / "coordinator.txt", *(root / f"agent{k}.txt" for k in range(NODES))]
        else:
            endpoint = f"{network.nodes[0].namespace}:29500"
            command = [str(COMMAND), f"launch.nnodes=2:{NODES}", "launch.max_restarts=1",
                       f"launch.rdzv_endpoint={endpoint}", "launch.rdzv_id=bench",
                       f"launch.rdzv_keep_alive_s={args.rdzv_keep_alive_s}",
                       f"launch.rdzv_last_call_s={args.rdzv_last_call_s}", *shared]
            consoles = [root / f"node{k}.txt" for k in range(NODES)]
        run |= {"command": command, "output": str(consoles[0])}
        start, started_at, result = time.monotonic(), time.time(), run_dir / "result.json"
        procs: list[subprocess.Popen[bytes]] = []
        try:
            if path == "live":
                with consoles[0].open("w") as out:
                    procs.append(subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
                for k, node in enumerate(network.nodes):
                    procs.append(on_node(node, [*common, "fault_tolerance.role=agent",
                                                f"hydra.run.dir={root / f'agent{k}'}"], consoles[k + 1], root))
            else:
                procs = [on_node(node, command, consoles[k], root) for k, node in enumerate(network.nodes)]
            killed: int | None = None
            waited = procs[:1] if path == "live" else list(procs)  # the coordinator, or every node's launcher
            while any(p.poll() is None for p in waited) and time.monotonic() - start < args.timeout:
                if "to_result_s" not in run and result.exists():  # rank 0's; a launcher rewrites it at the end
                    run["to_result_s"] = result.stat().st_mtime - started_at
                if kill and killed is None and (steps := steps_logged(run_dir)) and steps[-1] >= args.at:
                    killed = victim(path, network, root)
                    if killed is not None:
                        kill_node(network.nodes[killed])
                        if path == "restart":
                            waited.remove(procs[killed])
                        run |= {"signal": "SIGKILL (node)", "signal_at_step": steps[-1], "killed_node": killed,
                                "signal_at_s": time.monotonic() - start}
                time.sleep(0.05)
            if network.delay_lines:  # the CPU the userspace delay cost over the run (all links together)
                run["delay_line_cpu_s"] = network.delay_line_cpu_s()
            if any(p.poll() is None for p in waited):
                run["failed"] = f"stopped after {args.timeout:g} s"
            elif kill and killed is None:
                run["failed"] = f"no node was killed: the records never reached step {args.at}"
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    run |= {"process_wall_s": time.monotonic() - start,
            "exit": next((p.returncode for p in waited if p.returncode), 0)}
    if run["exit"] != 0:
        bad = next(p for p in waited if p.returncode)
        console = consoles[procs.index(bad)]
        lines = [line for line in console.read_text(errors="replace").splitlines() if line.strip()]
        run["launcher_failed"] = f"{console.name}: {lines[-1] if lines else f'exit {bad.returncode}'}"
    try:
        return measure(run)
    except Exception as error:  # noqa: BLE001  (files this script did not expect: the other runs still go on)
        return run | {"failed": f"not measured: {error!r}"}


def measure(run: dict[str, Any]) -> dict[str, Any]:
    """What the run's files say (scripts/bench_fault_tolerance.py's ``measure``), and a restart's stall where no
    record repeats (the node killed just after a checkpoint, the restart resuming at the step of the last record):
    the excess of the record intervals around the step it resumed from."""
    run = measure_files(run)
    if "failed" not in run and not run["stall_s"] and run["resumed_from_step"]:
        run["stall_s"] = stalls(rank0_records(Path(run["run_dir"])), [run["resumed_from_step"]])
    return run


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per variant: medians and ranges over its rounds; time lost: paired by round against its baseline."""
    ok = {(r["variant"], r["round"]): r for r in runs if "failed" not in r}
    summary = {}
    for name in names:
        path, kill, base = VARIANTS[name]
        mine = [r for r in runs if r["variant"] == name and "failed" not in r]
        pairs = [(r, ok[(base, r["round"])]) for r in mine if (base, r["round"]) in ok]
        changes = [c for r in mine for c in r["membership_changes"] or []]
        summary[name] = {
            "path": path, "node_killed": kill, "baseline": base, "runs": len(mine),
            "failed": [r["failed"] for r in runs if r["variant"] == name and "failed" in r],
            "launcher_failed": [r["launcher_failed"] for r in mine if "launcher_failed" in r],
            "to_result_s": spread([r["to_result_s"] for r in mine]),
            "lost_s": spread([r["to_result_s"] - b["to_result_s"] for r, b in pairs]),
            "stall_s": spread([x for r in mine for x in r["stall_s"]]),
            "accuracy": spread([r["accuracy"] for r in mine]),
            "signal_at_step": sorted(r["signal_at_step"] for r in mine if "signal_at_step" in r),
            "steps_increase": all(r["steps_increase"] for r in mine),
            "steps_repeated": sorted(r["steps_repeated"] for r in mine),
            "resumed_from_step": sorted(r["resumed_from_step"] for r in mine if r["resumed_from_step"]),
            "members_after": sorted({c["members"] for c in changes if c["lost"] and "members" in c}),
            "recovery_s": spread([c["recovery_s"] for c in changes if "recovery_s" in c and c["lost"]]),
            "delay_line_cpu_pct": spread([100 * r["delay_line_cpu_s"] / r["process_wall_s"] for r in mine
                                          if "delay_line_cpu_s" in r]),
        }
    return summary


def table(summary: dict[str, Any]) -> str:
    """Medians (min to max) over the rounds."""
    lines = ["| variant | to result.json s | lost s (vs baseline) | stall s | eval/accuracy | node killed at step | "
             "steps repeated (resumed from) | live: members after, recovery s | runs |", "|" + "---|" * 9]
    for name, r in summary.items():
        lost = f"{_s(r['lost_s'], '{:+.1f}')} (vs {r['baseline']})" if r["baseline"] else "-"
        killed = ", ".join(map(str, r["signal_at_step"])) if r["node_killed"] else "-"
        repeated = ", ".join(map(str, r["steps_repeated"])) + ("" if r["steps_increase"] else " (records repeat)")
        if r["resumed_from_step"]:
            repeated += f" ({', '.join(map(str, r['resumed_from_step']))})"
        live = (f"{', '.join(map(str, r['members_after']))}; {_s(r['recovery_s'], '{:.2f}')}"
                if r["members_after"] else "-")
        runs = f"{r['runs']} measured"
        if r["launcher_failed"]:  # rank 0 wrote result.json, then a node's launcher exited non-zero
            runs += f" ({len(r['launcher_failed'])} with a launcher failing after: {r['launcher_failed'][0][:70]})"
        if r["failed"]:
            runs += f"; {len(r['failed'])} failed: {r['failed'][0][:70]}"
        lines.append(f"| {name} | {_s(r['to_result_s'])} | {lost} | {_s(r['stall_s'], '{:.2f}')} | "
                     f"{_s(r['accuracy'], '{:.4f}')} | {killed} | {repeated} | {live} | {runs} |")
    return "\n".join(lines)


def delay_line_cost(summary: dict[str, Any]) -> str:
    """The userspace delay line's CPU per variant, as % of one core over the run's wall time; "" without it."""
    costs = [f"{name} {_s(r['delay_line_cpu_pct'], '{:.1f}')}" for name, r in summary.items()
             if r.get("delay_line_cpu_pct")]
    return f"delay lines' CPU, % of one core over the run (all 4 links): {'; '.join(costs)}" if costs else ""


def describe(run: dict[str, Any]) -> str:
    if "failed" in run:
        return f"FAILED: {run['failed']}"
    killed = f", node {run['killed_node']} killed at step {run['signal_at_step']}" if "killed_node" in run else ""
    stall = f", stall {', '.join(f'{x:.2f}' for x in run['stall_s'])} s" if run["stall_s"] else ""
    launcher = f"; {run['launcher_failed']}" if "launcher_failed" in run else ""
    return f"result.json after {run['to_result_s']:.1f} s, eval/accuracy {run['accuracy']:.4f}{killed}{stall}{launcher}"


def latency(delay_ms: float) -> str | None:
    """None where the network can be made with ``delay_ms``; else the one line saying why not."""
    if (why := nodes_available()) is not None:
        return f"bench_node_failure.py: cannot make the nodes here: {why}"
    if delay_ms > 0 and (why := nodes_available(delay=True)) is not None:
        return f"bench_node_failure.py: --delay-ms {delay_ms:g} cannot be made here ({why}); valid here: --delay-ms 0"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="rounds; each runs every variant once")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=300, help="the job's steps")
    p.add_argument("--at", type=int, default=175, help="the node is killed once metrics.jsonl reaches this step")
    p.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint.every (where a restart resumes)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of every packet between the nodes and "
                   "to the coordinator (a round trip takes twice it): tc's netem where the kernel has sch_netem, else "
                   "tests/netns.py's userspace delay line")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="tbf rate of each node's link, both ways")
    p.add_argument("--detect-s", type=float, default=2.0, help="the live runs' fault_tolerance.detect_s")
    p.add_argument("--rdzv-keep-alive-s", type=int, default=1, help="the restart runs' launch.rdzv_keep_alive_s")
    p.add_argument("--rdzv-last-call-s", type=int, default=3, help="the restart runs' launch.rdzv_last_call_s")
    p.add_argument("--timeout", type=float, default=420, help="seconds a run may take before it is stopped")
    p.add_argument("--out", type=Path, default=Path("bench/node_failure.json"),
                   help="the JSON results; the runs go into the folder of the same name without .json")
    p.add_argument("--from", dest="from_json", type=Path, default=None,
                   help="no runs: measure the runs of an earlier --out again from their folders, print the table and "
                   "rewrite that JSON")
    args = p.parse_args()
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        runs = [measure(run) | {"round": run["round"]} for run in saved["runs"]]
        saved["summary"] = summarize(runs, list(saved["summary"]))
        print(table(saved["summary"]))
        print(delay_line_cost(saved["summary"]))
        args.from_json.write_text(json.dumps(saved | {"runs": runs}, indent=2) + "\n")
        return
    names = [n for n in args.variants.split(",") if n]
    if unknown := [n for n in names if n not in VARIANTS]:
        sys.exit(f"bench_node_failure.py: no variant {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    if not 0 < args.at < args.steps:
        sys.exit(f"bench_node_failure.py: --at {args.at} must lie within the run: 0 < --at < --steps ({args.steps})")
    if args.delay_ms < 0 or args.rate_mbit <= 0:
        sys.exit(f"bench_node_failure.py: --delay-ms {args.delay_ms:g} must be >= 0 and --rate-mbit "
                 f"{args.rate_mbit:g} > 0")
    if (refused := latency(args.delay_ms)) is not None:
        sys.exit(refused)
    netem = netem_available()
    delay_by = None if args.delay_ms == 0 else "netem" if netem is None else "userspace"
    if delay_by == "userspace":
        print(f"delay {args.delay_ms:g} ms one way by the userspace delay line (tests/netns.py): this kernel has no "
              f"netem (tc: {netem.rsplit(': ', 1)[-1].rstrip('.')})", flush=True)
    elif delay_by is None:
        print("no latency between the nodes: --delay-ms 0", flush=True)
    runs_dir = args.out.with_suffix("").resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs, uptime = alternated_rounds(names, args.repeats,
                                     lambda name, k: run_one(name, runs_dir / f"{name}-r{k}", args), describe)
    summary = summarize(runs, names)
    print(table(summary))
    print(delay_line_cost(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: getattr(args, key) for key in ("steps", "at", "checkpoint_every", "delay_ms", "rate_mbit",
                                                    "detect_s", "rdzv_keep_alive_s", "rdzv_last_call_s")}
    args.out.write_text(json.dumps({
        "argv": sys.argv, "nodes": NODES, "workers_per_node": PER_NODE, **settings,
        "delay_by": delay_by, "netem": "available" if netem is None else f"missing: {netem}",
        "uptime": uptime, "cpus": os.cpu_count(), "kernel": os.uname().release, "summary": summary, "runs": runs,
    }, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
