"""A runtime model of one training iteration: all-reduce (DDP) against gossip on a topology, from compute time, model
size, link bandwidths and latencies, and the number of workers.

    python scripts/runtime_model.py --validate scripts/benchmarks/cpu_4gbit.json     # against measurements
    python scripts/runtime_model.py --compute-ms 150 --model-mb 98 --gpus-per-node 8  # predictions, 16-1024 GPUs

The model, per iteration:

* Gossip (decent_train): round r's exchange overlaps the whole next iteration, so an iteration takes
  ``max(compute, exchange(r))``, averaged over the topology's period. A round of stages (hierarchical) overlaps only
  its first stage between nodes; the other stages add their time.
* All-reduce (DDP): the gradients' all-reduce can only overlap the backward pass, a fraction ``overlap`` of compute:
  ``max(compute, (1 - overlap) compute + allreduce)``.
* An exchange's time comes from the bytes each link carries. A pair sends the model each way; a group of m >= 3
  (and DDP over all workers) runs a ring all-reduce in rank order, each member sending 2(m-1)/m of the model to the
  next. Bytes between workers of one node cross the intra-node link of the sending worker; bytes between nodes cross
  the sending node's network link, shared by the node's workers. Each sequential message adds the link's latency
  (1 for a pair, 2(m-1) for a ring), once per bucket (buckets are exchanged one after another). ``shared_link`` models the emulation of scripts/benchmark.py --rate: every
  byte of every worker crosses one link.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decent_train.engine.topology import Topology, build_topology  # noqa: E402


@dataclass(frozen=True)
class Cluster:
    """Links in bytes/s and seconds. ``gpus_per_node`` workers share a node's network link."""

    name: str
    inter_bandwidth: float
    inter_latency: float
    intra_bandwidth: float
    intra_latency: float
    gpus_per_node: int = 8
    shared_link: bool = False  # every byte of every worker crosses one link (the tc emulation)


def _flows(groups: list[list[int]], model_bytes: float) -> list[tuple[int, int, float, int]]:
    """(sender, receiver, bytes, sequential messages) of one round or one all-reduce."""
    flows = []
    for ranks in groups:
        m = len(ranks)
        if m == 2:
            flows += [(ranks[0], ranks[1], model_bytes, 1), (ranks[1], ranks[0], model_bytes, 1)]
        elif m >= 3:
            share = 2 * (m - 1) / m * model_bytes
            flows += [(ranks[k], ranks[(k + 1) % m], share, 2 * (m - 1)) for k in range(m)]
    return flows


def exchange_seconds(groups: list[list[int]], model_bytes: float, cluster: Cluster, buckets: int = 1) -> float:
    """How long the slowest link takes to carry one round's traffic, latency included."""
    flows = _flows(groups, model_bytes)
    if not flows:
        return 0.0
    node = lambda rank: rank // cluster.gpus_per_node  # noqa: E731
    if cluster.shared_link:
        steps = max(s for *_, s in flows)
        return sum(b for _, _, b, _ in flows) / cluster.inter_bandwidth + buckets * steps * cluster.inter_latency
    loads: dict[tuple[str, int], tuple[float, int]] = {}
    for src, dst, nbytes, steps in flows:
        key = ("inter", node(src)) if node(src) != node(dst) else ("intra", src)
        total, most = loads.get(key, (0.0, 0))
        loads[key] = (total + nbytes, max(most, steps))
    times = []
    for (kind, _), (nbytes, steps) in loads.items():
        bandwidth, latency = (
            (cluster.inter_bandwidth, cluster.inter_latency) if kind == "inter"
            else (cluster.intra_bandwidth, cluster.intra_latency)
        )
        times.append(nbytes / bandwidth + buckets * steps * latency)
    return max(times)


def gossip_iteration(
    topology: Topology, compute: float, model_bytes: float, cluster: Cluster, buckets: int = 1
) -> float:
    total = 0.0
    for r, stages in enumerate(topology.stages):
        times = [exchange_seconds([list(e.ranks) for e in edges], model_bytes, cluster, buckets) for edges in stages]
        overlapped = times[topology.async_stage(r)]
        total += max(compute, overlapped) + sum(times) - overlapped
    return total / topology.period


def allreduce_iteration(
    workers: int, compute: float, model_bytes: float, cluster: Cluster, overlap: float, buckets: int = 1
) -> float:
    allreduce = exchange_seconds([list(range(workers))], model_bytes, cluster, buckets)
    return max(compute, (1 - overlap) * compute + allreduce)


