"""``parallel.mixed_precision`` (FSDP2's ``MixedPrecisionPolicy`` in ``algorithms/sharded.py``, ``shard_model``): the
sharded gossip of issue 30 with bf16 all-gathers, against a replay written here from the policy's documented meaning.

The oracle (``_replay``), one process, no FSDP2: R whole fp32 replicas, all from replica 0's initial parameters, one
``torch.optim.AdamW`` each. At step s, replica r, each of its K ranks k on its own micro-batch:

    g_k = ∇ of its loss at the parameters cast to param_dtype (a bf16 copy of each, the input cast to bf16 too: the
          policy's ``cast_forward_inputs``), in param_dtype
    g_r = (Σ_k g_k in reduce_dtype) / K, cast to fp32          (the reduce-scatter; K = 2 here)
    x_r <- Σ_q W_rq x_q (s >= 1, W the ring's round s − 1), then AdamW's step with g_r   (tests/test_sharded_gossip.py)

A BatchNorm's parameters stay fp32 in the replay (cast to nothing, reduced in fp32): ``shard_model`` keeps each
BatchNorm a unit of its own without the policy (``ConvNet``; the MLP ``Net`` is sharded by the user's own
``fully_shard`` calls with the policy, as the Python API takes it).

With K = 2 and a pair of replicas every sum has two terms and every division is by 2, so the reduction and the mix
round once whatever order the collectives add in, and the forwards run the same kernels on the same shapes: the runs
equalled their replays exactly (0.0) when written. ``TOLERANCE`` = 1e-6 admits a few ulps of fp32 round-off (an
elementwise kernel vectorizing a shard differently from the whole tensor), 360x below the nearest wrong variant.

The wrong variants, kept as parametrized cases that must be more than ``APART`` = 1e-4 away (measured when written):
the run without a policy against the bf16 replay (2.4e-3), the bf16 run against the fp32 replay (2.4e-3: the policy
is really applied), the bf16-reduce run against the fp32-reduction replay (3.6e-4), the ConvNet's bf16 run against
its fp32 replay (4.5e-2).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sklearn.datasets  # noqa: F401 - imported before the workers fork (tests/test_sharded_training.py says why)
import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401
from torch import Tensor, nn
from torch.func import functional_call

from decent_train import build_topology
from decent_train.algorithms.step_gossip import Gossip
from decent_train.config import MIXED_PRECISIONS, MODEL_FILE, check_config
from tests.distributed import WorkerError, run_workers
from tests.jobs import make_cfg, train_on_cpu
from tests.test_sharded_gossip import D_OUT, Net, _batch, _deviation, _optimizer

REPLICAS, SHARD, STEPS = 2, 2, 6
TOLERANCE = 1e-6
APART = 1e-4


class ConvNet(nn.Sequential):
    """A convolution, a BatchNorm, a Linear head (each a unit, as ``shard_units`` cuts the cnn), in fp32."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        super().__init__(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, D_OUT))
        with torch.no_grad():  # BatchNorm starts at ones and zeros: make its init differ by seed too
            self[1].weight.uniform_(0.5, 1.5)
            self[1].bias.uniform_(-0.5, 0.5)


def _fp32_net(kind: str, seed: int) -> nn.Module:
    return Net(seed).float() if kind == "mlp" else ConvNet(seed)


def _fp32_batch(kind: str, rank: int, step: int) -> tuple[Tensor, Tensor]:
    x, y = _batch(rank, step)
    if kind != "mlp":
        g = torch.Generator().manual_seed(7919 * rank + 101 * step)
        x = torch.randn(x.shape[0], 1, 6, 6, generator=g)
    return x.float(), y.float()


def _batch_norms(model: nn.Module) -> set[str]:
    """The names of the parameters of ``model``'s BatchNorms (kept in fp32 under any policy)."""
    return {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for p, _ in m.named_parameters()}


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean()  # bf16 output minus fp32 target: fp32, as in the workers


