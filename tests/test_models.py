"""ResNet-18/50 and the GPT-2-style decoder: sizes against published and by-hand counts, shapes against the
architecture, causality by perturbation, and decentralized training of the tied-embedding GPT against the float64
replay of tests/replay.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

from decent_train.components.models import GPT, ModelConfig, build_model
from tests.distributed import run_workers
from tests.replay import max_deviation, replay, topology_for, train_engine


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied Parameter once


# -- ResNet ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, published", [("resnet18", 11_689_512), ("resnet50", 25_557_032)])
def test_resnet_has_torchvisions_published_size(name: str, published: int) -> None:
    with torch.device("meta"):  # sizes only: skip the init
        model = build_model(ModelConfig(name=name), (3, 224, 224), 1000)
    assert n_params(model) == published


def test_resnet18_default_stem_is_torchvisions_model() -> None:
    """Same seed, same values: nothing but the head size is changed for 3-channel inputs."""
    torch.manual_seed(0)
    ours = build_model(ModelConfig(name="resnet18"), (3, 64, 64), 10)
    torch.manual_seed(0)
    theirs = torchvision.models.resnet18(weights=None, num_classes=10)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _spatial_size_after_stem(model: nn.Module, x: Tensor) -> tuple[int, int]:
    seen = []
    handle = model.layer1.register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape[-2:])))
    model.eval()(x)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_small_stem_keeps_cifar_resolution(name: str) -> None:
    x = torch.randn(2, 3, 32, 32)
    small = build_model(ModelConfig(name=name, small_stem=True), (3, 32, 32), 10)
    default = build_model(ModelConfig(name=name), (3, 32, 32), 10)
    assert small(x).shape == (2, 10)
    assert _spatial_size_after_stem(small, x) == (32, 32)  # 3x3/stride-1 conv, no max-pool
    assert _spatial_size_after_stem(default, x) == (8, 8)  # 7x7/stride-2 conv, then 3x3/stride-2 max-pool
    # Only the stem's kernel shrinks: 64 * 3 * (7*7 - 3*3) weights fewer than torchvision's model.
    assert n_params(default) - n_params(small) == 64 * 3 * (49 - 9)
    assert n_params(default) == n_params(torchvision.models.get_model(name, weights=None, num_classes=10))


@pytest.mark.parametrize("small_stem", [False, True])
def test_resnet_takes_one_channel_images(small_stem: bool) -> None:
    model = build_model(ModelConfig(name="resnet18", small_stem=small_stem), (1, 28, 28), 10)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    kernel = 9 if small_stem else 49
    reference = torchvision.models.resnet18(weights=None, num_classes=10)
    assert n_params(model) == n_params(reference) - 64 * (3 * 49 - 1 * kernel)  # the stem reads 1 channel, not 3


# -- GPT ------------------------------------------------------------------------------------------------------------


def gpt_size_by_hand(layers: int, heads: int, width: int, vocab: int, context: int, bias: bool) -> int:
    """Embeddings (the LM head reuses wte), per block two LayerNorms, qkv, attention out, MLP in/out; final LN."""
    b = int(bias)
    layer_norm = width + b * width
    block = (
        2 * layer_norm
        + width * 3 * width + b * 3 * width  # qkv
        + width * width + b * width  # attention output projection
        + width * 4 * width + b * 4 * width  # MLP in
        + 4 * width * width + b * width  # MLP out
    )
    return vocab * width + context * width + layers * block + layer_norm


def tiny_gpt_config(**overrides: object) -> ModelConfig:
    return ModelConfig(**{"name": "gpt2", "layers": 2, "heads": 2, "width": 16, "dropout": 0.0, **overrides})


@pytest.mark.parametrize(
    "layers, heads, width, vocab, context, bias",
    [(2, 2, 16, 11, 8, False), (3, 4, 32, 50, 20, True), (1, 1, 8, 5, 3, True)],
)
def test_gpt_size_matches_count_by_hand(
    layers: int, heads: int, width: int, vocab: int, context: int, bias: bool
) -> None:
    cfg = ModelConfig(name="gpt2", layers=layers, heads=heads, width=width, bias=bias)
    model = build_model(cfg, (context,), vocab)
    assert isinstance(model, GPT)
    assert n_params(model) == gpt_size_by_hand(layers, heads, width, vocab, context, bias)


def test_gpt2_small_has_the_published_size() -> None:
    """GPT-2 small (biases, 50257 tokens, 1024 context): 124,439,808 parameters with the tied head."""
    with torch.device("meta"):
        model = build_model(ModelConfig(name="gpt2", bias=True), (1024,), 50257)
    assert n_params(model) == 124_439_808


def test_gpt_head_is_tied_to_the_token_embedding() -> None:
    model = build_model(tiny_gpt_config(), (8,), 11)
    assert model.lm_head.weight is model.wte.weight
    assert [name for name, _ in model.named_parameters()].count("wte.weight") == 1
    assert "lm_head.weight" not in dict(model.named_parameters())
    # Both uses feed one gradient: the head's gradient (logits = h @ wte^T) plus the embedding lookup's.
    idx = torch.randint(11, (3, 8), generator=torch.Generator().manual_seed(0))
    model(idx).sum().backward()
    assert model.wte.weight.grad is not None and model.lm_head.weight.grad is model.wte.weight.grad


def test_gpt_init_follows_gpt2() -> None:
    layers = 4
    model = build_model(tiny_gpt_config(layers=layers, heads=4, width=128, bias=True), (64,), 300)
    residual = {f"blocks.{i}.{p}.weight" for i in range(layers) for p in ("attn.proj", "proj")}
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "ln" in name:
            assert torch.all(p == 1), name
        else:
            want = 0.02 / math.sqrt(2 * layers) if name in residual else 0.02
            assert abs(p.mean().item()) < 0.1 * want and abs(p.std().item() / want - 1) < 0.05, name


def gpt_forward_by_the_equations(model: GPT, idx: Tensor, heads: int) -> Tensor:
    """GPT-2's forward written out from its parameters: explicit masked softmax attention, no module calls."""
    p = dict(model.named_parameters())

    def ln(x: Tensor, name: str) -> Tensor:
        return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p.get(f"{name}.bias"))

    def lin(x: Tensor, name: str) -> Tensor:
        y = x @ p[f"{name}.weight"].T
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    b, t = idx.shape
    x = p["wte.weight"][idx] + p["wpe.weight"][:t]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    for i in range(len(model.blocks)):
        q, k, v = lin(ln(x, f"blocks.{i}.ln_1"), f"blocks.{i}.attn.qkv").chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(future, float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + lin(attended, f"blocks.{i}.attn.proj")
        x = x + lin(F.gelu(lin(ln(x, f"blocks.{i}.ln_2"), f"blocks.{i}.fc")), f"blocks.{i}.proj")
    return ln(x, "ln_f") @ p["wte.weight"].T


@pytest.mark.parametrize("bias", [False, True])
def test_gpt_forward_matches_the_equations(bias: bool) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_gpt_config(heads=4, width=32, bias=bias, dropout=0.3), (8,), 11).double().eval()
    with torch.no_grad():  # non-zero biases and LayerNorm affine, so that they are exercised
        for name, param in model.named_parameters():
            if ".bias" in name or "ln" in name:
                param.add_(torch.randn_like(param) * 0.1)
    idx = torch.randint(11, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), gpt_forward_by_the_equations(model, idx, heads=4), rtol=0, atol=1e-12)


