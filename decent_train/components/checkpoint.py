"""Per-worker checkpoints: in decentralized training every worker holds a different model, so every rank saves its own.

Layout: ``RUN_DIR/checkpoints/step_00000100/rank<k>.pt`` and ``manifest.json``. Each rank writes its file under a
temporary name and renames it (atomic), hashing it on the way; after every rank has written, rank 0 writes the
manifest (each file's sha256 and size, the step, the world size, the topology, the model's architecture and the
settings the saved state's layout depends on: the algorithm, the optimizer, the compression) the same way. A
checkpoint without a manifest is incomplete and never used. Loading checks every rank's file against the manifest:
if any is truncated or corrupt, or holds NaN or inf in a floating-point tensor (a diverged state, which no checksum
sees), all ranks fall back to the previous complete checkpoint, with a warning naming the file (and the tensor). A
state that holds NaN or inf is never saved: training stops there instead (``NonFiniteState``), keeping the checkpoints
before it.

At another world size (M workers continuing N workers' checkpoint) every worker starts from the files' average: the
floating-point tensors summed in float64 (components/state_average.py), everything else taken from rank 0's file.
Each file is read by one worker, which sums its share as the files stream by (one file and the sums in memory, never
N states), and one all-reduce adds the shares: N files read and hashed once in all, not once by each worker.

A sharded model (``parallel.shard``: FSDP2) saves its model and optimizer state with torch.distributed.checkpoint,
one DCP checkpoint per replica (``replica<r>/``, written by the replica's ranks); each rank's file holds the rest. The
manifest lists each rank's DCP files with their checksums too, so a truncated shard skips the checkpoint like a
truncated rank file; the averaged resume averages the replicas' DCP states (``Algorithm.load_sharded_state``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch
import torch.distributed as dist
from loguru import logger

from decent_train.components.state_average import StateSum, layout_of, named_floats, sum_across_workers
from decent_train.engine.comm import peers_must_answer

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
RESTARTED_BY_AVERAGE = ("compression",)  # settings whose state an averaged resume rebuilds (compression.int8_block)
VERIFY_THREADS = min(8, os.cpu_count() or 1)  # ranks verify_checkpoint checks at once (a node's GPUs' worth at most)


@dataclass
class CheckpointConfig:
    """``conf/checkpoint/*.yaml``: when to checkpoint, how many to keep, and what ``resume=`` does when none of its
    checkpoints can be read.

    ``every=0`` writes no periodic checkpoint but still the final one: the finished run can be resumed (to evaluate,
    or to train on with more steps), and a benchmark pays for one write instead of many. ``fresh_if_unreadable``
    exists because starting from step 0 silently would throw away what the user asked to continue: with ``resume=DIR``
    and no readable checkpoint there the launcher stops, naming each one tried, unless this says to start afresh
    (a requeued job's script that always passes ``resume=``)."""

    every: int = 1000  # optimizer steps between checkpoints; 0: none but the final one (written in every case)
    keep: int = 2  # the newest complete checkpoints kept; older ones are deleted
    fresh_if_unreadable: bool = False  # resume=DIR without a readable checkpoint: start from step 0 instead of stopping

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every={self.every} must be >= 0 (0: only the final checkpoint)")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep={self.keep} must be >= 1 (the newest checkpoints kept)")


@dataclass
class ShardedState:
    """What torch.distributed.checkpoint saves for a sharded model: ``state`` (DTensors), written into
    ``replica<replica>/`` by the ``shard`` ranks of ``group``, this one holding shard ``position``."""

    state: dict[str, Any]
    replica: int
    position: int
    shard: int
    group: Any


@dataclass
class Checkpoint:
    """A complete checkpoint on disk: its directory and its manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def shard(self) -> int:
        """Ranks per replica of the workers that wrote it (1: whole models, no DCP state)."""
        return int(self.manifest.get("shard", 1))

    @property
    def run_world_size(self) -> int:
        """The world size the run started with (what its epochs were counted in); older manifests: the writers'."""
        return int(self.manifest.get("run_world_size", self.manifest["world_size"]))

    def same_layout(self, world_size: int, shard: int) -> bool:
        """Whether ``world_size`` workers in replicas of ``shard`` continue it rank by rank (else: from an average)."""
        return self.world_size == world_size and self.shard == shard

    def describe_mismatch(
        self, world_size: int, topology: str, model: dict[str, Any], shard: int = 1,
        settings: Optional[dict[str, Any]] = None,
    ) -> Optional[str]:
        """Why this checkpoint cannot continue a run of ``world_size`` workers in replicas of ``shard`` on
        ``topology`` training ``model`` (its ``ModelConfig.architecture()``) with ``settings`` (``save_checkpoint``'s;
        None: not checked); None: it can. At the same layout the topology must be laid out the same way over the
        nodes; at another, only its name (and phases) must match. Sharded and whole models do not continue each other
        (DCP reshards between numbers of shards)."""
        if (self.shard > 1) != (shard > 1):
            return (f"{self.path} was written with parallel.shard={self.shard}; this run has parallel.shard={shard}: "
                    "resume a sharded run sharded (any parallel.shard > 1) and a whole-model run with 1")
        theirs = self.manifest["topology"]
        if self.same_layout(world_size, shard):
            same = theirs == topology
        else:
            same = _without_layout(theirs) == _without_layout(topology)
        if not same:
            return (
                f"{self.path} was written by {self.world_size} workers with topology {theirs!r}; this run has "
                f"{world_size} workers with {topology!r}: resume with the same topology"
                + (", launch.nnodes and launch.nproc_per_node (or another number of workers, which starts from "
                   "the saved workers' average)" if self.same_layout(world_size, shard) else "")
            )
        theirs = self.manifest.get("model", model)  # older manifests do not say
        if theirs != model:
            differ = ", ".join(f"model.{k}={theirs.get(k)} there, {model.get(k)} here" for k in theirs | model
                               if theirs.get(k) != model.get(k))
            return f"{self.path} holds another model ({differ}): resume with the same model settings"
        return self.describe_settings_mismatch(settings or {}, self.same_layout(world_size, shard))

    def describe_settings_mismatch(self, settings: dict[str, Any], same_layout: bool = True) -> Optional[str]:
        """One line naming the ``settings`` (override -> value) that differ from those the checkpoint was trained
        with, theirs, and what to do; None if none do. Another algorithm or optimizer reads a state of another layout
        (a KeyError deep in a worker) or, worse, trains on from another optimizer's moments without a word. A key the
        manifest lacks is not checked (written before it was recorded); at another world size (``same_layout``
        false) the compressed gossip's copies restart from the average, so the compression may change there."""
        theirs = self.manifest.get("settings") or {}
        keys = [k for k in theirs if k in settings and theirs[k] != settings[k]
                and (same_layout or k.split(".")[0] not in RESTARTED_BY_AVERAGE)]
        if "algorithm" in keys:  # its options (algorithm.fragments) follow from it
            keys = [k for k in keys if not k.startswith("algorithm.")]
        if not keys:
            return None
        mine, saved = (" ".join(f"{k}={values[k]}" for k in keys) for values in (settings, theirs))
        return (f"{mine}: the checkpoint {self.path} was trained with {saved}; resume with {saved}, or start a new "
                "run (without resume=)")


def _without_layout(topology: str) -> str:
    """A topology label without its world size, nodes and shards (``ring: 4 workers (1 nodes x 4)`` -> ``ring``;
    ``ring: 2 workers (1 nodes x 2) x 2 shards`` -> ``ring``)."""
    return re.sub(r": \d+ workers \(\d+ nodes x \d+\)( x \d+ shards)?", "", topology)


class _HashingWriter:
    """A file that hashes what is written to it (the checksum costs no second read)."""

    def __init__(self, file: BinaryIO):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _write_atomically(path: Path, write: Any) -> tuple[str, int]:
    """``write(file)`` into ``path`` via a temporary file and a rename; the sha256 and size of what was written."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw:
        writer = _HashingWriter(raw)
        write(writer)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)
    return writer.sha256.hexdigest(), writer.size


def complete_checkpoints(run_dir: Path, unreadable: Optional[list[tuple[Path, str]]] = None) -> list[Checkpoint]:
    """The checkpoints of ``run_dir`` that have a readable manifest, newest first. A manifest that cannot be read (or
    lacks what loading needs) skips its checkpoint: into ``unreadable`` as (its directory, why) if given, else with a
    warning."""
    found = []
    for manifest in (run_dir / CHECKPOINTS).glob(f"step_*/{MANIFEST}"):
        try:
            checkpoint = Checkpoint(manifest.parent, json.loads(manifest.read_text()))
            why = _manifest_problem(checkpoint.manifest)
        except (OSError, ValueError) as error:
            why = f"{MANIFEST} cannot be read ({getattr(error, 'strerror', None) or error})"
        if not why:
            found.append(checkpoint)
        elif unreadable is not None:
            unreadable.append((manifest.parent, why))
        else:
            logger.warning(f"{manifest.parent}: {why}; that checkpoint is skipped")
    return sorted(found, key=lambda c: c.step, reverse=True)


