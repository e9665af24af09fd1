"""The config tree and its schema: every option of every group composes and passes the checks; bad values are
refused with a message naming them; the config ships inside the wheel."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from decent_train.config import (
    ALGORITHM_TRAITS,
    AlgorithmConfig,
    AlgorithmTraits,
    LaunchConfig,
    TrainConfig,
    check_config,
    load_config,
    register_algorithm,
)
from decent_train.launcher.job import describe_error, shipped_dir
from decent_train.algorithms.local_steps_algorithms import DiLoCoConfig
from decent_train.components.data import DatasetConfig, build_datasets
from decent_train.components.models import ModelConfig, build_model
from decent_train.engine import reconfigure
from decent_train.launcher.preflight import preflight, trainable_tensors
from decent_train.launcher.launch import torchrun_command

from .datafiles import write_cifar, write_image_folder, write_token_files

CONF = Path(shipped_dir("conf"))
REPO = Path(__file__).resolve().parents[1]
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")  # hydra/: Hydra's own groups (launcher)
OPTIONS = [(group, p.stem) for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))]


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A directory in the real format for each dataset that reads files."""
    root = tmp_path_factory.mktemp("data")
    (root / "npz").mkdir()
    for split, n in (("train", 128), ("test", 4)):
        np.savez(root / "npz" / f"{split}.npz", x=np.arange(n * 6, dtype=np.uint8).reshape(n, 6), y=np.arange(n) % 3)
    write_cifar(root / "cifar10", "cifar10")
    write_cifar(root / "cifar100", "cifar100")
    write_image_folder(root / "imagefolder")
    write_token_files(root / "tokens", n_train=4200, n_val=1100)  # 4 workers: a window of 1025 each
    return {name: root / name for name in ("npz", "cifar10", "cifar100", "imagefolder", "tokens")}


def test_conf_groups_mirror_the_schema() -> None:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(GROUPS) <= fields
    assert {"model", "dataset", "optim", "scheduler", "topology", "launch", "logger"} <= set(GROUPS)


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_composes_and_checks(group: str, option: str, data_dirs: dict[str, Path]) -> None:
    overrides = [f"{group}={option}"]
    if group == "dataset" and option in data_dirs:
        overrides.append(f"dataset.root={data_dirs[option]}")
    if group == "dataset" and option == "tokens" or (group, option) == ("model", "gpt2"):  # a language model and its data
        overrides += ["model=gpt2", "dataset=tokens", f"dataset.root={data_dirs['tokens']}"]
    if (group, option) == ("dataset", "npz"):
        overrides.append("model=mlp")  # its samples are vectors
    if (group, option) == ("launch", "gpu"):
        overrides.append("launch.nproc_per_node=2")  # null means one per GPU, resolved by the launcher
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    checked = check_config(cfg)
    if (group, option) == ("fault_tolerance", "live") and not reconfigure.supported():  # the oldest torch admitted
        with pytest.raises(ValueError, match=r"fault_tolerance=live needs torch >= 2\.14"):
            preflight(checked)
    else:
        preflight(checked)
    schema = ALGORITHM_TRAITS[option].schema if group == "algorithm" else type(getattr(TrainConfig(), group))
    assert getattr(checked, group).__class__ is schema  # an algorithm with options: its own schema
    if "name" in cfg[group]:
        assert getattr(checked, group).name == option