def test_gpt_is_causal_and_accepts_shorter_sequences() -> None:
    vocab, context = 11, 8
    torch.manual_seed(0)
    model = build_model(tiny_gpt_config(), (context,), vocab).double().eval()
    idx = torch.randint(vocab, (2, context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(idx)
        assert base.shape == (2, context, vocab)
        for t in range(context - 1):
            changed = idx.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % vocab
            out = model(changed)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-12)
            later = (out[:, t + 1 :] - base[:, t + 1 :]).abs().amax(dim=-1)  # (batch, positions after t)
            assert bool((later > 1e-6).all()), f"token {t + 1} does not reach some later position"
        torch.testing.assert_close(model(idx[:, :5]), base[:, :5], rtol=0, atol=1e-12)  # a prefix: same logits


def test_gpt_rejects_sequences_longer_than_the_context() -> None:
    model = build_model(tiny_gpt_config(), (8,), 11)
    with pytest.raises(ValueError, match="9 tokens.*context of 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


# -- bad configurations ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="vgg16"), "model.name='vgg16'.*resnet18.*gpt2"),
        (dict(name="gpt2", width=100, heads=12), "model.heads=12, model.width=100.*divisible"),
        (dict(name="gpt2", layers=0), "model.layers=0"),
        (dict(name="gpt2", heads=-2, width=8), "model.heads=-2"),
        (dict(name="gpt2", dropout=1.0), r"model.dropout=1.0"),
    ],
)
def test_bad_config_names_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg, shape, message",
    [
        (tiny_gpt_config(), (3, 32, 32), r"gpt2 needs token inputs.*dataset=tokens.*\(3, 32, 32\)"),
        (ModelConfig(name="resnet18"), (784,), r"resnet18 needs image inputs.*\(784,\)"),
        (ModelConfig(name="resnet50"), (1, 28), r"resnet50 needs image inputs.*\(1, 28\)"),
    ],
)
def test_model_rejects_the_wrong_kind_of_input(cfg: ModelConfig, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(cfg, shape, 10)


# -- the engine with tied embeddings --------------------------------------------------------------------------------

VOCAB, CONTEXT, STEPS, TOL = 11, 8, 6, 1e-10


def tied_gpt(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(tiny_gpt_config(), (CONTEXT,), VOCAB).double()


def untied_gpt(seed: int) -> nn.Module:
    """The same initial values, but the head a separate copy of wte: what an engine that broke the tie would train."""
    model = tied_gpt(seed)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


def lm_loss(model: nn.Module, rank: int, step: int, micro: int = 0) -> Tensor:
    """Next-token cross-entropy on a token batch fixed by (rank, step, micro)."""
    g = torch.Generator().manual_seed(10007 * rank + 101 * step + micro)
    tokens = torch.randint(VOCAB, (4, CONTEXT + 1), generator=g)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train_tied(rank: int, world_size: int, topology: str) -> dict:
    """train_engine on the tied GPT, plus what became of the tie on this worker."""
    built: list[nn.Module] = []
    result = train_engine(
        rank, world_size, topology, STEPS, model_fn=lambda seed: built.append(tied_gpt(seed)) or built[-1], loss=lm_loss
    )
    model = built[0]
    result["tied"] = model.lm_head.weight is model.wte.weight
    result["lm_head"] = model.lm_head.weight.detach().clone()
    return result


@pytest.mark.parametrize("topology", ["ring", "complete"])
def test_engine_trains_tied_gpt_like_the_replay(topology: str) -> None:
    engine = run_workers(train_tied, 4, topology=topology)
    assert all(r["step"] == STEPS for r in engine)
    assert len(engine[0]["buckets"]) >= 3, "the test model must span several buckets"
    assert sum(name == "wte.weight" for bucket in engine[0]["buckets"] for name in bucket) == 1
    expected = replay(topology_for(topology, 4), STEPS, model_fn=tied_gpt, loss=lm_loss)
    assert max_deviation(engine, expected) <= TOL
    for r, want in zip(engine, expected):
        assert r["tied"]
        assert (r["lm_head"] - want["wte.weight"]).abs().max().item() <= TOL  # the head holds the trained values
    # The workers must not have reached consensus, or the per-worker check would be weak.
    spread = max((engine[0]["params"][k] - r["params"][k]).abs().max().item() for r in engine for k in expected[0])
    assert spread > 1e-4

    # The oracle can tell a broken tie apart: untied, wte and the head each get only one use's gradient.
    untied = replay(topology_for(topology, 4), STEPS, model_fn=untied_gpt, loss=lm_loss)
    gap = max((r["params"][k] - u[k]).abs().max().item() for r, u in zip(engine, untied) for k in r["params"])
    assert gap > 1e3 * TOL
