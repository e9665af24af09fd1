"""``message_size_in_mb`` (``message_size_mb``) splits an outer step's pair messages as it splits the engine's: a
rate-limited link keeps up with small messages. Splitting changes nothing computed: every worker still equals the
float64 replay of tests/test_local_steps.py; a size that needs more messages than there are tags is one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from decent_train import DiLoCo, LocalSGD
from tests.distributed import run_workers
from tests.replay import loss_fn, make_model
from tests.test_local_steps import INNER_STEPS, SYNC_EVERY, TOLERANCE, _deviation, _inner, _outer, _params, _replay

MESSAGE_MB = 0.0002  # ~200 bytes: the test model's payload goes in several messages


def train(rank: int, world_size: int, local_sgd: bool, message_mb: float) -> dict[str, Any]:
    model = make_model(seed=rank)
    inner = _inner(model.parameters())
    kwargs: dict[str, Any] = {"sync_every": SYNC_EVERY, "topology": "ring", "message_size_in_mb": message_mb}
    front = LocalSGD(model, inner, **kwargs) if local_sgd else DiLoCo(model, inner, _outer(model.parameters()), **kwargs)
    pieces = max(len(front.exchange.exchanger.pieces(torch.empty(g.numel * (1 if local_sgd else 2),
                                                                 dtype=g.params[0].dtype))) for g in front.groups)
    with front:
        for step in range(INNER_STEPS):
            loss_fn(model, rank, step).backward()
            inner.step()
            inner.zero_grad()
    return {"params": _params(model), "pieces": pieces}


@pytest.mark.parametrize("local_sgd", [False, True], ids=["diloco", "localsgd"])
def test_split_messages_match_the_replay(local_sgd: bool) -> None:
    results = run_workers(train, 4, local_sgd, MESSAGE_MB)
    assert results[0]["pieces"] > 1
    deviation = _deviation([r["params"] for r in results], _replay(4, "ring", SYNC_EVERY, local_sgd))
    assert deviation <= TOLERANCE


def test_too_many_messages_are_one_line() -> None:
    def build(rank: int, world_size: int) -> None:
        model = torch.nn.Linear(300, 300)  # 90,300 elements: one each is more messages than tags
        LocalSGD(model, _inner(model.parameters()), sync_every=2, topology="ring", message_size_in_mb=1e-9)

    with pytest.raises(Exception, match=r"message_size_in_mb=1e-09 splits an outer step's payload into \d+ messages"):
        run_workers(build, 2)