@pytest.mark.parametrize(
    "override,fragment",
    [
        ({"model": {"name": "vit"}}, "model.name='vit'"),
        ({"model": {"dropout": 1.5}}, "model.dropout=1.5"),
        ({"optim": {"lr": 0.0}}, "optim.lr=0.0"),
        ({"optim": {"accum_iter": 0}}, "optim.accum_iter=0"),
        ({"scheduler": {"name": "step"}}, "scheduler.name='step'"),
        ({"dataset": {"name": "npz"}}, "dataset=npz needs dataset.root"),
        ({"launch": {"device": "tpu"}}, "launch.device='tpu'"),
        ({"launch": {"nnodes": 2}}, "launch.rdzv_endpoint"),
        ({"logger": {"log_every": 0}}, "logger.log_every=0 must be >= 1"),  # alone: not the keys that are right
        ({"logger": {"consensus_samples": -1}}, "logger.consensus_samples=-1 must be >= 0"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep=0 must be >= 1 (the newest checkpoints kept)"),
        ({"checkpoint": {"every": -1}}, "checkpoint.every=-1 must be >= 0"),
        ({"dataset": {"name": "synthetic", "noise": -1.0}}, "dataset.noise=-1.0 must be >= 0"),  # a std, was taken
        ({"dataset": {"name": "synthetic", "num_classes": 1}}, "dataset.num_classes=1 must be >= 2"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"model": {"name": "cnn"}, "dataset": {"name": "synthetic", "input_shape": [64]}}, "model=cnn needs images"),
        ({"steps": 0, "epochs": 0}, "epochs=0"),
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"label_smoothing": 1.0}, "label_smoothing=1.0"),
        ({"global_batch_size": 100, "launch": {"nproc_per_node": 3}}, "global_batch_size=100"),
        ({"model": {"name": "gpt2"}}, "model=gpt2 cannot train on dataset=digits"),
        ({"dataset": {"name": "cifar10"}}, "dataset=cifar10 needs dataset.root"),
        ({"dataset": {"name": "tokens", "root": "/no/such/dir"}, "model": {"name": "gpt2"}}, "/no/such/dir"),
        ({"dataset": {"name": "imagefolder", "download": True, "root": "/tmp"}}, "dataset.download=true"),
        ({"scheduler": {"warmup_start": 0.0}}, "scheduler.warmup_start=0.0"),
        ({"topology": {"name": "torus"}}, "unknown topology 'torus'"),
        ({"topology": {"module": "no_such_module_here"}}, "topology.module='no_such_module_here'"),
        ({"topology": {"name": "alternating-exp-ring", "local_world_size": 1}, "launch": {"nproc_per_node": 3}}, "3 workers"),
        ({"phases": [{"algorithm": "gossip"}]}, "phases[0].algorithm='gossip'; valid: decentralized, allreduce"),
        ({"phases": [{"algorithm": "allreduce", "topology": "ring"}]}, "phases[0]: algorithm allreduce takes no topology"),
        ({"phases": [{"algorithm": "allreduce"}, {"topology": "ring"}]}, "phases[0].steps is null"),
        ({"phases": [{"algorithm": "allreduce", "steps": 0}, {}]}, "phases[0].steps=0 must be >= 1"),
        ({"steps": 10, "phases": [{"algorithm": "allreduce", "steps": 10}, {}]}, "take 10 steps, but the run has steps=10"),
        ({"steps": 100, "phases": [{"algorithm": "allreduce", "steps": 20}, {"steps": 10}]},  # silently ran 80 before
         "phases[1].steps=10: the last phase runs until the end, 80 steps with steps=100; give it steps: null"),
        ({"algorithm": "allreduce", "phases": [{"algorithm": "allreduce"}]}, "leave algorithm=decentralized"),
        ({"launch": {"nproc_per_node": 3}, "phases": [{"steps": 5}, {"topology": "one-peer-exp"}]},
         "topology=one-peer-exp with 3 workers"),
        ({"launch": {"nproc_per_node": 6}, "topology": {"name": "hierarchical", "local_world_size": 2}},
         "power-of-two number of nodes"),
        ({"global_avg_every": -1}, "global_avg_every=-1"),
        ({"compression": {"name": "int4"}}, "compression='int4' is not a compression; valid: none, bf16, int8"),
        ({"compression": {"name": "int8", "consensus_step": 1.5}}, "compression.consensus_step=1.5: consensus_step must be in (0, 1]"),
        ({"compression": {"name": "int8", "int8_block": 6}}, "compression.int8_block=6"),
        ({"compression": {"name": "int8", "copy_dtype": "fp16"}}, "compression.copy_dtype='fp16'; valid: param, bf16"),
        ({"compression": {"name": "bf16"}, "algorithm": "allreduce"}, "compression=bf16 compresses gossip"),
        # local steps (algorithm=diloco, localsgd): the front's own rules, named by the algorithm's keys
        ({"algorithm": {"name": "diloco", "sync_every": 0}}, "algorithm=diloco: sync_every=0: must be a positive"),
        ({"algorithm": {"name": "localsgd", "fragments": 0}}, "algorithm=localsgd: fragments=0: must be a positive"),
        ({"algorithm": {"name": "diloco", "sync_every": 10, "fragments": 3}},
         "sync_every=10 is not a multiple of fragments=3"),
        ({"algorithm": {"name": "diloco", "sync_every": 10, "fragments": 2, "fragment_sync_delay": 5}},
         "fragment_sync_delay=5: must be an integer in [0, 5)"),
        ({"algorithm": {"name": "diloco", "fragment_update_alpha": 1.5}}, "fragment_update_alpha=1.5: must be in [0, 1]"),
        ({"algorithm": {"name": "diloco", "outer_lr": 0.0}}, "algorithm.outer_lr=0.0 must be > 0"),
        ({"algorithm": {"name": "localsgd", "offload": "maybe"}}, "Value 'maybe' is not a valid bool"),
        ({"algorithm": {"name": "diloco", "outer_momentum": 0.0}}, "algorithm.nesterov=true needs"),
        ({"algorithm": {"name": "diloco", "sync_every": 20, "fragments": 10}, "model": {"name": "mlp"}},
         "algorithm.fragments=10: model=mlp has 6 trainable parameter tensors"),
        ({"algorithm": "diloco", "precision": "fp16"}, "precision=fp16 with algorithm=diloco"),
        ({"algorithm": "localsgd", "global_avg_every": 5}, "global_avg_every=5 is the engine's"),
        ({"algorithm": "diloco", "compression": {"name": "int8", "copy_dtype": "bf16"}},
         "compression.copy_dtype=bf16 sets per-step gossip's public copies"),
        ({"algorithm": "diloco", "phases": [{"algorithm": "allreduce", "steps": 5}, {}]},
         "leave algorithm=decentralized (not 'diloco')"),
        # each names its own key (they shared one message that named eval_every first)
        ({"bucket_size_mb": 0}, "bucket_size_mb=0.0 must be > 0"),
        ({"pg_timeout_s": -1}, "pg_timeout_s=-1.0 must be > 0"),
        ({"eval_every": -1}, "eval_every=-1 must be >= 0 (0: never)"),
        ({"launch": {"monitor_interval": 0}}, "launch.monitor_interval=0.0 must be > 0 seconds"),
        # torch's own refusals, in every worker's traceback, before these
        ({"optim": {"name": "sgd", "momentum": -1}}, "optim.momentum=-1.0 must be in [0, 1)"),
        ({"optim": {"beta2": 1.0}}, "optim.beta2=1.0 must be in [0, 1)"),
        ({"optim": {"eps": -1e-8}}, "optim.eps=-1e-08 must be >= 0"),
        ({"optim": {"name": "sgd", "momentum": 0, "nesterov": True}}, "optim.nesterov=true needs optim.momentum > 0"),
        # fault_tolerance=live: what this version runs with
        ({"fault_tolerance": {"name": "hot"}}, "fault_tolerance='hot'; valid: none, live"),
        ({"fault_tolerance": {"name": "live", "detect_s": 0}}, "fault_tolerance.detect_s=0.0 must be > 0"),
        ({"fault_tolerance": {"name": "live", "min_workers": 5}}, "fault_tolerance.min_workers=5 is more than the 4"),
        ({"fault_tolerance": {"name": "live"}, "algorithm": "allreduce"},
         "fault_tolerance=live with algorithm=allreduce"),
        ({"fault_tolerance": {"name": "live"},
          "algorithm": {"name": "diloco", "fragments": 2, "fragment_sync_delay": 1}},
         "fault_tolerance=live with algorithm=diloco with algorithm.fragment_sync_delay > 0"),
        ({"fault_tolerance": {"name": "live"}, "global_avg_every": 5}, "fault_tolerance=live with global_avg_every=5"),
        ({"fault_tolerance": {"name": "live"}, "phases": [{"algorithm": "allreduce", "steps": 5}, {}]},
         "fault_tolerance=live with phases"),
        ({"fault_tolerance": {"name": "live"}, "launch": {"device": "cuda"}}, "launch.device=cuda: live membership"),
        # issue 38 (D1): fp16's overflow agreement is a collective of every worker, which a dead member fails
        ({"fault_tolerance": {"name": "live"}, "precision": "fp16"}, "fault_tolerance=live with precision=fp16"),
        # issue 38 (D2): keys the run would ignore are refused, naming both keys
        ({"fault_tolerance": {"name": "live"}, "launch": {"monitor_interval": 0.5}},
         "fault_tolerance=live with launch.monitor_interval=0.5"),
        ({"algorithm": "localsgd", "bucket_size_mb": 5.0}, "bucket_size_mb=5.0 with algorithm=localsgd"),
        ({"parallel": {"shard": 2}, "algorithm": "diloco", "bucket_size_mb": 100.0},
         "bucket_size_mb=100.0 with parallel.shard=2"),
        ({"algorithm": "allreduce", "global_avg_every": 5}, "global_avg_every=5 averages the engine's gossiping "
         "workers; algorithm=allreduce does not gossip"),
        # live takes hierarchical (tests/test_live_hierarchical.py), over nodes it can serve at launch
        ({"fault_tolerance": {"name": "live"}, "launch": {"nproc_per_node": 6},
          "topology": {"name": "hierarchical", "local_world_size": 2}}, "power-of-two number of nodes"),
        # parallel.shard: what sharded gossip runs with
        ({"parallel": {"shard": 0}}, "parallel.shard=0 must be >= 1"),
        ({"parallel": {"shard": 3}}, "parallel.shard must divide the workers per node; valid: 1, 2, 4"),
        ({"parallel": {"shard": 2}, "algorithm": "allreduce"}, "parallel.shard=2 with algorithm=allreduce"),
        ({"parallel": {"shard": 2}, "topology": {"local_world_size": 1}}, "topology.local_world_size=1: it must be"),
        ({"parallel": {"shard": 2}, "phases": [{"algorithm": "allreduce", "steps": 5}, {}]}, "shard=2 with phases"),
        ({"parallel": {"shard": 2}, "global_avg_every": 5}, "parallel.shard=2 with global_avg_every=5"),
        ({"parallel": {"shard": 2}, "fault_tolerance": {"name": "live"}}, "parallel.shard=2 with fault_tolerance"),
        ({"parallel": {"shard": 2}, "precision": "fp16"}, "parallel.shard=2 with precision=fp16"),
        ({"parallel": {"shard": 2}, "compile": True}, "parallel.shard=2 with compile=true"),
        ({"parallel": {"shard": 2}, "compression": {"name": "int8", "copy_dtype": "bf16"}},
         "parallel.shard=2 with compression.copy_dtype=bf16"),
        ({"parallel": {"shard": 2}, "launch": {"nproc_per_node": 6}, "topology": {"name": "one-peer-exp"}},
         "topology=one-peer-exp with 6 workers: over 3 replicas (parallel.shard=2)"),
        # parallel.mixed_precision: FSDP2's policy
        ({"parallel": {"shard": 2, "mixed_precision": "fp8"}}, "parallel.mixed_precision='fp8' is not a mixed "
         "precision; valid: auto, none, bf16, bf16-reduce"),
        ({"parallel": {"mixed_precision": "bf16"}}, "parallel.mixed_precision=bf16 sets FSDP2's policy, and "
         "parallel.shard=1 runs no FSDP2"),
        ({"parallel": {"mixed_precision": "none"}}, "parallel.mixed_precision=none sets FSDP2's policy"),
        ({"parallel": {"shard": 2, "mixed_precision": "bf16-reduce"}, "precision": "fp32"},
         "parallel.shard=2 with parallel.mixed_precision=bf16-reduce and precision=fp32"),
        ({"parallel": {"shard": 2, "mixed_precision": "bf16"}, "precision": "fp16"}, "shard=2 with precision=fp16"),
    ],
)
def test_bad_values_name_themselves(override: dict, fragment: str) -> None:
    """What the launcher runs before any worker: the config's checks, then the preflight (files, topologies)."""
    with pytest.raises(ValueError, match=None) as error:
        preflight(check_config(override))
    assert fragment in str(error.value)