def _manifest_problem(manifest: Any) -> str:
    """What a parsed manifest lacks that loading its checkpoint needs (a hand-edited or damaged file); empty if
    nothing: the step, the world size, the topology and one entry with a file, checksum and size per rank."""
    if not isinstance(manifest, dict) or not all(k in manifest for k in ("step", "world_size", "topology", "ranks")):
        return f"{MANIFEST} lacks step, world_size, topology or ranks"
    ranks = manifest["ranks"]
    if not isinstance(ranks, list) or len(ranks) != manifest["world_size"] or not all(
        isinstance(e, dict) and {"file", "sha256", "bytes"} <= e.keys() for e in ranks
    ):
        return f"{MANIFEST} does not list a file, sha256 and bytes for each of its {manifest['world_size']} ranks"
    return ""


def verify_checkpoint(checkpoint: Checkpoint) -> str:
    """Why one of ``checkpoint``'s files (any rank's, DCP shards included) does not match its manifest, or a rank's
    file holds NaN or inf, the first found (the lowest rank's); empty if neither. The launcher's check before any
    worker starts (it hashes every file, then maps each rank's file to scan its tensors: never a whole state in
    memory): a resume that would find nothing it can train from stops there, in one line, instead of in every worker.
    The ranks are checked in up to ``VERIFY_THREADS`` threads: hashing is single-core bound and hashlib releases the
    GIL, so a node's cores (and a disk's queue) share the work every start and requeue waits for."""
    ranks, stop = checkpoint.manifest["ranks"], threading.Event()
    pool = ThreadPoolExecutor(max(1, min(len(ranks), VERIFY_THREADS)), thread_name_prefix="verify_checkpoint")
    try:
        for why in pool.map(lambda entry: _verify_rank(checkpoint, entry, stop), ranks):  # in rank order
            if why:
                return why
    finally:
        stop.set()  # after a bad rank or a Ctrl-C the running hashes end at their next chunk, not their file's end
        pool.shutdown(cancel_futures=True)
    return ""


