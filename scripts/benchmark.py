"""Throughput of decent_train against no communication, decent-dp 0.2.3 and torch DDP, for several worker counts,
optionally on an emulated slow network; a table, a JSON file and a chart.

    python scripts/benchmark.py --workers 1,2,4,8 --out bench/local
    python scripts/benchmark.py --workers 2,4,8 --rate 4gbit --out bench/4gbit     # root: ip netns + tc

Each worker count is one torchrun launch of ``scripts/bench_engine.py``, which runs every implementation in that one
launch, interleaved, on the same model and batches (see its docstring). With ``--launches separate`` every
implementation runs in a launch of its own instead, as a user's job does, ``--rounds`` times with the implementations
taking turns; the table then holds the median over rounds:

    python scripts/benchmark.py --workers 2,4 --launches separate --rounds 3 --optim adamw --bucket-mb 4 \
        --topologies ring --phases 5 --out bench/adamw_4mb

``--optim``, ``--bucket-mb`` and ``--phases`` (a per-phase profile) go to bench_engine.py, as do its other options.
``--rate`` runs the launch inside a private
network namespace whose loopback, the only link the workers use, is limited by a token bucket (``tc qdisc ... tbf
rate R``), optionally with ``--delay`` added (netem): every byte between workers crosses it, so the workers share one
link. ``--links per-worker`` gives every worker a link of its own instead, as nodes of a cluster have: one namespace
per worker, joined to a bridge by a veth pair limited to R in each direction, and one torchrun agent per namespace
(c10d rendezvous at the first). Both need root and iproute2; without them the command says so and stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_engine  # noqa: E402  (its option parser, implementation names and phases)

# bench_engine.py's options as this command sets them by default; any of its options given here come after and win.
BENCH_DEFAULTS = ["--topologies=ring,complete,one-peer-exp,alternating-exp-ring", "--steps=30", "--warmup=5",
                  "--repeats=5", "--width=1280", "--depth=4", "--batch=64"]


def remove_namespace(name: str) -> None:
    """Kill what still runs inside (a stopped launch's workers), then delete the namespace."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def require_root_and_iproute2(option: str) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        sys.exit(f"benchmark.py: {option} needs root and iproute2 (ip, tc) for network namespaces; run without --rate")


def token_bucket(rate: str) -> list[str]:
    """The tc qdisc that limits a device to ``rate``."""
    return ["tbf", "rate", rate, "burst", "1mb", "latency", "100ms"]


@contextmanager
def namespaces(names: list[str], commands: list[list[str]]) -> Iterator[None]:
    """Run the commands that build the namespaces ``names``; remove them (and what runs inside) afterwards."""
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, text=True)
        yield
    except subprocess.CalledProcessError as error:
        sys.exit(f"benchmark.py: {' '.join(error.cmd)} failed: {error.stderr.strip()}")
    finally:
        for name in names:
            remove_namespace(name)