@pytest.mark.skipif(reconfigure.why_unsupported("cuda") is None, reason="this machine can run live workers on cuda")
def test_live_cuda_is_checked_where_workers_run_not_on_the_coordinators_host() -> None:
    """The coordinator runs no worker (a login or batch host, often without a GPU): ``launch.device=cuda`` is the
    agents' to check on their nodes. Here, where live workers cannot run on cuda, an agent refuses it in one line and
    a coordinator takes it."""
    live = {"fault_tolerance": {"name": "live", "role": "agent"}, "launch": {"device": "cuda",
                                                                            "rdzv_endpoint": "10.0.0.1:29400"}}
    with pytest.raises(ValueError, match="launch.device=cuda: live membership"):
        check_config(live)
    live["fault_tolerance"]["role"] = "coordinator"
    assert check_config(live).launch.device == "cuda"


@pytest.mark.skipif(not reconfigure.supported(), reason="live membership needs torch >= 2.14")
@pytest.mark.parametrize("offload", [None, True])
@pytest.mark.parametrize("compression", ["int8", "bf16"])
@pytest.mark.parametrize("algorithm", ["diloco", "localsgd"])
def test_live_local_steps_take_compressed_outer_steps(algorithm: str, compression: str, offload: bool | None) -> None:
    """Live membership runs DiLoCo's and LocalSGD's compressed outer steps (refused before a missed compressed
    message and the public copies at a change had a rule: tests/test_live_local_steps_compressed.py replays it),
    offloaded too (CUDA's default; refused before the change's mean and restarted copies ran on host-resident state:
    the same file and tests/test_live_local_steps.py replay it)."""
    cfg = check_config({"fault_tolerance": {"name": "live"}, "algorithm": {"name": algorithm, "offload": offload},
                        "compression": {"name": compression}})
    preflight(cfg)
    assert cfg.compression.name == compression and cfg.fault_tolerance.live and cfg.algorithm.offload is offload