def _verify_rank(checkpoint: Checkpoint, entry: dict[str, Any], stop: threading.Event) -> str:
    """``verify_checkpoint`` for one rank's manifest ``entry``: its files' checksums, then its tensors (mapped)."""
    why = _check_files(checkpoint, [entry, *entry.get("sharded", [])], stop)
    if stop.is_set():
        return ""  # nobody reads it
    if not why:
        path = checkpoint.path / entry["file"]
        why = _nonfinite_file(path, torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    return why


class NonFiniteState(RuntimeError):
    """The state a checkpoint would save holds NaN or inf: it is not saved, and training stops (every rank)."""


def nonfinite_tensor(state: Any) -> Optional[tuple[str, str]]:
    """The first floating-point tensor of ``state`` (nested dicts, lists, tuples) that holds NaN or inf: its name (the
    keys to it, joined by dots) and ``NaN`` or ``inf``; None if every one is finite. A diverged state resumed trains
    on NaN (or, an Adam moment at inf, silently freezes its weights), so it is treated like a corrupt file. One min/max
    reduction per tensor and one host sync per device; a sharded tensor: this rank's shard."""
    named = [(name, t.to_local() if hasattr(t, "to_local") else t)  # a DTensor: this rank's shard
             for name, t in named_floats(state) if t.numel()]
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, tensor) in enumerate(named):
        by_device.setdefault(tensor.device, []).append(index)
    bad = []
    for indices in by_device.values():
        bounds = torch.stack([torch.stack(torch.aminmax(_reducible(named[i][1]))).double() for i in indices])
        bad += [i for i, finite in zip(indices, torch.isfinite(bounds).all(dim=1).tolist()) if not finite]
    if not bad:
        return None
    name, tensor = named[min(bad)]
    return name, "NaN" if bool(torch.isnan(tensor).any()) else "inf"