def _replay(policy: str, kind: str = "mlp") -> list[dict[str, Tensor]]:
    """Each replica's parameters after ``STEPS`` steps of the module's formula under ``policy``
    (``MIXED_PRECISIONS``'s (param_dtype, reduce_dtype)); BatchNorm's parameters stay fp32 throughout."""
    param_dtype, reduce_dtype = MIXED_PRECISIONS[policy]
    compute, reduce = param_dtype or torch.float32, reduce_dtype or param_dtype or torch.float32
    models = [_fp32_net(kind, seed=0) for _ in range(REPLICAS)]
    fp32 = _batch_norms(models[0])
    optimizers = [_optimizer(m.parameters()) for m in models]
    ring = build_topology("ring", REPLICAS)
    for s in range(STEPS):
        for r, model in enumerate(models):
            sums: dict[str, Tensor] = {}
            for k in range(SHARD):
                x, y = _fp32_batch(kind, r * SHARD + k, s)
                cast = {n: p.detach().to(torch.float32 if n in fp32 else compute).requires_grad_()
                        for n, p in model.named_parameters()}
                _loss(functional_call(model, cast, (x.to(compute),)), y).backward()
                for n, p in cast.items():
                    grad = p.grad.float() if n in fp32 else p.grad.to(reduce)
                    sums[n] = grad if n not in sums else sums[n] + grad
            for n, p in model.named_parameters():
                p.grad = (sums[n] / SHARD).float()
        if s >= 1:
            w = ring.mixing_matrix(s - 1).float()
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    mixed = torch.einsum("ij,j...->i...", w, torch.stack(params))
                    for p, new in zip(params, mixed):
                        p.copy_(new)
        for optimizer in optimizers:
            optimizer.step()
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


def _counting(counts: dict[str, list[tuple[torch.dtype, int]]], key: str, fn: Callable[..., Any],
              tensor_of: Callable[..., list[Tensor]]) -> Callable[..., Any]:
    """``fn``, recording the dtype and bytes of what it sends under ``key``."""
    def counted(*args: Any, **kwargs: Any) -> Any:
        for t in tensor_of(*args, **kwargs):
            counts[key].append((t.dtype, t.numel() * t.element_size()))
        return fn(*args, **kwargs)
    return counted


