"""``decent_train.load_model(run_dir)`` (issue 40, point 6): the trained model and the run's config back in one line.

Each model config under conf/model/ round-trips through the writer the trainer uses (``save_model``) with weights
that are not the fresh initialization (a loader that forgot to load would still build an equal model otherwise); one
real run, trained in forked workers, gives back a model whose accuracy is the one the run reported. Bad run
directories are one error naming the path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

import decent_train
from decent_train.components.data import build_datasets
from decent_train.components.models import build_model
from decent_train.config import MODEL_FILE, RESOLVED_CONFIG, RESULT_FILE, TrainConfig, check_config
from decent_train.launcher.job import shipped_dir
from decent_train.training.saved_model import TrainedModel, model_shape, save_model

from .distributed import run_workers
from .jobs import make_cfg, train_on_cpu

# Each model small, on data of the shape it takes: (model, dataset, one sample's shape, outputs).
SMALL: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[int, ...], int]] = {
    "cnn": ({"channels": [4, 8], "dropout": 0.1}, {"name": "synthetic", "input_shape": [1, 8, 8], "num_classes": 3},
            (1, 8, 8), 3),
    "mlp": ({"hidden_sizes": [8, 6]}, {"name": "synthetic", "input_shape": [5], "num_classes": 4}, (5,), 4),
    "resnet18": ({"small_stem": True}, {"name": "synthetic", "input_shape": [3, 16, 16], "num_classes": 5},
                 (3, 16, 16), 5),
    "resnet50": ({}, {"name": "synthetic", "input_shape": [3, 32, 32], "num_classes": 2}, (3, 32, 32), 2),
    "gpt2": ({"layers": 1, "heads": 2, "width": 16, "bias": True},
             {"name": "tokens", "root": "/nonexistent", "context_length": 8, "vocab_size": 32}, (8,), 32),
}


def test_every_model_config_is_covered() -> None:
    assert sorted(SMALL) == sorted(p.stem for p in (Path(shipped_dir("conf")) / "model").glob("*.yaml"))


def _write_run(run_dir: Path, cfg: TrainConfig, state: dict[str, torch.Tensor], shape: tuple[int, ...],
               outputs: int) -> None:
    """A finished run's files as the launcher (the resolved config) and rank 0 (model.pt, result.json) write them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / RESOLVED_CONFIG)
    save_model(run_dir, state)
    (run_dir / RESULT_FILE).write_text(json.dumps({"eval/accuracy": 0.5, **model_shape(shape, outputs)}))


def _trained(name: str) -> tuple[TrainConfig, torch.nn.Module, tuple[int, ...], int]:
    """The model ``name`` with every floating tensor moved off its initialization and counters set, in eval mode."""
    model_cfg, dataset_cfg, shape, outputs = SMALL[name]
    cfg = check_config({"model": {"name": name, **model_cfg}, "dataset": dataset_cfg})
    model = build_model(cfg.model, shape, outputs)
    generator = torch.Generator().manual_seed(11)
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if key in parameters:  # scaled, so that 50 layers of ResNet-50 stay finite
                tensor.mul_(1 + 0.05 * noise).add_(1e-4 * noise)
            elif tensor.is_floating_point():  # batch norm's running mean and variance (kept positive)
                tensor.add_(0.01 * noise.abs())
            else:
                tensor.fill_(7)  # batch norm's num_batches_tracked
    return cfg, model.eval(), shape, outputs


def _input(name: str, shape: tuple[int, ...], outputs: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    if name == "gpt2":
        return torch.randint(outputs, (2, *shape), generator=generator)
    return torch.randn(2, *shape, generator=generator)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_each_model_round_trips(name: str, tmp_path: Path) -> None:
    cfg, model, shape, outputs = _trained(name)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _write_run(tmp_path, cfg, model.state_dict(), shape, outputs)

    loaded = decent_train.load_model(tmp_path)

    assert isinstance(loaded, TrainedModel) and loaded.config == cfg
    state = loaded.model.state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    assert not loaded.model.training  # dropout off: the outputs below are deterministic
    x = _input(name, shape, outputs)
    with torch.no_grad():
        expected = model(x)
        assert expected.isfinite().all() and torch.equal(loaded.model(x), expected)


def test_a_trained_run_gives_back_the_model_it_evaluated(tmp_path: Path) -> None:
    """Trained by ``train`` in two forked workers (rank 0 writes model.pt and result.json as in every run): the loaded
    model's accuracy on the digits' test set is the accuracy the run reported for its averaged model."""
    cfg = make_cfg(tmp_path)
    OmegaConf.save(OmegaConf.structured(cfg), tmp_path / RESOLVED_CONFIG)  # the launcher writes it
    run_workers(train_on_cpu, 2, cfg)
    result = json.loads((tmp_path / RESULT_FILE).read_text())

    model, config = decent_train.load_model(tmp_path)

    x, y = build_datasets(config.dataset).test.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).double().mean().item()
    assert accuracy == pytest.approx(result["eval/accuracy"], abs=1e-12)


def _break(run_dir: Path, how: str) -> Path:
    """A run directory broken in one way; the path the error must name."""
    cfg, model, shape, outputs = _trained("mlp")
    _write_run(run_dir, cfg, model.state_dict(), shape, outputs)
    if how == "no directory":
        return run_dir / "missing"
    if how == "no model.pt":
        (run_dir / MODEL_FILE).unlink()
        return run_dir / MODEL_FILE
    if how == "truncated model.pt":
        data = (run_dir / MODEL_FILE).read_bytes()
        (run_dir / MODEL_FILE).write_bytes(data[: len(data) // 2])
        return run_dir / MODEL_FILE
    if how == "another model's model.pt":
        other_cfg, other, _, _ = _trained("cnn")
        save_model(run_dir, other.state_dict())
        return run_dir / MODEL_FILE
    if how == "result.json without the shape":
        (run_dir / RESULT_FILE).write_text(json.dumps({"eval/accuracy": 0.5}))
        return run_dir / RESULT_FILE
    (run_dir / RESOLVED_CONFIG).write_text("model: {name: nonsense}\n")
    return run_dir / RESOLVED_CONFIG


@pytest.mark.parametrize(("how", "error", "says"), [
    ("no directory", FileNotFoundError, "is not a directory; expected a run directory decent-train wrote"),
    ("no model.pt", FileNotFoundError, "does not exist (the run ends by writing it: did it finish?)"),
    ("truncated model.pt", ValueError, "cannot be read: "),
    ("another model's model.pt", ValueError, "does not fit model=mlp as"),
    ("result.json without the shape", ValueError, "has no model/input_shape and model/outputs"),
    ("a config that is not one", ValueError, "cannot be read: "),
])
def test_a_bad_run_directory_is_one_error_naming_the_path(how: str, error: type, says: str, tmp_path: Path) -> None:
    path = _break(tmp_path, how)
    with pytest.raises(error) as raised:
        decent_train.load_model(path if how == "no directory" else tmp_path)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(str(path)) and says in message, message