@contextmanager
def emulated_network(rate: str | None, delay: str | None) -> Iterator[list[str]]:
    """The command prefix that runs inside a namespace whose loopback is limited to ``rate`` (nothing if None)."""
    if rate is None:
        yield []
        return
    require_root_and_iproute2("--rate")
    name = f"decent-bench-{os.getpid()}"
    commands = [["ip", "netns", "add", name], ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]]
    shaping = token_bucket(rate)
    if delay:  # netem adds the delay, tbf below it limits the rate
        commands.append(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:",
                         "netem", "delay", delay])
        commands.append(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle",
                         "10:", *shaping])
    else:
        commands.append(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", *shaping])
    with namespaces([name], commands):
        yield ["ip", "netns", "exec", name]


@contextmanager
def per_worker_links(rate: str, workers: int) -> Iterator[list[list[str]]]:
    """One namespace per worker (address 10.213.0.k+1 on eth0), each linked to a bridge by a veth pair limited to
    ``rate`` each way; the command prefix of each."""
    require_root_and_iproute2("--links per-worker")
    tag = f"db{os.getpid()}"
    switch, names = f"{tag}s", [f"{tag}w{k}" for k in range(workers)]
    shaping = token_bucket(rate)
    commands = [["ip", "netns", "add", switch], ["ip", "-n", switch, "link", "add", "br0", "type", "bridge"],
                ["ip", "-n", switch, "link", "set", "br0", "up"]]
    for k, name in enumerate(names):
        inside, outside = f"{tag}a{k}", f"{tag}b{k}"
        commands += [
            ["ip", "netns", "add", name],
            ["ip", "link", "add", inside, "netns", name, "type", "veth", "peer", "name", outside, "netns", switch],
            ["ip", "-n", name, "link", "set", inside, "name", "eth0"],
            ["ip", "-n", name, "addr", "add", f"10.213.0.{k + 1}/24", "dev", "eth0"],
            ["ip", "-n", name, "link", "set", "eth0", "up"],
            ["ip", "-n", name, "link", "set", "lo", "up"],
            ["ip", "-n", switch, "link", "set", outside, "master", "br0"],
            ["ip", "-n", switch, "link", "set", outside, "up"],
            ["tc", "-n", name, "qdisc", "add", "dev", "eth0", "root", *shaping],  # the worker's uplink
            ["tc", "-n", switch, "qdisc", "add", "dev", outside, "root", *shaping],  # and its downlink
        ]
    with namespaces([*names, switch], commands):
        yield [["ip", "netns", "exec", name, "env", "GLOO_SOCKET_IFNAME=eth0"] for name in names]


def run_one(
    prefixes: list[list[str]], workers: int, bench_args: list[str], out: Path, timeout: float, tag: str = ""
) -> dict:
    """One launch: a single torchrun agent (one prefix), or one agent per worker, each in its own namespace; stopped
    after ``timeout`` seconds. ``tag`` names its files (``workers{N}{tag}.*``)."""
    deadline = time.monotonic() + timeout
    result = out / f"workers{workers}{tag}.json"
    bench = [str(HERE / "bench_engine.py"), *BENCH_DEFAULTS, *bench_args, f"--json={result}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if len(prefixes) == 1:
        commands = [[*prefixes[0], *torchrun, "--standalone", f"--nproc-per-node={workers}", *bench]]
    else:
        commands = [
            [*prefix, *torchrun, f"--nnodes={workers}", "--nproc-per-node=1", "--rdzv-backend=c10d",
             "--rdzv-endpoint=10.213.0.1:29500", f"--rdzv-id=bench{os.getpid()}", f"--rdzv-conf=is_host={k == 0}",
             f"--local-addr=10.213.0.{k + 1}", *bench]
            for k, prefix in enumerate(prefixes)
        ]
    for command in commands:
        print(f"$ {' '.join(command)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # Each agent writes to files, not pipes: waiting on one agent while another fills its pipe would deadlock them.
    logs = [(out / f"workers{workers}{tag}.agent{k}.out", out / f"workers{workers}{tag}.agent{k}.err")
            for k in range(len(commands))]
    with contextlib.ExitStack() as files:
        procs = [
            subprocess.Popen(c, env=env, stdout=files.enter_context(o.open("w")), stderr=files.enter_context(e.open("w")),
                             start_new_session=True)  # a process group each: a stop reaches the workers too
            for c, (o, e) in zip(commands, logs)
        ]
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            sys.exit(f"benchmark.py: the launch with {workers} workers took over {timeout:g} s and was stopped; "
                     f"its output: {', '.join(str(e) for _, e in logs)}")
    for proc, (_, err) in zip(procs, logs):
        if proc.returncode != 0:
            sys.exit(f"benchmark.py: the launch with {workers} workers failed:\n{err.read_text()[-3000:]}")
    print("".join(o.read_text() for o, _ in logs), flush=True)
    return json.loads(result.read_text())


def run_separately(
    prefixes: list[list[str]], workers: int, bench_args: list[str], out: Path, timeout: float, rounds: int
) -> dict:
    """Each implementation in a launch of its own, ``rounds`` times, the implementations taking turns within a round.

    One launch then holds one engine, its process groups and its memory, as a user's job does. The result has the
    shape of a single launch's: per implementation the median of each round's launch, their median, min and max, and
    the ratios of the medians; ``phases`` (with ``--phases``) is the per-phase median over rounds.
    """
    options = bench_engine.parser().parse_args([*BENCH_DEFAULTS, *bench_args])
    compressions = tuple(options.compression.split(","))
    names = [name for name, _, _ in bench_engine.implementations(options.topologies.split(","), options.message_mb,
                                                                 compressions)
             if not options.only or name in options.only.split(",")]
    if not names:
        valid = bench_engine.implementations(options.topologies.split(","), options.message_mb, compressions)
        sys.exit(f"benchmark.py: --only {options.only}: none of these is measured here; valid: "
                 + ", ".join(n for n, _, _ in valid))
    launches: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            tag = f".{name.replace('/', '_')}.round{r}"
            launches[name].append(run_one(prefixes, workers, [*bench_args, f"--only={name}"], out, timeout, tag))
    first = next(iter(launches.values()))[0]
    rates = {name: [run["results"][name]["median"] for run in runs] for name, runs in launches.items()
             if all(name in run["results"] for run in runs)}
    skipped = {name: runs[0]["skipped"].get(name, "failed in some round") for name, runs in launches.items()
               if name not in rates}
    wire = {name: [run["results"][name]["wire_bytes_per_step"] for run in launches[name]] for name in rates}
    faults = {name: [run["results"][name]["page_faults_per_step"] for run in launches[name]] for name in rates}
    results = bench_engine.summarize(rates, wire, faults)
    phases = {
        name: {phase: statistics.median(run["phases"][name][phase] for run in launches[name])
               for phase in bench_engine.PHASES}
        for name in rates if all(name in run.get("phases", {}) for run in launches[name])
    }
    merged = {**first, "argv": sys.argv, "rounds": rounds, "launches": "separate", "results": results,
              "phases": phases, "skipped": skipped}
    (out / f"workers{workers}.json").write_text(json.dumps(merged, indent=2))
    print(f"{workers} workers, each implementation in its own launch, medians of {rounds} rounds:")
    for name, r in results.items():
        ratios = ", ".join(f"{x:.3f}x {what}" for x, what in ((r["vs_local"], "local"), (r["vs_ddp"], "DDP"))
                           if x is not None)
        print(f"  {name:<34} {r['median']:>8.1f} samples/s ({ratios}), {r['page_faults_per_step']:.0f} page faults/step;"
              " rounds: " + ", ".join(f"{x:.0f}" for x in r["samples_per_s"]))
    if phases:
        bench_engine.print_phases(phases)
    return merged


# --time-to-accuracy: real decent-train jobs; the same model, data, schedule and seed, differing only in these.
ACCURACY_JOBS = {
    "ddp": ["algorithm=allreduce"],
    "ring": ["topology=ring"],
    "ring-bf16": ["topology=ring", "compression=bf16"],
    "ring-int8": ["topology=ring", "compression=int8"],
    "ring-int8-bf16-copies": ["topology=ring", "compression=int8", "compression.copy_dtype=bf16"],
}
# A model big enough that communication matters (4.3M parameters, 17 MB) on data that ships with scikit-learn.
ACCURACY_TRAIN = ["model=mlp", "model.hidden_sizes=[2048,2048]", "dataset=digits", "epochs=20", "eval_every=20",
                  "seed=0", "logger.wandb.mode=disabled", "logger.progress_bar=false", "checkpoint.every=0"]


def time_to_accuracy(prefix: list[str], workers: int, target: float, jobs: list[str], train: list[str], out: Path,
                     timeout: float) -> dict[str, dict]:
    """Run each job of ``jobs`` (``ACCURACY_JOBS``) as a real ``decent-train`` job on ``workers`` workers inside
    ``prefix`` (the emulated network); from its metrics, the training time at which the averaged model's evaluated
    accuracy first reached ``target``, the final accuracy and the wall time."""
    results = {}
    for job in jobs:
        run_dir = out / job
        command = [*prefix, sys.executable, "-m", "decent_train.launcher.cli", *train, *ACCURACY_JOBS[job],
                   f"launch.nproc_per_node={workers}", f"hydra.run.dir={run_dir}"]
        print(f"$ {' '.join(command)}", flush=True)
        start = time.monotonic()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
        if proc.returncode != 0:
            sys.exit(f"benchmark.py: the {job} job failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evaluated = [(r["time/elapsed_s"], r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
        reached = next(((t, step) for t, step, accuracy in evaluated if accuracy >= target), (None, None))
        final = json.loads((run_dir / "result.json").read_text())
        results[job] = {"overrides": ACCURACY_JOBS[job], "seconds_to_target": reached[0], "step_at_target": reached[1],
                        "final_accuracy": final["eval/accuracy"], "train_time_s": final["train_time_s"],
                        "wall_time_s": time.monotonic() - start, "evaluations": evaluated,
                        "bytes_per_step": next(r["comm/bytes_per_step"] for r in records if "comm/bytes_per_step" in r)}
    return results


def chart(runs: dict[int, dict], title: str, path: Path) -> None:
    """Throughput relative to the no-communication loop, one group of bars per worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for run in runs.values() for name in run["results"] if name != "local"))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(names) * len(runs) / 2), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        kept = [(j, run["results"][name]["vs_local"]) for j, run in enumerate(runs.values())
                if run["results"].get(name, {}).get("vs_local") is not None]
        xs, ys = [j + i * width for j, _ in kept], [y for _, y in kept]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runs))], [f"{n} workers" for n in runs])
    ax.set_ylabel("samples/s / no-communication loop")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other options (--topologies, --steps, --warmup, --repeats, --width, --depth, --batch) go to "
        f"bench_engine.py; defaults here: {' '.join(BENCH_DEFAULTS)}",
    )
    p.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts, one launch each")
    p.add_argument("--rate", default=None, help="emulated link rate for tc, e.g. 4gbit (needs root)")
    p.add_argument("--delay", default=None, help="with --rate: added one-way delay for netem, e.g. 1ms")
    p.add_argument("--links", choices=("shared", "per-worker"), default="shared",
                   help="with --rate: one link shared by all workers, or one per worker")
    p.add_argument("--out", type=Path, default=Path("bench"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds a launch may take before it is stopped")
    p.add_argument("--launches", choices=("shared", "separate"), default="shared",
                   help="all implementations interleaved in one launch per worker count, or each in its own launch")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --launches separate: rounds of one launch per implementation, taking turns")
    p.add_argument("--time-to-accuracy", type=float, default=None, metavar="TARGET",
                   help="instead: real decent-train jobs (--jobs), time until the averaged model reaches TARGET")
    p.add_argument("--jobs", default="ddp,ring,ring-int8",
                   help=f"with --time-to-accuracy: comma-separated, of {', '.join(ACCURACY_JOBS)}")
    p.add_argument("--train", default=" ".join(ACCURACY_TRAIN),
                   help="with --time-to-accuracy: the overrides every job shares (space-separated)")
    args, bench_args = p.parse_known_args()
    if args.rounds < 1:
        sys.exit(f"benchmark.py: --rounds {args.rounds}: must be at least 1")
    if args.time_to_accuracy is not None:
        unknown = [j for j in args.jobs.split(",") if j not in ACCURACY_JOBS]
        if unknown or "," in args.workers:
            sys.exit(f"benchmark.py: --time-to-accuracy takes one --workers count and --jobs of "
                     f"{', '.join(ACCURACY_JOBS)} (got --workers {args.workers}, unknown jobs {unknown})")
        args.out.mkdir(parents=True, exist_ok=True)
        with emulated_network(args.rate, args.delay) as prefix:
            results = time_to_accuracy(prefix, int(args.workers), args.time_to_accuracy, args.jobs.split(","),
                                       args.train.split(), args.out, args.timeout)
        network = f"loopback limited to {args.rate}" if args.rate else "loopback"
        (args.out / "time_to_accuracy.json").write_text(json.dumps(
            {"argv": sys.argv, "network": network, "target": args.time_to_accuracy, "jobs": results}, indent=2))
        print(f"| job | seconds to {args.time_to_accuracy} | step | final accuracy | training s | MB/step/worker |")
        print("|---|---|---|---|---|---|")
        for job, r in results.items():
            seconds = f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] is not None else "not reached"
            print(f"| {job} | {seconds} | {r['step_at_target']} | {r['final_accuracy']:.4f} | {r['train_time_s']:.1f} "
                  f"| {r['bytes_per_step'] / 1e6:.2f} |")
        return

    def measure(prefixes: list[list[str]], workers: int) -> dict:
        if args.launches == "separate":
            return run_separately(prefixes, workers, bench_args, args.out, args.timeout, args.rounds)
        return run_one(prefixes, workers, bench_args, args.out, args.timeout)

    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[int, dict] = {}
    if args.rate and args.links == "per-worker":
        for workers in [int(w) for w in args.workers.split(",")]:
            with per_worker_links(args.rate, workers) as prefixes:
                runs[workers] = measure(prefixes, workers)
        network = f"a {args.rate} link per worker"
    else:
        with emulated_network(args.rate, args.delay) as prefix:
            for workers in [int(w) for w in args.workers.split(",")]:
                runs[workers] = measure([prefix], workers)
        delay = f", +{args.delay} delay" if args.delay else ""
        network = f"loopback limited to {args.rate}{delay}" if args.rate else "loopback"
    summary = {"argv": sys.argv, "network": network, "launches": args.launches, "runs": runs}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    parameters = next(iter(runs.values()))["parameters"]
    chart(runs, f"MLP {parameters / 1e6:.1f}M parameters, gloo on CPU, {network}", args.out / "throughput.png")

    print("| implementation | " + " | ".join(f"{n} workers" for n in runs) + " |")
    print("|---|" + "---|" * len(runs))
    names = list(dict.fromkeys(name for run in runs.values() for name in run["results"]))
    for name in names:
        cells = []
        for run in runs.values():
            r = run["results"].get(name)
            ratios = ", ".join(f"{x:.2f}x {what}" for x, what in ((r["vs_local"], "local"), (r["vs_ddp"], "DDP"))
                               if x is not None) if r else ""
            cells.append(f"{r['median']:.0f} ({ratios})" if r else "skipped")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"written: {args.out / 'results.json'}, {args.out / 'throughput.png'}")


if __name__ == "__main__":
    main()
