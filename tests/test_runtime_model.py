"""scripts/runtime_model.py against computations by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import runtime_model as rm  # noqa: E402

from decent_train import build_topology  # noqa: E402

MB = 1e6
LINKS = rm.Cluster("test", inter_bandwidth=100 * MB, inter_latency=1e-3, intra_bandwidth=1000 * MB,
                   intra_latency=1e-5, gpus_per_node=2)


def test_a_pair_across_nodes_sends_the_model_once_each_way() -> None:
    # ranks 1 (node 0) and 2 (node 1): 50 MB over 100 MB/s, one message
    assert rm.exchange_seconds([[1, 2]], 50 * MB, LINKS) == pytest.approx(0.5 + 1e-3)
    # inside a node: the fast link
    assert rm.exchange_seconds([[0, 1]], 50 * MB, LINKS) == pytest.approx(0.05 + 1e-5)
    assert rm.exchange_seconds([[0], [1]], 50 * MB, LINKS) == 0.0


def test_workers_of_a_node_share_its_network_link() -> None:
    # ranks 0, 1 (node 0) pair with 2, 3 (node 1): node 0's link carries 2 x 50 MB
    assert rm.exchange_seconds([[0, 2], [1, 3]], 50 * MB, LINKS) == pytest.approx(1.0 + 1e-3)


def test_ring_allreduce_bytes_and_latency_steps() -> None:
    # 4 workers on 2 nodes, ring 0->1->2->3->0: links 1->2 and 3->0 cross nodes, each carries 2*3/4 of 40 MB
    seconds = rm.exchange_seconds([[0, 1, 2, 3]], 40 * MB, LINKS, buckets=3)
    assert seconds == pytest.approx(2 * 3 / 4 * 40 * MB / (100 * MB) + 3 * 2 * 3 * 1e-3)


def test_shared_link_adds_every_workers_bytes() -> None:
    shared = rm.Cluster("tc", 500 * MB, 0.0, 500 * MB, 0.0, gpus_per_node=1, shared_link=True)
    assert rm.exchange_seconds([[0, 1], [2, 3]], 26 * MB, shared) == pytest.approx(4 * 26 / 500)


def test_iterations_overlap_as_documented() -> None:
    ring = build_topology("ring", 4, 2)  # round 0: (0,1) (2,3) inside nodes; round 1: (0,3) (1,2) across
    across = rm.exchange_seconds([[0, 3], [1, 2]], 50 * MB, LINKS)
    assert rm.gossip_iteration(ring, 0.2, 50 * MB, LINKS) == pytest.approx((0.2 + max(0.2, across)) / 2)
    allreduce = rm.exchange_seconds([[0, 1, 2, 3]], 50 * MB, LINKS)
    assert rm.allreduce_iteration(4, 0.2, 50 * MB, LINKS, overlap=0.5) == pytest.approx(max(0.2, 0.1 + allreduce))


def test_a_round_of_stages_overlaps_only_its_stage_between_nodes() -> None:
    hierarchical = build_topology("hierarchical", 4, 2)  # one round: (0,2) (1,3) across nodes, then (0,1) (2,3)
    across = rm.exchange_seconds([[0, 2], [1, 3]], 50 * MB, LINKS)  # 1.0 s: node 0's link carries 2 x 50 MB
    within = rm.exchange_seconds([[0, 1], [2, 3]], 50 * MB, LINKS)
    assert rm.gossip_iteration(hierarchical, 0.2, 50 * MB, LINKS) == pytest.approx(max(0.2, across) + within)
