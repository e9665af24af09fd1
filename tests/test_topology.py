"""Tests for decent_train.engine.topology.

Every check is against an independent oracle: decent-dp 0.2.3's group schedules (obtained without
torch.distributed by calling its unbound ``_get_topo_edges`` on a stand-in object), matrices and edge sets
built by hand from the groups, and numpy's eigenvalue routine for the spectral gap. No process groups.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from decent_train.engine.topology import (
    Edge,
    Topology,
    TopologyReg,
    build_topology,
    get_topology_class,
    register_topology,
    topology_names,
)

BUILTINS = ("complete", "ring", "one-peer-exp", "alternating-exp-ring")

# (name, world_size, local_world_size) for every built-in, several sizes each.
BUILTIN_CASES = (
    [("complete", n, 1) for n in (1, 2, 3, 5, 8)]
    + [("complete", 8, 4)]
    + [("ring", n, 1) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9)]
    + [("one-peer-exp", n, 1) for n in (1, 2, 4, 8, 16)]
    + [
        ("alternating-exp-ring", n, lws)
        for n, lws in ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (8, 4), (16, 4), (16, 2))
    ]
)


# -- helpers -----------------------------------------------------------------------------------------------------
_counter = itertools.count()


def _unique(prefix: str = "test-topo") -> str:
    name = f"{prefix}-{next(_counter)}"
    while name in TopologyReg.registry:
        name = f"{prefix}-{next(_counter)}"
    return name


@contextmanager
def _registered(name: str) -> Iterator[None]:
    """Remove ``name`` from the registry afterwards, whatever happened."""
    try:
        yield
    finally:
        TopologyReg.registry.pop(name, None)


def _custom(rounds_spec, *, name: str = "custom-test") -> type[Topology]:
    """An unregistered Topology subclass whose rounds are ``rounds_spec``: lists of ranks or (ranks, weight)."""

    def _get_topo_edges(self):
        rounds = []
        for spec in rounds_spec:
            edges = []
            for group in spec:
                if isinstance(group, tuple):
                    edges.append(Edge(list(group[0]), group[1]))
                else:
                    edges.append(Edge(list(group)))
            rounds.append(edges)
        return rounds

    return type("CustomTopo", (Topology,), {"_get_topo_edges": _get_topo_edges, "name": name})


def _groups(topo: Topology) -> list[list[list[int]]]:
    """Per round, the sorted list of sorted rank lists."""
    return [sorted(sorted(e.ranks) for e in edges) for edges in topo.rounds]


def _weights(topo: Topology) -> list[dict[tuple[int, ...], float]]:
    return [{tuple(sorted(e.ranks)): e.weight for e in edges} for edges in topo.rounds]


def _decent_dp_rounds(cls_name: str, n: int, lws: int):
    import decent_dp.topo as topo_mod
    stand_in = SimpleNamespace(_world_size=n, _local_world_size=lws, _n_nodes=n // lws, _rank=0)
    rounds = getattr(topo_mod, cls_name)._get_topo_edges(stand_in)
    groups = [sorted(sorted(e.ranks) for e in edges) for edges in rounds]
    weights = [{tuple(sorted(e.ranks)): e.weight for e in edges} for edges in rounds]
    return groups, weights


def _hand_matrix(n: int, groups) -> list[list[float]]:
    """Uniform block-diagonal mixing matrix built from a list of groups (each a rank list)."""
    w = [[0.0] * n for _ in range(n)]
    for g in groups:
        for i in g:
            for j in g:
                w[i][j] = 1.0 / len(g)
    return w


def _tensor_to_lists(t: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x in row] for row in t.tolist()]


def _assert_matrix_close(got: list[list[float]], expected: list[list[float]], tol: float = 1e-12) -> None:
    assert len(got) == len(expected)
    for i, (rg, re_) in enumerate(zip(got, expected)):
        assert len(rg) == len(re_)
        for j, (a, b) in enumerate(zip(rg, re_)):
            assert abs(a - b) <= tol, f"entry ({i},{j}): got {a}, expected {b}"


def _numpy_gap(n: int, rounds_groups) -> float:
    """1 - ||P - J/n||_2 with P the product of the per-round uniform matrices, via numpy.linalg.eigvalsh."""
    import numpy as np
    p = np.eye(n)
    for groups in rounds_groups:
        p = np.array(_hand_matrix(n, groups)) @ p
    d = p - np.full((n, n), 1.0 / n)
    eig = np.linalg.eigvalsh(d.T @ d)  # ascending; singular values squared
    largest = float(max(eig[-1], 0.0))
    return 1.0 - math.sqrt(largest)


# -- 1. same groups as decent-dp 0.2.3 ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_ring_matches_decent_dp(n):
    expected_groups, expected_weights = _decent_dp_rounds("RingTopology", n, 1)
    topo = build_topology("ring", n)
    assert _groups(topo) == expected_groups
    assert topo.period == len(expected_groups)
    for got, exp in zip(_weights(topo), expected_weights):
        assert got.keys() == exp.keys()
        for key in exp:
            assert got[key] == pytest.approx(exp[key], abs=1e-15)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_one_peer_exp_matches_decent_dp(n):
    expected_groups, expected_weights = _decent_dp_rounds("OnePeerExpTopology", n, 1)
    topo = build_topology("one-peer-exp", n)
    assert _groups(topo) == expected_groups
    assert topo.period == len(expected_groups) == int(math.log2(n))
    for got, exp in zip(_weights(topo), expected_weights):
        assert got.keys() == exp.keys()
        for key in exp:
            assert got[key] == pytest.approx(exp[key], abs=1e-15)


@pytest.mark.parametrize("n,lws", [(4, 2), (8, 2), (8, 4), (16, 4), (16, 2), (2, 1), (4, 1), (8, 1)])
def test_alternating_exp_ring_matches_decent_dp(n, lws):
    expected_groups, expected_weights = _decent_dp_rounds("AlternatingExpRingTopology", n, lws)
    topo = build_topology("alternating-exp-ring", n, local_world_size=lws)
    assert _groups(topo) == expected_groups
    assert topo.period == len(expected_groups) == 2 * int(math.log2(n // lws))
    for got, exp in zip(_weights(topo), expected_weights):
        assert got.keys() == exp.keys()
        for key in exp:
            assert got[key] == pytest.approx(exp[key], abs=1e-15)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_complete_matches_decent_dp(n):
    expected_groups, expected_weights = _decent_dp_rounds("CompleteTopology", n, 1)
    topo = build_topology("complete", n)
    assert _groups(topo) == expected_groups
    assert _weights(topo)[0][tuple(range(n))] == pytest.approx(expected_weights[0][tuple(range(n))], abs=1e-15)


# -- 2. odd ring and n = 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [3, 5, 7, 9])
def test_odd_ring_partitions_and_covers_every_ring_edge(n):
    topo = build_topology("ring", n)
    assert topo.period == 2
    covered: set[frozenset[int]] = set()
    for groups in _groups(topo):
        members = [r for g in groups for r in g]
        assert sorted(members) == list(range(n)), "every rank in exactly one group per round"
        sizes = sorted(len(g) for g in groups)
        assert sizes == [2] * ((n - 3) // 2) + [3], f"pairs plus exactly one triple, got sizes {sizes}"
        for g in groups:
            covered.update(frozenset(pair) for pair in itertools.combinations(g, 2))
    ring_edges = {frozenset((i, (i + 1) % n)) for i in range(n)}
    assert ring_edges <= covered, f"ring edges not covered: {ring_edges - covered}"
    assert topo.spectral_gap() > 0.0


@pytest.mark.parametrize("name", BUILTINS)
def test_single_worker(name):
    topo = build_topology(name, 1)
    assert topo.period >= 1
    for edges in topo.rounds:
        assert [e.ranks for e in edges] == [[0]]
    assert topo.edge(0, 0).ranks == [0]
    assert topo.edge(7).ranks == [0]
    assert topo.spectral_gap() == pytest.approx(1.0, abs=1e-12)


# -- 3. mixing matrices -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,n,lws", BUILTIN_CASES)
def test_mixing_matrices_match_hand_built(name, n, lws):
    topo = build_topology(name, n, local_world_size=lws)
    for r, groups in enumerate(_groups(topo)):
        w = topo.mixing_matrix(r)
        assert w.shape == (n, n)
        assert w.dtype == torch.float64
        got = _tensor_to_lists(w)
        _assert_matrix_close(got, _hand_matrix(n, groups))
        for i in range(n):
            assert sum(got[i]) == pytest.approx(1.0, abs=1e-12), f"row {i} of round {r}"
            assert sum(got[k][i] for k in range(n)) == pytest.approx(1.0, abs=1e-12), f"column {i} of round {r}"
            for j in range(n):
                assert got[i][j] >= 0.0
                assert got[i][j] == got[j][i]
    # Indices wrap around the period.
    _assert_matrix_close(_tensor_to_lists(topo.mixing_matrix(topo.period)), _tensor_to_lists(topo.mixing_matrix(0)))


@pytest.mark.parametrize("w", [0.0, 0.2, 0.7, 1.0])
def test_mixing_matrix_non_uniform_pair_weight(w):
    topo = _custom([[([0, 1], w), [2, 3]], [[1, 2], ([3, 0], w)]])(world_size=4)
    m0 = _tensor_to_lists(topo.mixing_matrix(0))
    expected0 = [
        [w, 1 - w, 0.0, 0.0],
        [1 - w, w, 0.0, 0.0],
        [0.0, 0.0, 0.5, 0.5],
        [0.0, 0.0, 0.5, 0.5],
    ]
    _assert_matrix_close(m0, expected0)
    m1 = _tensor_to_lists(topo.mixing_matrix(1))
    expected1 = [
        [w, 0.0, 0.0, 1 - w],
        [0.0, 0.5, 0.5, 0.0],
        [0.0, 0.5, 0.5, 0.0],
        [1 - w, 0.0, 0.0, w],
    ]
    _assert_matrix_close(m1, expected1)
    # Period product P = W1 @ W0, computed by hand from the two matrices above.
    expected_p = [[sum(expected1[i][k] * expected0[k][j] for k in range(4)) for j in range(4)] for i in range(4)]
    _assert_matrix_close(_tensor_to_lists(topo.period_matrix()), expected_p)


def test_mixing_matrix_non_uniform_triple_weight():
    w = 0.4
    topo = _custom([[([0, 1, 2], w), [3]]])(world_size=4)
    other = (1 - w) / 2
    expected = [
        [w, other, other, 0.0],
        [other, w, other, 0.0],
        [other, other, w, 0.0],
        [0.0, 0.0, 0.0, 1.0],
    ]
    _assert_matrix_close(_tensor_to_lists(topo.mixing_matrix(0)), expected)


def test_edge_defaults_and_sorting():
    e = Edge([3, 1, 2])
    assert e.ranks == [1, 2, 3]
    assert e.size == 3
    assert e.weight == pytest.approx(1 / 3)
    assert e.neighbor_weight == pytest.approx(1 / 3)
    assert e.is_uniform
    p = Edge([5, 4], 0.8)
    assert p.ranks == [4, 5]
    assert p.neighbor_weight == pytest.approx(0.2)
    assert not p.is_uniform
    assert Edge([7]).weight == 1.0
    assert Edge([7]).neighbor_weight == 0.0


# -- 4. spectral gap ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,n,lws", BUILTIN_CASES)
def test_spectral_gap_matches_numpy(name, n, lws):
    topo = build_topology(name, n, local_world_size=lws)
    rounds_groups = [[list(e.ranks) for e in edges] for edges in topo.rounds]
    assert topo.spectral_gap() == pytest.approx(_numpy_gap(n, rounds_groups), abs=1e-10)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_spectral_gap_complete_is_one(n):
    assert build_topology("complete", n).spectral_gap() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_spectral_gap_one_peer_exp_exact_averaging(n):
    topo = build_topology("one-peer-exp", n)
    # Exact averaging after one period: P = J/n entrywise.
    _assert_matrix_close(_tensor_to_lists(topo.period_matrix()), [[1.0 / n] * n for _ in range(n)])
    assert topo.spectral_gap() == pytest.approx(1.0, abs=1e-12)


def test_spectral_gap_ring_six_strictly_between():
    gap = build_topology("ring", 6).spectral_gap()
    assert 0.0 < gap < 1.0
    assert gap == pytest.approx(_numpy_gap(6, [[[0, 1], [2, 3], [4, 5]], [[0, 5], [1, 2], [3, 4]]]), abs=1e-10)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_spectral_gap_all_singletons_is_zero(n):
    topo = _custom([[[i] for i in range(n)]])(world_size=n)
    _assert_matrix_close(_tensor_to_lists(topo.period_matrix()), [[float(i == j) for j in range(n)] for i in range(n)])
    assert topo.spectral_gap() == pytest.approx(0.0, abs=1e-12)


def test_spectral_gap_custom_non_uniform_matches_numpy():
    import numpy as np
    w = 0.7
    topo = _custom([[([0, 1], w), [2, 3]], [[1, 2], ([3, 0], w)]])(world_size=4)
    w0 = np.array([[w, 1 - w, 0, 0], [1 - w, w, 0, 0], [0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5]])
    w1 = np.array([[w, 0, 0, 1 - w], [0, 0.5, 0.5, 0], [0, 0.5, 0.5, 0], [1 - w, 0, 0, w]])
    d = w1 @ w0 - np.full((4, 4), 0.25)
    expected = 1.0 - math.sqrt(max(float(np.linalg.eigvalsh(d.T @ d)[-1]), 0.0))
    assert topo.spectral_gap() == pytest.approx(expected, abs=1e-10)


def test_describe_mentions_schedule():
    topo = build_topology("ring", 4)
    text = topo.describe()
    assert "ring" in text
    assert f"period {topo.period}" in text
    assert f"{topo.spectral_gap():.4f}" in text
    for r, groups in enumerate(_groups(topo)):
        assert f"round {r}:" in text
        for g in groups:
            assert "(" + ",".join(map(str, g)) + ")" in text


# -- 5. edge(step, rank) ------------------------------------------------------------------------------------------
def test_edge_uses_round_step_mod_period():
    spec = [
        [[0, 1], [2, 3], [4, 5]],
        [[0, 5], [1, 2], [3, 4]],
        [[0, 3], [1, 4], [2, 5]],
    ]
    cls = _custom(spec)
    for rank in range(6):
        topo = cls(world_size=6, rank=rank)
        assert topo.period == 3
        for step in range(25):
            expected = next(g for g in spec[step % 3] if rank in g)
            assert topo.edge(step, rank).ranks == sorted(expected)
            assert topo.edge(step).ranks == sorted(expected)  # default: this worker
            assert topo.get_edge(step, rank).ranks == sorted(expected)
            # Asking about another rank from this worker's object works too.
            other = (rank + 1) % 6
            assert other in topo.edge(step, other).ranks


# -- 6. registry --------------------------------------------------------------------------------------------------
def test_register_and_build_custom():
    name = _unique()
    with _registered(name):

        @TopologyReg.register(name)
        class Pairs(Topology):
            def _get_topo_edges(self):
                return [[Edge([i, i + 1]) for i in range(0, self._world_size, 2)]]

        assert name in topology_names()
        assert get_topology_class(name) is Pairs
        assert Pairs.name == name
        topo = build_topology(name, 6)
        assert isinstance(topo, Pairs)
        assert _groups(topo) == [[[0, 1], [2, 3], [4, 5]]]
        assert name in topo.describe()
    assert name not in topology_names()


def test_register_topology_function_form():
    name = _unique()
    with _registered(name):
        cls = _custom([[[0, 1]]])
        assert register_topology(name, cls) is cls
        assert build_topology(name, 2).period == 1


def test_register_same_name_twice_raises():
    name = _unique()
    with _registered(name):
        TopologyReg.register(name)(_custom([[[0]]]))
        with pytest.raises(ValueError, match=re.escape(name)):
            TopologyReg.register(name)(_custom([[[0]]]))
    with pytest.raises(ValueError, match="ring"):
        TopologyReg.register("ring")(_custom([[[0]]]))
    # The built-in stays in place.
    assert _groups(build_topology("ring", 4)) == _decent_dp_rounds("RingTopology", 4, 1)[0]


@pytest.mark.parametrize("bad", [int, object, "ring", None])
def test_register_non_topology_raises(bad):
    name = _unique()
    with _registered(name):
        with pytest.raises(ValueError, match=re.escape(name)):
            TopologyReg.register(name)(bad)
        assert name not in TopologyReg.registry


# -- 7. bad input -------------------------------------------------------------------------------------------------
def test_unknown_topology_lists_registered_names():
    with pytest.raises(ValueError) as info:
        build_topology("no-such-topology", 4)
    msg = str(info.value)
    assert "no-such-topology" in msg
    for name in BUILTINS:
        assert name in msg
    for name in topology_names():
        assert name in msg
    with pytest.raises(ValueError, match="no-such-topology"):
        get_topology_class("no-such-topology")


@pytest.mark.parametrize("n", [3, 6, 12])
def test_one_peer_exp_needs_power_of_two(n):
    with pytest.raises(ValueError) as info:
        build_topology("one-peer-exp", n)
    msg = str(info.value)
    assert re.search(r"power.of.two", msg), msg
    assert re.search(rf"\b{n}\b", msg), msg


@pytest.mark.parametrize("n,lws", [(3, 1), (6, 2), (12, 4)])
def test_alternating_exp_ring_needs_power_of_two_nodes(n, lws):
    with pytest.raises(ValueError) as info:
        build_topology("alternating-exp-ring", n, local_world_size=lws)
    msg = str(info.value)
    assert re.search(r"power.of.two", msg), msg
    assert "3 nodes" in msg, msg


@pytest.mark.parametrize("n,lws", [(6, 4), (5, 2), (4, 0), (4, -2)])
def test_local_world_size_must_divide(n, lws):
    with pytest.raises(ValueError) as info:
        build_topology("ring", n, local_world_size=lws)
    msg = str(info.value)
    assert str(lws) in msg and str(n) in msg, msg


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="0"):
        build_topology("complete", 0)


def test_custom_rank_in_two_groups():
    cls = _custom([[[0, 1], [2, 3]], [[0, 1], [1, 2], [3]]])
    with pytest.raises(ValueError) as info:
        cls(world_size=4)
    msg = str(info.value)
    assert "round 1" in msg and "rank 1" in msg, msg


def test_custom_rank_left_out():
    cls = _custom([[[0, 1], [3]]])
    with pytest.raises(ValueError) as info:
        cls(world_size=4)
    msg = str(info.value)
    assert "round 0" in msg and "2" in msg, msg


@pytest.mark.parametrize("bad_rank", [4, 9, -1])
def test_custom_rank_out_of_range(bad_rank):
    cls = _custom([[[0, 1], [2, 3]], [[0, 1], [2, 3, bad_rank]]])
    with pytest.raises(ValueError) as info:
        cls(world_size=4)
    msg = str(info.value)
    assert "round 1" in msg and f"rank {bad_rank}" in msg and "0..3" in msg, msg


def test_custom_no_rounds():
    with pytest.raises(ValueError, match="round"):
        _custom([])(world_size=2)


def test_custom_empty_group():
    with pytest.raises(ValueError, match="round 0"):
        _custom([[[0, 1], []]])(world_size=2)


@pytest.mark.parametrize("w", [-0.1, 1.5, float("nan")])
def test_custom_weight_out_of_range(w):
    cls = _custom([[[0, 1]], [([0, 1], w)]])
    with pytest.raises(ValueError) as info:
        cls(world_size=2)
    msg = str(info.value)
    assert "round 1" in msg and str(w) in msg and "weight" in msg, msg


def test_topology_without_world_size_outside_distributed():
    # No torch.distributed group in this process: the constructor must say what it needs.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="world_size"):
        get_topology_class("complete")()