PREFLIGHT_ONLY = [  # what needs the disk, the user's code or a topology built: the launcher's preflight, not the schema
    ({"dataset": {"name": "tokens", "root": "/no/such/dir"}, "model": {"name": "gpt2"}}, "/no/such/dir"),
    ({"topology": {"name": "torus"}}, "unknown topology 'torus'"),
    ({"topology": {"module": "no_such_module_here"}}, "topology.module='no_such_module_here'"),
    ({"launch": {"nproc_per_node": 3}, "phases": [{"steps": 5}, {"topology": "one-peer-exp"}]},
     "topology=one-peer-exp with 3 workers"),
    ({"dataset": {"partition": "classes", "classes_per_worker": 1}, "launch": {"nproc_per_node": 4}}, "10 classes"),
    ({"algorithm": {"name": "localsgd", "sync_every": 9, "fragments": 9}}, "algorithm.fragments=9: model=cnn has 8"),
]


@pytest.mark.parametrize("override,fragment", PREFLIGHT_ONLY)
def test_schema_checks_values_only_and_preflight_the_rest(override: dict, fragment: str) -> None:
    cfg = check_config(override)  # a worker loading its config reads no file and imports no user module
    with pytest.raises(ValueError, match=None) as error:
        preflight(cfg)
    assert fragment in str(error.value)