def _reducible(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a float32 copy of a float8 one (torch has no ``aminmax`` for float8); NaN and inf propagate."""
    return tensor.float() if tensor.element_size() == 1 else tensor


def _nonfinite_file(path: Path, state: Any) -> str:
    """Why ``path``'s ``state`` cannot be trained from (``path holds NaN in model.1.weight``); empty if it can."""
    found = nonfinite_tensor(state)
    return f"{path} holds {found[1]} in {found[0]}" if found else ""


FRESH_FLAG = "checkpoint.fresh_if_unreadable=true"


def describe_unreadable(where: str, tried: list[tuple[Path, str]]) -> str:
    """One line: ``where`` (``resume=DIR``) has no checkpoint that can be read, each one ``tried`` with why (paths
    inside its directory shortened), and the flag that starts afresh instead."""
    if not tried:
        return f"{where} holds no complete checkpoint (checkpoints/step_*/{MANIFEST}); to train from step 0 instead, " \
               f"add {FRESH_FLAG}"
    listed = ", ".join(f"{path.name} [{why.replace(f'{path}/', '')}]" for path, why in tried)
    return f"{where}: no checkpoint can be read: {listed}; to train from step 0 instead, add {FRESH_FLAG}"


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], topology: str, model: dict[str, Any], keep: int,
    run_world_size: Optional[int] = None, before_gather: Optional[Callable[[], None]] = None,
    sharded: Optional[ShardedState] = None, settings: Optional[dict[str, Any]] = None,
) -> Path:
    """Every rank saves ``state``; rank 0 then writes the manifest (with the ``topology``, the ``model``'s
    architecture and the ``settings`` that a resume must match (training/resume.py: resume_settings), and the world
    size the run started with: by default this one) and deletes all but the newest ``keep``.

    Collective: every rank calls it at the same step. ``before_gather`` runs after this rank's file is written,
    before the collectives (live membership's fence: a member that died while writing stops nobody). A state that
    holds NaN or inf on any rank (the loss checked before it is finite, but the step's own update can overflow) is
    not kept: no manifest, nothing deleted, its files removed, and every rank raises ``NonFiniteState`` naming the
    tensor and the last checkpoint kept, so that a diverged state never takes the place of the finite ones.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    nonfinite = nonfinite_tensor(state) or (nonfinite_tensor(sharded.state) if sharded is not None else None)
    directory = run_dir / CHECKPOINTS / f"step_{step:08d}"
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / f"rank{rank}.pt"
    sha256, size = _write_atomically(file, lambda f: torch.save(state, f))
    entry: dict[str, Any] = {"file": file.name, "sha256": sha256, "bytes": size}
    if sharded is not None:
        entry["sharded"] = _save_sharded(directory, sharded)  # collective over the replica: written even if discarded
    if nonfinite is not None:
        entry["nonfinite"] = f"{nonfinite[0]} holds {nonfinite[1]}"
    if before_gather is not None:
        before_gather()
    entries: list[Any] = [None] * world
    with peers_must_answer(f"saving checkpoint {directory.name} (gathering the ranks' files)"):
        dist.all_gather_object(entries, entry)
    diverged = [(r, e["nonfinite"]) for r, e in enumerate(entries) if "nonfinite" in e]
    if diverged:
        _discard(run_dir, step, directory, diverged[0])
    if rank == 0:
        manifest = {"step": step, "world_size": world, "run_world_size": run_world_size or world,
                    "topology": topology, "model": model, "ranks": entries}
        if settings:
            manifest["settings"] = dict(settings)
        if sharded is not None:
            manifest["shard"] = sharded.shard
        _write_atomically(directory / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        for old in complete_checkpoints(run_dir)[keep:]:
            shutil.rmtree(old.path, ignore_errors=True)
        for partial in (run_dir / CHECKPOINTS).glob("step_*"):  # left by a run that died while writing
            if not (partial / MANIFEST).exists() and partial != directory:
                shutil.rmtree(partial, ignore_errors=True)
    with peers_must_answer(f"saving checkpoint {directory.name} (the barrier after it)"):
        dist.barrier()  # nobody goes on (or dies) before the checkpoint is complete
    return directory


def _discard(run_dir: Path, step: int, directory: Path, first: tuple[int, str]) -> None:
    """Remove ``directory``, the files of a state that holds NaN or inf (rank, what: ``first``), and raise
    ``NonFiniteState`` on every rank, naming the newest checkpoint kept. Collective, in ``save_checkpoint``."""
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    with peers_must_answer(f"discarding checkpoint {directory.name} (the barrier after it)"):
        dist.barrier()
    kept = complete_checkpoints(run_dir)
    last = f"the last good checkpoint is {kept[0].path}" if kept else "no checkpoint was written before it"
    raise NonFiniteState(f"the model or optimizer state is NaN or infinite at step {step} (rank {first[0]}: "
                         f"{first[1]}); not saved, training stopped: {last}")


def _save_sharded(directory: Path, sharded: ShardedState) -> list[dict[str, Any]]:
    """DCP-save ``sharded.state`` into ``replica<r>/`` with the replica's ranks; the manifest entries of the files this
    rank wrote (its shard's; the replica's first rank also the metadata)."""
    import torch.distributed.checkpoint as dcp

    folder = directory / f"replica{sharded.replica}"
    dcp.save(sharded.state, checkpoint_id=folder, process_group=sharded.group)
    files = sorted(folder.glob(f"__{sharded.position}_*.distcp"))
    if sharded.position == 0:
        files.append(folder / ".metadata")
    entries = []
    for path in files:
        sha256, size = _checksum(path)
        entries.append({"file": str(path.relative_to(directory)), "sha256": sha256, "bytes": size})
    return entries


def _checksum(path: Path, stop: Optional[threading.Event] = None) -> tuple[str, int]:
    """The sha256 and size of ``path``, streamed (never the whole file in memory); cut short once ``stop`` is set."""
    with open(path, "rb") as file:
        sha256, size = hashlib.sha256(), 0
        while not (stop is not None and stop.is_set()) and (chunk := file.read(1 << 24)):
            sha256.update(chunk)
            size += len(chunk)
    return sha256.hexdigest(), size


def _check_files(
    checkpoint: Checkpoint, entries: list[dict[str, Any]], stop: Optional[threading.Event] = None
) -> str:
    """Why one of ``entries``' files does not match its checksum in the manifest; empty if all do. Cut short once
    ``stop`` is set, when nobody reads the answer."""
    for entry in entries:
        path = checkpoint.path / entry["file"]
        try:
            sha256, size = _checksum(path, stop)
        except OSError as error:
            return f"{path} cannot be read ({error.strerror})"
        if size != entry["bytes"] or sha256 != entry["sha256"]:
            return f"{path} is truncated or corrupt ({size} bytes, manifest: {entry['bytes']}; checksum differs)"
    return ""


def _read_file(checkpoint: Checkpoint, rank: int) -> tuple[Optional[dict[str, Any]], str]:
    """Rank ``rank``'s state from ``checkpoint`` if its checksums (its file's, its DCP files') match the manifest and
    its floating-point tensors are finite; else None and why. The hash streams over the file before it is loaded:
    never two copies of it in memory."""
    entry = checkpoint.manifest["ranks"][rank]
    why = _check_files(checkpoint, [entry, *entry.get("sharded", [])])
    if why:
        return None, why
    state = torch.load(checkpoint.path / entry["file"], map_location="cpu", weights_only=True)
    why = _nonfinite_file(checkpoint.path / entry["file"], state)  # in memory already: one pass, no second read
    return (None, why) if why else (state, "")


Prepare = Callable[[dict[str, Any]], dict[str, Any]]


def _read_averaged(checkpoint: Checkpoint, prepare: Prepare) -> tuple[Optional[dict[str, Any]], str]:
    """The average of every saved rank's ``prepare``d state; None and why if a file is bad (on every worker). Each
    file is read by one worker (file k by worker k mod M, one at a time), and the float64 sums are all-reduced:
    N files read once in all. Collective; a file whose state has another layout than file 0's is a ``ValueError``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, why, stray = StateSum(), "", None
    for index in range(rank, checkpoint.world_size, world):
        state, why = _read_file(checkpoint, index)
        if state is None:
            break
        if not mine.add(prepare(state)):
            stray = index
            break
    first = mine.skeleton if rank == 0 else None  # file 0: its floats' layout, everything else as the average keeps
    shares: list[Any] = [None] * world
    with peers_must_answer(f"averaging checkpoint {checkpoint.path.name} (gathering what each rank read)"):
        dist.all_gather_object(shares, (why, mine.layout, stray, first))
    problems = [share[0] for share in shares if share[0]]
    if problems:
        return None, problems[0]
    skeleton = shares[0][3]
    reference = layout_of(skeleton)
    for r, (_, own, stray, _) in enumerate(shares):  # own: the layout of file r, the first that rank r read
        odd = r if own and own != reference else stray
        if odd is not None:
            raise ValueError(f"checkpoint file {odd} holds a state of another layout than file 0's")
    return sum_across_workers(mine, skeleton, checkpoint.world_size).mean(), ""