def validate(path: Path, overlap: float) -> None:
    """Predicted against measured samples/s for every implementation of a scripts/benchmark.py --rate run."""
    summary = json.loads(path.read_text())
    rate = summary["argv"][summary["argv"].index("--rate") + 1] if "--rate" in summary["argv"] else None
    if rate is None:
        sys.exit(f"{path}: not an emulated-network run (--rate); the model needs the link rate")
    bits = float(rate.lower().removesuffix("gbit")) * 1e9
    cluster = Cluster("emulated", bits / 8, 0.0, bits / 8, 0.0, gpus_per_node=1, shared_link=True)
    errors = []
    print("| workers | implementation | measured samples/s | predicted | error |")
    print("|---|---|---|---|---|")
    for workers_key, run in summary["runs"].items():
        workers, batch = int(workers_key), run["args"]["batch"]
        model_bytes = 4 * run["parameters"]
        samples_per_iteration = batch * workers
        compute = samples_per_iteration / run["results"]["local"]["median"]
        for name, result in run["results"].items():
            if name == "local" or name.startswith("decent_dp"):
                continue
            if name == "ddp":
                seconds = allreduce_iteration(workers, compute, model_bytes, cluster, overlap)
            else:
                topology = build_topology(name.split("/")[1], workers, run["args"]["local_world_size"])
                seconds = gossip_iteration(topology, compute, model_bytes, cluster)
            predicted = samples_per_iteration / seconds
            error = predicted / result["median"] - 1
            errors.append(abs(error))
            print(f"| {workers} | {name} | {result['median']:.0f} | {predicted:.0f} | {error:+.0%} |")
    print(f"mean absolute error {sum(errors) / len(errors):.1%}, largest {max(errors):.1%} ({len(errors)} predictions)")


CLUSTERS = {
    "25 Gb/s Ethernet, NVLink in node": Cluster("ethernet", 25e9 / 8, 20e-6, 300e9, 3e-6),
    "100 Gb/s InfiniBand, NVLink in node": Cluster("infiniband", 100e9 / 8, 5e-6, 300e9, 3e-6),
}


def predict(
    compute: float, model_bytes: float, gpus_per_node: int, overlap: float, sizes: list[int], buckets: int
) -> None:
    print(f"per iteration: compute {compute * 1e3:.0f} ms, model {model_bytes / 1e6:.0f} MB in {buckets} buckets, "
          f"{gpus_per_node} GPUs per node, all-reduce overlaps {overlap:.0%} of compute")
    print("| cluster | GPUs | all-reduce ms | ring ms | one-peer-exp ms | alternating-exp-ring ms | hierarchical ms "
          "| best speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for label, base in CLUSTERS.items():
        cluster = Cluster(base.name, base.inter_bandwidth, base.inter_latency, base.intra_bandwidth,
                          base.intra_latency, gpus_per_node)
        for n in sizes:
            ar = allreduce_iteration(n, compute, model_bytes, cluster, overlap, buckets)
            gossip = {
                t: gossip_iteration(build_topology(t, n, gpus_per_node), compute, model_bytes, cluster, buckets)
                for t in ("ring", "one-peer-exp", "alternating-exp-ring", "hierarchical")
            }
            print(f"| {label} | {n} | {ar * 1e3:.1f} | " + " | ".join(f"{s * 1e3:.1f}" for s in gossip.values())
                  + f" | {ar / min(gossip.values()):.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--validate", type=Path, help="a results.json of scripts/benchmark.py --rate")
    p.add_argument("--overlap", type=float, default=None,
                   help="fraction of compute that DDP's all-reduce can overlap (default: 0 to validate on 2 CPU "
                        "cores, whose gloo threads compete with compute; 2/3, the backward pass, to predict)")
    p.add_argument("--compute-ms", type=float, default=150.0)
    p.add_argument("--model-mb", type=float, default=98.0, help="bytes exchanged per step (ResNet-50 fp32: 98 MB)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--sizes", default="16,32,64,128,256,512,1024")
    args = p.parse_args()
    if args.validate:
        validate(args.validate, 0.0 if args.overlap is None else args.overlap)
    else:
        overlap = 2 / 3 if args.overlap is None else args.overlap
        buckets = max(1, -(-int(args.model_mb * 1e6) // int(args.bucket_mb * 1e6)))
        predict(args.compute_ms / 1e3, args.model_mb * 1e6, args.gpus_per_node, overlap,
                [int(n) for n in args.sizes.split(",")], buckets)


if __name__ == "__main__":
    main()