USER_TOPOLOGY = """
from decent_train import Edge, Topology, TopologyReg

@TopologyReg.register("everyone")
class Everyone(Topology):
    def _get_topo_edges(self):
        return [[Edge(list(range(self._world_size)))]]
"""


@pytest.mark.slow  # two new interpreters
def test_a_topology_module_is_imported_by_the_preflight_and_by_a_worker(tmp_path: Path) -> None:
    """In a new interpreter (the registry is global): the launcher's preflight imports ``topology.module`` to build
    its topology; a worker loading the resolved config imports it too, before the engine asks for the name."""
    (tmp_path / "my_topologies.py").write_text(USER_TOPOLOGY)
    script = (
        "import sys; from omegaconf import OmegaConf\n"
        "from decent_train.config import check_config, load_config\n"
        "from decent_train.engine.topology import topology_names\n"
        "from decent_train.launcher.preflight import preflight\n"
        "cfg = check_config({'topology': {'name': 'everyone', 'module': 'my_topologies'}})\n"
        "assert 'everyone' not in topology_names()  # checking values imports nothing\n"
        "preflight(cfg)\n"
        "OmegaConf.save(OmegaConf.structured(cfg), sys.argv[1])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    resolved = tmp_path / "resolved_config.yaml"
    subprocess.run([sys.executable, "-c", script, str(resolved)], check=True, env=env, capture_output=True)
    worker = (
        "import sys; from decent_train.config import load_config; from decent_train import topology_names\n"
        "cfg = load_config(sys.argv[1]); print('everyone' in topology_names(), cfg.build_topology().label)\n"
    )
    out = subprocess.run([sys.executable, "-c", worker, str(resolved)], check=True, env=env, capture_output=True, text=True)
    assert out.stdout.startswith("True everyone: 4 workers")


def test_defaults_have_one_source() -> None:
    """The dataclasses hold every default: the default job composes to ``TrainConfig()``, and no option file repeats
    a default (it sets its ``name`` and what makes it that option)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        job = OmegaConf.to_container(compose("train"))
    assert job == OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    schema = OmegaConf.structured(TrainConfig)
    for group, option in OPTIONS:
        values = OmegaConf.load(CONF / group / f"{option}.yaml")
        values.pop("defaults", None)
        default = schema[group]
        repeated = [key for key in values if key != "name" and key in default and values[key] == default[key]]
        assert not repeated, f"conf/{group}/{option}.yaml repeats the schema's defaults of {repeated}"


def test_algorithm_is_a_group_and_a_bare_name_still_works() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = check_config(compose("train", overrides=["algorithm=allreduce"]))
    assert cfg.algorithm == AlgorithmConfig(name="allreduce") and not cfg.gossips
    for old in ({"algorithm": "allreduce"}, OmegaConf.create({"algorithm": "allreduce"})):  # configs of earlier runs
        assert check_config(old).algorithm == AlgorithmConfig(name="allreduce")
    with pytest.raises(ValueError, match=r"algorithm='gossip' is not an algorithm; valid: decentralized, allreduce"):
        check_config({"algorithm": {"name": "gossip"}})


@dataclasses.dataclass
class _LocalConfig(AlgorithmConfig):
    name: str = "local"
    sync_every: int = 10

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"algorithm.sync_every={self.sync_every} must be >= 1")


def test_an_algorithm_with_options_is_a_schema_and_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an algorithm's module does (register its options' schema and traits) plus its conf/algorithm file make
    ``algorithm=local algorithm.sync_every=3`` typed and checked, on the command line and in a worker's reload."""
    monkeypatch.setitem(ALGORITHM_TRAITS, "local", AlgorithmTraits())
    register_algorithm("local", AlgorithmTraits(schema=_LocalConfig, gossips=True))
    ConfigStore.instance().store(group="algorithm_schema", name="local", node=_LocalConfig)  # as the CLI does
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    local_yaml = "defaults:\n  - /algorithm_schema/local@_here_\n  - _self_\nname: local\n"
    (conf / "algorithm" / "local.yaml").write_text(local_yaml)
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = check_config(compose("train", overrides=["algorithm=local", "algorithm.sync_every=3"]))
        with pytest.raises(ConfigCompositionException) as error:
            compose("train", overrides=["algorithm=local", "algorithm.sync_evry=3"])
    assert describe_error(error.value) == "algorithm.sync_evry is not a key; valid in algorithm: name, sync_every"
    assert cfg.algorithm == _LocalConfig(sync_every=3) and cfg.gossips
    OmegaConf.save(OmegaConf.structured(cfg), tmp_path / "resolved_config.yaml")  # what a worker reloads
    assert load_config(tmp_path / "resolved_config.yaml").algorithm == cfg.algorithm
    assert check_config({"algorithm": "local"}).algorithm == _LocalConfig()
    with pytest.raises(ValueError, match="algorithm.sync_every=0 must be >= 1"):
        check_config({"algorithm": {"name": "local", "sync_every": 0}})


def test_local_steps_compose_typed_take_compression_and_count_fragments_from_the_model() -> None:
    """algorithm=diloco|localsgd: options typed (LocalSGD has no outer optimizer), compression allowed (their outer
    exchange), and the preflight's count of parameter tensors equal to that of the model built for real data."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        overrides = ["algorithm=diloco", "algorithm.sync_every=20", "algorithm.fragments=4", "compression=int8"]
        cfg = check_config(compose("train", overrides=overrides))
        with pytest.raises(ConfigCompositionException) as error:
            compose("train", overrides=["algorithm=localsgd", "algorithm.outer_lr=0.5"])
    assert describe_error(error.value) == (
        "algorithm.outer_lr is not a key; valid in algorithm: name, sync_every, fragments, fragment_sync_delay, "
        "offload (outer_lr is an option of algorithm=diloco: choose one, or in a sweep over algorithm= write "
        "++algorithm.outer_lr=...)"
    )
    preflight(cfg)
    assert cfg.gossips and cfg.compression.name == "int8"
    assert cfg.algorithm == DiLoCoConfig(sync_every=20, fragments=4)
    assert (cfg.algorithm.outer_lr, cfg.algorithm.outer_momentum, cfg.algorithm.nesterov) == (0.2, 0.9, True)
    digits = build_datasets(DatasetConfig(name="digits"))
    for model in (ModelConfig(name="cnn"), ModelConfig(name="mlp", hidden_sizes=[5, 5, 5])):
        real = build_model(model, digits.input_shape, digits.num_classes)
        assert trainable_tensors(model, tokens=False) == len(list(real.parameters()))
    gpt = ModelConfig(name="gpt2", layers=2, heads=2, width=8)  # its head is tied to the embedding: counted once
    assert trainable_tensors(gpt, tokens=True) == len(list(build_model(gpt, (16,), 50).parameters())) == 2 + 2 * 6 + 1  # wte, wpe; per block ln_1, qkv, proj, ln_2, fc, proj; ln_f


def test_allreduce_builds_no_topology_and_refuses_one_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """All-reduce reads no topology: the preflight builds none, and a topology set away from the default (which it
    would ignore) is refused in one line naming both keys (once accepted: one-peer-exp over 3 workers passed)."""
    cfg = check_config({"algorithm": "allreduce", "launch": {"nproc_per_node": 3}})
    monkeypatch.setattr(TrainConfig, "build_topology", lambda *_: pytest.fail("all-reduce built a topology"))
    preflight(cfg)
    assert cfg.launch.world_size == 3 and cfg.schedule() == "allreduce"
    with pytest.raises(ValueError, match=r"^topology=one-peer-exp with algorithm=allreduce: .* leave topology=ring$"):
        check_config({"algorithm": "allreduce", "topology": {"name": "one-peer-exp"}, "launch": {"nproc_per_node": 3}})


def test_multi_node_torchrun_command() -> None:
    cfg = LaunchConfig(nproc_per_node=8, nnodes=2, rdzv_endpoint="node1:29400", rdzv_id="job42", max_restarts=3)
    assert torchrun_command(cfg, Path("/runs/x/resolved_config.yaml")) == [
        "torchrun", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node1:29400", "--rdzv-id=job42",
        "--nproc-per-node=8", "--max-restarts=3", "--monitor-interval=0.1",
        "-m", "decent_train.worker", "/runs/x/resolved_config.yaml",
    ]  # fmt: skip


def test_wheel_contains_the_config(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("decent_train-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("conf", "recipes"):
        expected = {f"decent_train/{folder}/{p.relative_to(REPO / folder)}" for p in (REPO / folder).rglob("*.yaml")}
        assert expected and expected <= names
    assert "decent_train/launcher/cli.py" in names and "decent_train/worker.py" in names


@pytest.mark.parametrize(("override", "line"), [
    ("model.channels=5", "model.channels=5: expected a list, e.g. model.channels=[32,64]"),
    ("phases=[foo]", "phases[0]=foo: each phase is {algorithm: allreduce|decentralized, topology: NAME, steps: N}, "
                     "e.g. 'phases=[{algorithm:allreduce,steps:100},{topology:ring}]'"),
])
def test_a_value_of_the_wrong_shape_says_what_shape(override: str, line: str) -> None:
    """OmegaConf's own words were "int is not a ListConfig, list or tuple" and "str is not a subclass of
    PhaseConfig": no example of the right value. The example is the schema's default (written here by hand)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as error:
            compose("train", overrides=[override])
    assert describe_error(error.value) == line