def load_latest_checkpoint(
    run_dirs: list[Path], topology: str, model: dict[str, Any], prepare_average: Prepare = lambda state: state,
    shard: int = 1, tried: Optional[list[tuple[Path, str]]] = None, settings: Optional[dict[str, Any]] = None,
) -> tuple[Optional[Checkpoint], Optional[dict[str, Any]]]:
    """The newest checkpoint in ``run_dirs`` (in order of preference) that every rank can read, and this rank's state:
    its own file's, or, written by another number of workers (or of ``shard`` per replica), the average of all
    files' ``prepare_average``d states (marked ``averaged_from``: the number of files).

    Collective. A checkpoint with a bad file on any rank (or a bad manifest) is skipped on all, with one warning line
    on rank 0, and appended to ``tried`` as (its directory, why); a checkpoint of another topology or model is an
    error (``ValueError``), and so is one trained with other ``settings`` (``Checkpoint.describe_settings_mismatch``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    tried = [] if tried is None else tried
    for run_dir in run_dirs:
        unreadable: list[tuple[Path, str]] = []
        checkpoints = complete_checkpoints(run_dir, unreadable)
        for path, why in unreadable:
            if rank == 0:
                logger.warning(f"checkpoint {path.name} skipped: {why}")
        tried += unreadable
        for checkpoint in checkpoints:
            mismatch = checkpoint.describe_mismatch(world, topology, model, shard, settings)
            if mismatch:
                raise ValueError(mismatch)
            if checkpoint.same_layout(world, shard):
                state, why = _read_file(checkpoint, rank)
            else:
                state, why = _read_averaged(checkpoint, prepare_average)
                if state is not None:
                    state["averaged_from"] = checkpoint.world_size
            problems: list[Any] = [None] * world
            with peers_must_answer(f"loading checkpoint {checkpoint.path.name}"):
                dist.all_gather_object(problems, why)
            bad = [p for p in problems if p]
            if not bad:
                return checkpoint, state
            tried.append((checkpoint.path, bad[0]))
            if rank == 0:
                logger.warning(f"checkpoint {checkpoint.path.name} skipped: {'; '.join(bad)}; trying the one before")
    return None, None