def _sharded(rank: int, world_size: int, policy: str, kind: str) -> dict[str, Any]:
    """One rank: ``shard_model`` with ``policy`` over a (2, 2) mesh, ``Gossip`` over the ring of replicas, AdamW on
    the fp32 shards; what FSDP2 and the front sent (dtypes, bytes), the weights' dtype inside forward, and the full
    parameters at the end."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from decent_train.algorithms.sharded import shard_model
    from decent_train.components.models import shard_units

    counts: dict[str, list[tuple[torch.dtype, int]]] = defaultdict(list)
    # What FSDP2 calls (same arguments): the *_single names from torch 2.13 on, the others before (which lacks the first).
    gather, scatter = (("all_gather_single", "reduce_scatter_single") if hasattr(dist, "all_gather_single")
                       else ("all_gather_into_tensor", "reduce_scatter_tensor"))
    setattr(dist, gather, _counting(counts, "all_gather", getattr(dist, gather), lambda out, inp, **_: [inp]))
    setattr(dist, scatter, _counting(counts, "reduce_scatter", getattr(dist, scatter), lambda **kw: [kw["input"]]))
    dist.batch_isend_irecv = _counting(counts, "gossip", dist.batch_isend_irecv,
                                       lambda ops: [op.tensor for op in ops if op.op is dist.isend])
    mesh = init_device_mesh("cpu", (REPLICAS, SHARD), mesh_dim_names=("replicate", "shard"))
    model = _fp32_net(kind, seed=rank // SHARD)
    param_dtype, reduce_dtype = MIXED_PRECISIONS[policy]
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if kind == "mlp":  # the user's own policy on their own fully_shard calls, as the Python API takes it
        for block in (model.first, model.norm, model.second, model):
            fully_shard(block, mesh=mesh["shard"], mp_policy=mp_policy)
    elif kind == "conv-all-bf16":  # the wrong variant: BatchNorm under the policy too
        for unit in (*shard_units(model), model):
            fully_shard(unit, mesh=mesh["shard"], mp_policy=mp_policy)
    else:  # the package's: BatchNorm a unit of its own, in fp32
        shard_model(model, mesh["shard"], mp_policy)
    in_forward: dict[str, set[torch.dtype]] = defaultdict(set)
    for name, module in model.named_modules():  # pre-hooks run after FSDP2's, which gathers the weights
        if hasattr(module, "weight"):
            module.register_forward_pre_hook(lambda m, args, name=name: in_forward[name].add(m.weight.dtype))
    optimizer = _optimizer(model.parameters())
    with Gossip(model, optimizer, "ring", mesh=mesh, local_world_size=world_size) as front:
        for s in range(STEPS):
            x, y = _fp32_batch(kind, rank, s)
            _loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        payload = {g.flat.dtype for g in front.groups}
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"params": full, "counts": dict(counts), "in_forward": dict(in_forward), "payload": payload,
            "shards": {p.to_local().dtype for p in model.parameters()}}


@functools.cache
def _run(policy: str, kind: str = "mlp") -> list[dict[str, Any]]:
    return run_workers(_sharded, REPLICAS * SHARD, policy, kind)


CASES = [  # (the run's policy, the replay's policy, whether they must agree, the model)
    pytest.param("none", "none", True, "mlp", id="none"),
    pytest.param("bf16", "bf16", True, "mlp", id="bf16"),
    pytest.param("bf16-reduce", "bf16-reduce", True, "mlp", id="bf16-reduce"),
    pytest.param("bf16", "bf16", True, "conv", id="bf16-batchnorm"),
    pytest.param("none", "bf16", False, "mlp", id="wrong-no-policy-vs-bf16"),
    pytest.param("bf16", "none", False, "mlp", id="wrong-bf16-vs-fp32"),
    pytest.param("bf16-reduce", "bf16", False, "mlp", id="wrong-bf16-reduce-vs-fp32-reduction"),
    pytest.param("bf16", "none", False, "conv", id="wrong-batchnorm-bf16-vs-fp32"),
]


@pytest.mark.parametrize("run_policy, replay_policy, agree, kind", CASES)
def test_sharded_run_matches_the_policys_replay(run_policy: str, replay_policy: str, agree: bool, kind: str) -> None:
    """6 AdamW steps over a (2, 2) mesh: every rank's gathered model against its replica's replay (see the module);
    the wrong pairings must be more than ``APART`` away."""
    results, expected = _run(run_policy, kind), _replay(replay_policy, kind)
    deviations = [_deviation(result["params"], expected[rank // SHARD]) for rank, result in enumerate(results)]
    if agree:
        assert max(deviations) <= TOLERANCE, deviations
    else:
        assert min(deviations) > APART, deviations


@pytest.mark.parametrize("policy", ["bf16", "bf16-reduce"])
def test_the_policy_casts_the_forward_and_the_gossip_stays_fp32(policy: str) -> None:
    """Inside forward the gathered weights are bf16; the shards the optimizer steps, the front's payload and every
    message the gossip sends stay fp32 (the master dtype)."""
    for result in _run(policy):
        assert result["in_forward"] == {"first": {torch.bfloat16}, "norm": {torch.bfloat16}, "second": {torch.bfloat16}}
        assert result["shards"] == {torch.float32} and result["payload"] == {torch.float32}
        assert result["counts"]["gossip"] and {d for d, _ in result["counts"]["gossip"]} == {torch.float32}


def test_batchnorm_keeps_fp32_under_the_policy() -> None:
    """``shard_model`` makes each BatchNorm a unit of its own without the policy: inside forward the convolution and
    the head run on bf16 weights, the BatchNorm on fp32 ones (its fp32 statistics beside them). The wrong variant,
    the policy on the BatchNorm too, cannot run: its kernel refuses bf16 weights with fp32 statistics."""
    for result in _run("bf16", "conv"):
        assert result["in_forward"] == {"0": {torch.bfloat16}, "1": {torch.float32}, "4": {torch.bfloat16}}
    with pytest.raises(WorkerError, match="expected scalar type BFloat16 but found Float"):
        run_workers(_sharded, REPLICAS * SHARD, "bf16", "conv-all-bf16")


def test_bf16_halves_the_all_gather_bytes() -> None:
    """Bytes each rank puts into FSDP2's all-gathers and reduce-scatters, counted at the collectives: bf16 halves the
    all-gathers and keeps the reduce-scatters fp32; bf16-reduce halves both; the gossip is the same in all three."""
    def total(policy: str, key: str) -> list[int]:
        return [sum(b for _, b in result["counts"][key]) for result in _run(policy)]

    fp32_gathers, fp32_reductions = total("none", "all_gather"), total("none", "reduce_scatter")
    assert min(fp32_gathers) > 0 and min(fp32_reductions) > 0
    assert [2 * b for b in total("bf16", "all_gather")] == fp32_gathers
    assert total("bf16", "reduce_scatter") == fp32_reductions
    assert [2 * b for b in total("bf16-reduce", "all_gather")] == fp32_gathers
    assert [2 * b for b in total("bf16-reduce", "reduce_scatter")] == fp32_reductions
    assert total("bf16", "gossip") == total("none", "gossip") == total("bf16-reduce", "gossip")


@pytest.mark.parametrize("precision, mixed_precision, want", [
    ("bf16", "auto", (torch.bfloat16, torch.float32)),
    ("fp32", "auto", (None, None)),
    ("bf16", "none", (None, None)),
    ("bf16", "bf16-reduce", (torch.bfloat16, torch.bfloat16)),
])
def test_the_config_names_the_policy(precision: str, mixed_precision: str, want: tuple[Any, Any]) -> None:
    """``parallel.mixed_precision=auto``: bf16 all-gathers with fp32 reductions exactly when autocast runs bf16."""
    from decent_train.algorithms.sharded import mixed_precision_policy

    cfg = check_config({"parallel": {"shard": 2, "mixed_precision": mixed_precision}, "precision": precision,
                        "launch": {"nproc_per_node": 4}})
    policy = mixed_precision_policy(cfg)
    assert (policy.param_dtype, policy.reduce_dtype) == want


def _trained(mixed_precision: str, run_dir: Path) -> dict[str, Tensor]:
    cfg = make_cfg(run_dir, parallel={"shard": 2, "mixed_precision": mixed_precision}, precision="bf16",
                   model={"name": "cnn", "channels": [8, 16]}, launch={"nproc_per_node": 4},
                   topology={"local_world_size": 4}, eval_every=0,
                   logger={"log_every": 2, "wandb": {"mode": "disabled"}})
    run_workers(train_on_cpu, 4, cfg)
    return torch.load(run_dir / MODEL_FILE)


def test_training_under_autocast_equals_autocast_alone(tmp_path: Path) -> None:
    """The trainer's run (the cnn with its BatchNorms, precision=bf16, 4 workers, K = 2, 6 steps) with the policy
    (``auto``) equals the same run without one (``none``, autocast alone, the path tests/test_sharded_training.py
    checks) exactly: autocast casts every convolution's and linear's weight to bf16 as the policy does, and computes
    their gradients in bf16 before the fp32 reduction; BatchNorm is fp32 in both. The wrong variant, bf16-reduce,
    deviates (6.8e-3 when written). Models with a norm that autocast runs in fp32 (GPT-2's LayerNorm on CUDA) are
    not equal: the policy rounds its weights to bf16 first."""
    auto, none = _trained("auto", tmp_path / "auto"), _trained("none", tmp_path / "none")
    assert auto.keys() == none.keys()
    assert all(torch.equal(auto[k], none[k]) for k in auto)
    wrong = _trained("bf16-reduce", tmp_path / "bf16-reduce")
    assert max((wrong[k] - none[k]).abs().max().item() for k in none if none[k].is_floating_point()) > APART
