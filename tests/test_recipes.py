"""The recipes: each composes to the settings it promises (the paper's, from the issue that asked for them), its
all-reduce twin differs only where it should, and each one trains a few steps on tiny generated data in the real
format, with the model shrunk for the test."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from decent_train import topology_names
import decent_train.launcher.job  # noqa: F401 - registers the config schema Hydra composes against
from decent_train.config import MODEL_FILE, RESULT_FILE, check_config
from decent_train.launcher.preflight import preflight

from .datafiles import write_cifar, write_image_folder, write_token_files
from .distributed import run_workers
from .jobs import COMMAND, train_on_cpu

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
WORLD = 2


def compose_recipe(name: str, overrides: list[str] = ()) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base=None):
        cfg = compose(config_name=name, overrides=[f"hydra.searchpath=[file://{ROOT / 'conf'}]", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def has(config: dict[str, Any], expected: dict[str, Any]) -> bool:
    return {k: config.get(k) for k in expected} == expected


def test_recipes_exist() -> None:
    assert set(RECIPES) >= {
        "resnet50_imagenet", "resnet50_imagenet_allreduce", "gpt2_owt", "gpt2_owt_allreduce",
        "resnet18_cifar10", "cpu_demo", "topology_sweep", "cpu_phases", "phases_sweep", "topology_study",
    }


def test_resnet50_imagenet_is_the_papers_setup() -> None:
    cfg = compose_recipe("resnet50_imagenet")
    assert (cfg["algorithm"]["name"], cfg["topology"]["name"], cfg["model"]["name"]) == ("decentralized", "alternating-exp-ring", "resnet50")
    assert cfg["dataset"]["name"] == "imagefolder" and cfg["model"]["small_stem"] is False
    assert has(cfg["optim"], {"name": "accum_adam", "lr": 1.5e-3, "accum_iter": 8, "weight_decay": 2.0**-15})
    assert (cfg["global_batch_size"], cfg["epochs"], cfg["label_smoothing"]) == (1024, 90, 0.1)
    assert cfg["scheduler"]["name"] == "cosine" and cfg["scheduler"]["warmup_epochs"] == 5
    assert cfg["precision"] in ("fp16", "bf16") and cfg["channels_last"] is True


def test_gpt2_owt_is_the_papers_setup() -> None:
    cfg = compose_recipe("gpt2_owt")
    assert (cfg["algorithm"]["name"], cfg["topology"]["name"]) == ("decentralized", "alternating-exp-ring")
    assert {k: cfg["model"][k] for k in ("name", "layers", "heads", "width")} == {"name": "gpt2", "layers": 12, "heads": 12, "width": 768}
    assert cfg["dataset"]["name"] == "tokens" and cfg["dataset"]["context_length"] == 1024
    optim = cfg["optim"]
    assert (optim["name"], optim["lr"], optim["beta1"], optim["beta2"], optim["weight_decay"], optim["accum_iter"]) == (
        "accum_adamw", 6e-4, 0.9, 0.98, 0.1, 8
    )
    assert cfg["scheduler"]["name"] == "cosine" and cfg["scheduler"]["warmup_steps"] == 2000
    assert cfg["grad_clip_norm"] == 1.0


@pytest.mark.parametrize(
    "recipe, optim",
    [
        ("resnet50_imagenet", {"name": "adam", "lr": 1e-3}),
        ("gpt2_owt", {"name": "adamw", "beta1": 0.9, "beta2": 0.95}),
    ],
)
def test_allreduce_twin_differs_only_in_algorithm_optimizer_and_topology(recipe: str, optim: dict[str, Any]) -> None:
    """The twin's topology is the default: all-reduce reads none, and refuses one set (the base's)."""
    base, twin = compose_recipe(recipe), compose_recipe(f"{recipe}_allreduce")
    assert twin["algorithm"] == {"name": "allreduce"} and has(twin["optim"], optim)
    assert twin["optim"]["weight_decay"] == base["optim"]["weight_decay"]
    assert twin["topology"] == {**base["topology"], "name": "ring"} and base["topology"]["name"] != "ring"
    assert {k: v for k, v in twin.items() if k not in ("algorithm", "optim", "topology")} == {
        k: v for k, v in base.items() if k not in ("algorithm", "optim", "topology")
    }


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    write_cifar(root / "cifar", "cifar10")
    write_image_folder(root / "imagenet")
    write_token_files(root / "owt", n_train=2048, n_val=300, vocab=64)
    return {"cifar": root / "cifar", "imagenet": root / "imagenet", "owt": root / "owt"}


def data_overrides(name: str, data: dict[str, Path]) -> list[str]:
    prefix = name.split("_")[0]
    return {"resnet18": [f"dataset.root={data['cifar']}"], "resnet50": [f"dataset.root={data['imagenet']}"],
            "gpt2": [f"dataset.root={data['owt']}", "dataset.context_length=16"]}.get(prefix, [])


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_passes_the_launchers_checks_on_8_workers(name: str, data_dirs: dict[str, Path]) -> None:
    cfg = check_config(compose_recipe(name, ["launch=cpu", "launch.nproc_per_node=8", *data_overrides(name, data_dirs)]))
    preflight(cfg)
    if cfg.global_batch_size:
        assert cfg.batch_size_per_worker(8) * 8 * cfg.accum_steps == cfg.global_batch_size


def tiny_overrides(name: str, data: dict[str, Path]) -> list[str]:
    """A few steps on 2 CPU workers, with the big models shrunk and the recipe's own settings otherwise kept."""
    common = ["launch=cpu", f"launch.nproc_per_node={WORLD}", "steps=2", "eval_batch_size=8", "logger.progress_bar=false",
              "logger.log_every=1", "compile=false"]
    common += data_overrides(name, data)
    if name.startswith("resnet18"):
        return common + ["global_batch_size=8"]
    if name.startswith("resnet50"):
        return common + ["dataset.image_size=32", "dataset.loader_workers=0", "global_batch_size=4"]
    if name.startswith("gpt2"):
        return common + ["dataset.vocab_size=64", "model.layers=2", "model.heads=2",
                         "model.width=32", "global_batch_size=4", "scheduler.warmup_steps=1"]  # 2000: past 2 steps
    if name in ("cpu_phases", "phases_sweep"):
        return common + ["phases.0.steps=1"]  # both phases run: 1 all-reduce step, then gossip
    return common


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_a_few_steps(name: str, data_dirs: dict[str, Path], tmp_path: Path) -> None:
    cfg = compose_recipe(name, tiny_overrides(name, data_dirs))
    cfg["run"]["output_dir"] = str(tmp_path)
    train_cfg = check_config(cfg)
    results = run_workers(train_on_cpu, WORLD, train_cfg, timeout=240)
    assert all(r["steps"] == 2 for r in results)
    result = json.loads((tmp_path / RESULT_FILE).read_text())
    assert math.isfinite(result["train/loss"]) and math.isfinite(result["eval/loss"]) and 0 <= result["eval/accuracy"] <= 1
    state = torch.load(tmp_path / MODEL_FILE, weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    if name.startswith("gpt2"):  # the tie survives into the saved model
        assert torch.equal(state["wte.weight"], state["lm_head.weight"])


@pytest.mark.slow
def test_recipe_runs_from_the_command_line(data_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The documented short form, ``decent-train -cn NAME``, from a directory that is not the checkout."""
    overrides = tiny_overrides("resnet18_cifar10", data_dirs) + [f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([str(COMMAND), "-cn", "resnet18_cifar10", *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    resolved = OmegaConf.load(tmp_path / "run" / "resolved_config.yaml")
    assert resolved.model.name == "resnet18" and resolved.model.small_stem and resolved.precision == "bf16"
    assert json.loads((tmp_path / "run" / RESULT_FILE).read_text())["steps"] == 2


def dry_sweep(recipe: str, tmp_path: Path) -> list[Path]:
    """``decent-train -m -cn RECIPE dry_run=true``: each job's resolved config, in job order (fewer than 10 jobs)."""
    proc = subprocess.run(
        [str(COMMAND), "-m", "-cn", recipe, "dry_run=true", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return sorted((tmp_path / "sweep").glob("*/resolved_config.yaml"))


@pytest.mark.slow
def test_topology_sweep_runs_one_job_per_topology(tmp_path: Path) -> None:
    jobs = dry_sweep("topology_sweep", tmp_path)
    builtin = {"complete", "ring", "one-peer-exp", "alternating-exp-ring"}
    assert builtin <= set(topology_names())
    assert {OmegaConf.load(j).topology.name for j in jobs} == builtin and len(jobs) == len(builtin)


@pytest.mark.slow
def test_topology_study_runs_each_variant_with_three_seeds(tmp_path: Path) -> None:
    jobs = [check_config(OmegaConf.load(j)) for j in dry_sweep("topology_study", tmp_path)]
    runs = sorted((c.topology.name, c.global_avg_every, c.seed) for c in jobs)
    variants = [("complete", 0), ("one-peer-exp", 0), ("ring", 0), ("ring", 4)]
    assert runs == sorted((name, every, seed) for name, every in variants for seed in (0, 1, 2))
    assert all((c.dataset.partition, c.dataset.alpha, c.launch.world_size) == ("dirichlet", 0.1, 8) for c in jobs)


def test_cpu_phases_warms_up_with_allreduce_then_gossips() -> None:
    cfg = check_config(compose_recipe("cpu_phases"))
    assert cfg.phase_starts() == [(0, "allreduce"), (60, "ring")]
    assert (cfg.global_avg_every, cfg.final_average) == (100, True)


@pytest.mark.slow
def test_phases_sweep_compares_three_schedules(tmp_path: Path) -> None:
    jobs = dry_sweep("phases_sweep", tmp_path)
    plans = [[(p.algorithm, p.topology, p.steps) for p in OmegaConf.load(j).phases] for j in jobs]
    assert plans == [
        [("allreduce", None, 60), ("decentralized", "ring", None)],
        [("decentralized", "ring", None)],
        [("allreduce", None, None)],
    ]
