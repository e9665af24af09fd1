"""``model.pt``, the trained model a run leaves: written here by rank 0 at the end of training, read back here by
``decent_train.load_model(run_dir)``, so the file's format is decided in one place.

``model.pt`` is the bare model's ``state_dict`` (loadable without decent-train); rebuilding the model it fits needs
the run's config (``resolved_config.yaml``) and the data's sample shape and class count, which ``result.json`` records
(:func:`model_shape`) so that loading never reads the dataset, which may be gone or elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from decent_train.components.checks import as_written
from decent_train.components.models import build_model
from decent_train.config import MODEL_FILE, RESOLVED_CONFIG, RESULT_FILE, TrainConfig, check_config

INPUT_SHAPE = "model/input_shape"  # result.json: one sample's shape, without the batch dimension
OUTPUTS = "model/outputs"  # result.json: classes, or the vocabulary size of a language model
Read = TypeVar("Read")


class TrainedModel(NamedTuple):
    """What :func:`load_model` returns: ``model, config = load_model(run_dir)``."""

    model: nn.Module  # the run's final model (the workers' average unless final_average=false), on the CPU, eval mode
    config: TrainConfig  # the run's resolved config, checked as the workers checked it


def model_shape(input_shape: tuple[int, ...], outputs: int) -> dict[str, Any]:
    """``result.json``'s entries that :func:`load_model` rebuilds the model from, besides the config."""
    return {INPUT_SHAPE: list(input_shape), OUTPUTS: outputs}


def save_model(run_dir: Path, state: dict[str, Tensor]) -> None:
    """Write ``model.pt``: the bare model's ``state_dict`` (on the CPU)."""
    torch.save(state, run_dir / MODEL_FILE)


def load_model(run_dir: str | Path) -> TrainedModel:
    """The trained model of the run in ``run_dir`` (a directory ``decent-train`` wrote), and its resolved config.

    Raises ``FileNotFoundError`` for a missing directory or file and ``ValueError`` for one that cannot be read or does
    not fit the model the config builds; each names the path.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; expected a run directory decent-train wrote "
                                f"(holding {MODEL_FILE}, {RESOLVED_CONFIG} and {RESULT_FILE})")
    paths = {name: run_dir / name for name in (MODEL_FILE, RESOLVED_CONFIG, RESULT_FILE)}
    for name, path in paths.items():
        if not path.is_file():
            why = " (the run ends by writing it: did it finish?)" if name != RESOLVED_CONFIG else ""
            raise FileNotFoundError(f"{path} does not exist{why}; {run_dir} is not a finished run's directory")
    config = _read(paths[RESOLVED_CONFIG], _written_config)
    result = _read(paths[RESULT_FILE], lambda p: json.loads(p.read_text()))
    if INPUT_SHAPE not in result or OUTPUTS not in result:
        raise ValueError(f"{paths[RESULT_FILE]} has no {INPUT_SHAPE} and {OUTPUTS} (a run written before "
                         "decent_train.load_model existed): build the model with "
                         "decent_train.components.models.build_model(config.model, input_shape, classes)")
    state = _read(paths[MODEL_FILE], lambda p: torch.load(p, map_location="cpu", weights_only=True))
    model = build_model(config.model, tuple(result[INPUT_SHAPE]), int(result[OUTPUTS]))
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as error:
        problem = str(error).strip().splitlines()
        raise ValueError(f"{paths[MODEL_FILE]} does not fit model={config.model.name} as {paths[RESOLVED_CONFIG]} "
                         f"builds it: {' '.join(line.strip() for line in problem[:3])}") from None
    return TrainedModel(model.eval(), config)


def _written_config(path: Path) -> TrainConfig:
    """The run's resolved config, checked as the run it was: an option it ignored, refused since, still loads."""
    with as_written():
        return check_config(OmegaConf.load(path))


def _read(path: Path, read: Callable[[Path], Read]) -> Read:
    """``read(path)``; any failure (a truncated or foreign file) as one ``ValueError`` naming the path."""
    try:
        return read(path)
    except Exception as error:  # noqa: BLE001 - torch.load, YAML, JSON and the config's checks each raise their own
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{path} cannot be read: {first}") from None
