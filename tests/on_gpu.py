"""What the GPU tests (tests/test_gpu.py, tests/test_gpu_fronts.py) share: the device under test, the ``gpu`` mark
with its skip, measurements for scripts/gpu_check.py's summary, and workers in spawned processes: one GPU each, or
several on one GPU (issue 37 part 5: the experiment below decides how).

``GPU_CHECK_DEVICE=cpu`` runs the GPU tests' bodies on the CPU with gloo (a check of their code without a GPU);
``GPU_CHECK_OUT`` names the folder of ``measurements.jsonl``; ``GPU_CHECK_ONE_GPU_BACKEND`` = auto (default: NCCL if
it accepts ranks sharing the GPU, else gloo), nccl or gloo forces the backend of the one-GPU tests.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

DEVICE = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))
SKIP_REASON = "needs a CUDA GPU (scripts/gpu_check.sh runs these on one)"
_skip_without_gpu = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=SKIP_REASON)


def gpu_test(fn: Callable) -> Callable:
    """Marks a test ``gpu`` and skips it, with the reason, where CUDA is missing (a module-level ``pytestmark`` would
    do the same for a whole file)."""
    return pytest.mark.gpu(_skip_without_gpu(fn))


def record(test: str, **values: Any) -> None:
    """One measurement: printed, and appended to ``$GPU_CHECK_OUT/measurements.jsonl`` for the summary."""
    line = json.dumps({"test": test, "device": DEVICE.type, **values}, default=str)
    print(f"\nGPU_CHECK {line}", flush=True)
    out = os.environ.get("GPU_CHECK_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "measurements.jsonl", "a") as f:
            f.write(line + "\n")


# -- several processes on one GPU ------------------------------------------------------------------------------------
# NCCL refuses two ranks on one GPU: at init every rank compares its (host hash, bus id) with every other rank's and
# fails with "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..." (ncclInvalidUsage; the check is in
# NCCL's init.cc since 2.5, quoted in NVIDIA/nccl#418; NVIDIA/nccl#103: "no longer possible to have multiple ranks use
# the same GPU since NCCL 2.5"). The host hash is the hostname's, unless NCCL_HOSTID overrides it (src/misc/utils.cc
# getHostHash, as NVIDIA/nccl#1781 uses it to make two pods one host). A distinct NCCL_HOSTID per rank makes each rank
# a host of its own, so the check passes and NCCL connects the ranks through its network transport (sockets on the
# loopback here); P2P and SHM are only ever tried between ranks of one host, disabled anyway below. NCCL's maintainer
# warned that the topology search does not work for ranks sharing a GPU (NVIDIA/nccl#418), so whether it accepts is
# an experiment: ``shared_gpu()`` runs it once per session and the one-GPU tests use NCCL if it did, else gloo with
# CUDA tensors (gloo has all-reduce and broadcast for them, no send/recv or all-gather: pairs and int8 are skipped).
ONE_GPU_NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
ONE_GPU_BACKEND_ENV = "GPU_CHECK_ONE_GPU_BACKEND"  # auto (the experiment decides), nccl or gloo
UNEXERCISED_ON_GLOO = ("point-to-point pairs (ring, one-peer-exp, complete of 2) and int8's all-gather: gloo has no "
                       "CUDA send/recv or all-gather; FSDP2's all-gather and reduce-scatter; NCCL's streams and events")


def _spawned(fn: Callable[..., Any], rank: int, world_size: int, workdir: str, args: tuple, backend: str,
             one_gpu: bool, hostid: bool) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        options: dict[str, Any] = {}
        if DEVICE.type == "cuda":
            device = torch.device("cuda", 0 if one_gpu else rank)
            torch.cuda.set_device(device)
            if backend == "nccl":
                options["device_id"] = device  # as decent_train/runtime.py: communicators made at init
                if one_gpu:
                    for key, value in ONE_GPU_NCCL_ENV.items():
                        os.environ.setdefault(key, value)
                    if hostid:
                        os.environ["NCCL_HOSTID"] = f"decent-train-gpu-check-rank{rank}"
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60),
                                **options)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, backend: str | None = None,
                one_gpu: bool = False, hostid: bool = True) -> list[Any]:
    """tests/distributed.py's runner with spawn, not fork (a forked child cannot use CUDA once the parent has): NCCL
    on CUDA, gloo on the CPU, unless ``backend`` says; ``one_gpu``: every rank on GPU 0 (with a distinct NCCL_HOSTID
    each unless ``hostid`` is false: see above). ``fn`` must be a module-level function."""
    ctx = multiprocessing.get_context("spawn")
    backend = backend or ("nccl" if DEVICE.type == "cuda" else "gloo")
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_spawned, args=(fn, r, world_size, workdir, args, backend, one_gpu, hostid))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1.0)
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = [f"--- rank {r} ---\n{open(path).read()}" for r in range(world_size)
                  if os.path.exists(path := os.path.join(workdir, f"error{r}.txt"))]
        if errors:
            raise AssertionError("\n".join(errors))
        if any(p.exitcode != 0 for p in procs):
            raise AssertionError(f"workers timed out after {timeout}s or died: {[p.exitcode for p in procs]}")
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(world_size)]


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _probe_worker(rank: int, world_size: int) -> dict[str, Any]:
    """What the one-GPU tests need of the backend, on the device: an all-reduce, a pair's batched send and receive,
    an all-gather; each rank's values."""
    device = torch.device(DEVICE.type, torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE
    summed = torch.full((4096,), float(rank + 1), device=device)
    dist.all_reduce(summed)
    received = torch.zeros(4096, device=device)
    peer = (rank + 1) % world_size
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full_like(received, 10.0 + rank), peer),
                                        dist.P2POp(dist.irecv, received, (rank - 1) % world_size)]):
        work.wait()
    gathered = [torch.zeros(2, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([rank, -rank], dtype=torch.float32, device=device))
    return {"all_reduce": summed.unique().tolist(), "received": received.unique().tolist(),
            "all_gather": [g.tolist() for g in gathered]}


def _probe_is_right(ranks: list[dict[str, Any]]) -> bool:
    n = len(ranks)
    return all(r["all_reduce"] == [n * (n + 1) / 2] and r["received"] == [10.0 + (i - 1) % n]
               and r["all_gather"] == [[j, -j] for j in range(n)] for i, r in enumerate(ranks))


def _first_error_line(error: AssertionError) -> str:
    """NCCL's reason ("Duplicate GPU detected : ..."), else the last line naming an error, of the workers' tracebacks."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    duplicate = [line for line in lines if "Duplicate GPU" in line]
    named = duplicate[:1] or [line for line in lines if "Error" in line or "error" in line][-1:]
    return (named or lines[-1:] or ["?"])[0][:400]


@functools.cache
def shared_gpu() -> dict[str, Any]:
    """The experiment (once per session): 2 ranks on GPU 0 with NCCL and distinct NCCL_HOSTIDs, and without them (the
    control: NCCL is expected to refuse); ``backend`` the one-GPU tests use. On the CPU: gloo, probed the same way."""
    forced = os.environ.get(ONE_GPU_BACKEND_ENV, "auto")
    if forced not in ("auto", "nccl", "gloo"):
        raise ValueError(f"{ONE_GPU_BACKEND_ENV}={forced!r}: valid are auto, nccl, gloo")
    if DEVICE.type != "cuda":
        ranks = run_spawned(_probe_worker, 2, backend="gloo", timeout=120)
        return {"backend": "gloo", "device": "cpu", "probe": ranks, "probe_right": _probe_is_right(ranks)}
    outcome: dict[str, Any] = {"device": "cuda", "nccl_env": {**ONE_GPU_NCCL_ENV, "NCCL_HOSTID": "per rank"}}
    for name, hostid in (("with_hostid", True), ("without_hostid", False)):
        t0 = time.perf_counter()
        try:
            ranks = run_spawned(_probe_worker, 2, backend="nccl", one_gpu=True, hostid=hostid,
                                timeout=90 if hostid else 45)  # the control is expected to fail at init
            outcome[name] = "accepted" if _probe_is_right(ranks) else f"accepted, wrong values: {ranks}"
        except AssertionError as error:
            outcome[name] = f"refused: {_first_error_line(error)}"
            outcome[f"{name}_error"] = str(error)[-3000:]
        outcome[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
    accepted = outcome["with_hostid"] == "accepted"
    outcome["backend"] = forced if forced != "auto" else "nccl" if accepted else "gloo"
    if outcome["backend"] == "gloo":
        outcome["unexercised"] = UNEXERCISED_ON_GLOO
    return outcome


def one_gpu_backend_or_skip(needs_pairs: bool) -> str:
    """The backend of the one-GPU tests; skips a case gloo cannot run with CUDA tensors."""
    backend = shared_gpu()["backend"]
    if DEVICE.type == "cuda" and backend == "gloo" and needs_pairs:
        pytest.skip(f"NCCL refused ranks sharing the GPU; gloo with CUDA tensors cannot run this: {UNEXERCISED_ON_GLOO}")
    return backend
