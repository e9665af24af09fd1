"""decent_train: decentralized data-parallel training for PyTorch.

``from decent_train import DecentralizedDataParallel`` replaces ``decent_dp``'s class. Scripts that import decent-dp's
submodules keep working after renaming the package: ``decent_train.ddp``, ``decent_train.optim``,
``decent_train.topo`` and ``decent_train.utils`` are the engine's modules under decent-dp's names (engine/compat.py).

A library stays silent in its user's script: the package's loguru messages are off until asked for with
``loguru.logger.enable("decent_train")``. The ``decent-train`` command and its workers turn them on.

Importing the package imports nothing but the standard library's import machinery: the engine's names, the fronts and
decent-dp's module names are imported when first asked for, and the messages go off as loguru is imported (at once if
it was before). So the ``decent-train`` command (launcher/cli.py) is in its own code, where a Ctrl-C ends in one line,
within tens of milliseconds, before torch's seconds of import start (tests/test_startup_interrupt.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and editors see: the names as if imported here
    from decent_train.algorithms.local_steps import DiLoCo, LocalSGD
    from decent_train.algorithms.step_gossip import Gossip
    from decent_train.engine import *  # noqa: F403
    from decent_train.training.saved_model import load_model


class _QuietWhenLoguruLoads(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``logger.disable("decent_train")`` as soon as loguru is imported, before any submodule of this package can log
    (each imports loguru first), and before its user's script can ``enable`` it. loguru is found and run by its own
    finder and loader; this only adds the call after it."""

    def __init__(self) -> None:
        self.loader: importlib.abc.Loader | None = None

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "loguru" or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # once: the search below, and later ones, go past it
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self.loader is not None
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self.loader is not None and module.__spec__ is not None
        module.__loader__ = module.__spec__.loader = self.loader  # loguru's own, as if imported without this
        self.loader.exec_module(module)
        module.logger.disable("decent_train")


if "loguru" in sys.modules:
    sys.modules["loguru"].logger.disable("decent_train")
else:  # ~50 ms not spent here (on 2 cores): the command reaches its Ctrl-C handling sooner
    sys.meta_path.insert(0, _QuietWhenLoguruLoads())

_FRONTS = ("DiLoCo", "LocalSGD", "Gossip", "load_model")  # exported beside the engine's __all__
_DECENT_DP_MODULES = {  # decent-dp's submodule names -> the engine's module that serves each
    "ddp": "decent_train.engine.compat",
    "utils": "decent_train.engine.compat",
    "optim": "decent_train.engine.optimizers",
    "topo": "decent_train.engine.topology",
}


class _DecentDpModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import decent_train.ddp`` (and ``.optim``, ``.topo``, ``.utils``): the engine's module itself, the same object
    under decent-dp's name, imported then."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _DECENT_DP_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_DECENT_DP_MODULES[spec.name.rpartition(".")[2]])
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it next: undone below
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # type: ignore[union-attr]


if not any(isinstance(finder, _DecentDpModules) for finder in sys.meta_path):
    sys.meta_path.append(_DecentDpModules())


def _import_engine() -> None:
    """The engine's exported names into this module, as ``from decent_train.engine import *`` would."""
    engine = importlib.import_module("decent_train.engine")
    namespace = globals()
    namespace.update({name: getattr(engine, name) for name in engine.__all__})
    namespace["__all__"] = [*engine.__all__, *_FRONTS]


def __getattr__(name: str) -> object:
    """Imported when first asked for: the step-hook fronts (algorithms/local_steps.py, algorithms/step_gossip.py),
    ``load_model`` (training/saved_model.py), decent-dp's module names, and the engine's names (with ``__all__``)."""
    if name in ("DiLoCo", "LocalSGD"):
        from decent_train.algorithms import local_steps

        return getattr(local_steps, name)
    if name == "load_model":  # the trained model a run left
        from decent_train.training.saved_model import load_model

        return load_model
    if name == "Gossip":
        from decent_train.algorithms import step_gossip

        return step_gossip.Gossip
    if name in _DECENT_DP_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "__all__" or not name.startswith("__"):  # other dunders are probes (copy's, inspect's): no torch
        _import_engine()
        if name in globals():  # an exported name, __all__, or the engine module itself
            return globals()[name]
    raise AttributeError(f"module 'decent_train' has no attribute {name!r}")


def __dir__() -> list[str]:
    _import_engine()
    return sorted({*globals(), *_FRONTS, *_DECENT_DP_MODULES})
