"""Adding an algorithm is one module: ``@register(name, traits=...)`` makes the class the one the worker builds for
``algorithm=name`` and its options a schema the config checks (docs/architecture.md, "Adding an algorithm")."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest

from decent_train.algorithms import ALGORITHMS, Algorithm, algorithm_class, register
from decent_train.config import ALGORITHM_TRAITS, AlgorithmConfig, AlgorithmTraits, check_config
from decent_train.engine import reconfigure


@dataclasses.dataclass
class _ToyConfig(AlgorithmConfig):
    name: str = "toy"
    sync_every: int = 10

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"algorithm.sync_every={self.sync_every} must be >= 1")


@pytest.fixture
def clean_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test registers as "toy" is gone afterwards."""
    for registry in (ALGORITHMS, ALGORITHM_TRAITS):
        monkeypatch.setitem(registry, "toy", None)
        monkeypatch.delitem(registry, "toy")


def _toy_class() -> type[Algorithm]:
    class Toy(Algorithm):  # the protocol's abstract methods, none of which this test calls
        def __init__(self, *args: Any) -> None: ...
        def no_sync(self) -> contextlib.nullcontext[None]: return contextlib.nullcontext()
        def step(self) -> None: ...
        def state_dict(self) -> dict[str, Any]: return {}
        def load_state_dict(self, state: dict[str, Any]) -> None: ...
        @staticmethod
        def averageable_state(state: dict[str, Any]) -> dict[str, Any]: return state
        def lr(self) -> float: return 0.0
        def bytes_per_step(self) -> float: return 0.0
        def averaged(self) -> contextlib.nullcontext[None]: return contextlib.nullcontext()
        def average(self) -> None: ...

    return Toy


def test_register_with_traits_makes_the_options_a_checked_schema(clean_registries: None) -> None:
    with pytest.raises(ValueError, match="algorithm='toy' is not an algorithm"):
        check_config({"algorithm": "toy"})
    toy = register("toy", traits=AlgorithmTraits(schema=_ToyConfig, gossips=True))(_toy_class())
    assert algorithm_class("toy") is toy and toy.name == "toy"
    cfg = check_config({"algorithm": {"name": "toy", "sync_every": 3}})
    assert cfg.algorithm == _ToyConfig(sync_every=3) and cfg.gossips
    with pytest.raises(ValueError, match="algorithm.sync_every=0 must be >= 1"):
        check_config({"algorithm": {"name": "toy", "sync_every": 0}})


def test_an_algorithm_registers_once(clean_registries: None) -> None:
    register("toy")(_toy_class())
    assert check_config({"algorithm": "toy"}).algorithm == AlgorithmConfig(name="toy")  # options: the base schema
    with pytest.raises(ValueError, match="two algorithms registered as 'toy'"):
        register("toy")(_toy_class())


def test_the_traits_of_sharding_and_live_membership_name_the_algorithms_that_have_them() -> None:
    """The config sits below the algorithms and reads their traits; these must agree with what is built: a
    ``shards`` algorithm has a class over sharded replicas, a ``live`` one handles a membership change."""
    from decent_train.algorithms.sharded import SHARDED

    assert {name for name, traits in ALGORITHM_TRAITS.items() if traits.shards} == set(SHARDED)
    live = {name for name, traits in ALGORITHM_TRAITS.items() if traits.live}
    handles = {name for name, cls in ALGORITHMS.items() if cls.membership_changed is not Algorithm.membership_changed}
    assert live == handles == {"decentralized", "diloco", "localsgd"}


def test_an_algorithm_without_shards_is_refused_sharded_naming_those_with_it(clean_registries: None) -> None:
    register("toy", traits=AlgorithmTraits(schema=_ToyConfig, gossips=True, local_steps=True))(_toy_class())
    with pytest.raises(ValueError, match=r"^parallel.shard=2 with algorithm=toy: valid with parallel.shard: "
                       r"decentralized, diloco, localsgd$"):
        check_config({"algorithm": "toy", "parallel": {"shard": 2}})


@pytest.mark.skipif(not reconfigure.supported(), reason="fault_tolerance=live is refused on this torch before this")
def test_an_algorithm_without_live_is_refused_live_naming_those_with_it(clean_registries: None) -> None:
    register("toy", traits=AlgorithmTraits(schema=_ToyConfig, gossips=True, local_steps=True))(_toy_class())
    with pytest.raises(ValueError, match=r"^fault_tolerance=live with algorithm=toy: .*; use algorithm="
                       r"decentralized, diloco, localsgd$"):
        check_config({"algorithm": "toy", "fault_tolerance": {"name": "live"}})
