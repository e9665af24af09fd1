"""Live fault tolerance of the gossip engine: real SIGKILLs, torch 2.14's reconfigurable gloo groups, a float64 oracle.

The documented rule (engine/ddp.py, engine/modes.py ``ModeContext._wait_each``, engine/exchange.py ``settle``):

* With ``fault_tolerant=True`` a peer's message that never arrives (the peer was SIGKILLed) is replaced by the
  receiver's own value: that edge's weight stays with the receiver for that step and bucket, and
  ``engine.missed_messages`` lists it as (step, bucket index, peer rank).
* At a membership change (every survivor at the same step E, between steps): ``prepare_membership_change()``
  completes the exchange in flight and drops it on every member; the default group is reconfigured over the
  survivors; ``membership_changed("ring", local_world_size=len(survivors))`` launches the current values x^E over the
  new topology's round 0 (its rounds counted from E), and the next step mixes that. Nothing is repeated or lost.

Steps count from 0 as the engine's ``step_count`` does: step s takes x^s (the parameters before its forward) to
x^{s+1}, and for each worker i and bucket b::

    x_i^{s+1}[b] = sum_j W'(s)_ij x_j^s[b] - lr * grad f_i(x_i^s)[b]

where W'(s) is ring's mixing matrix of the round of step s (4 members: round 0 pairs (0,1),(2,3), round 1 pairs
(0,3),(1,2), weight 1/2 each; 3 members: one group (0,1,2), uniform 1/3; rounds counted from the phase's first step)
with the weight of every (s, b, peer) in i's ``missed_messages`` moved to i. Step 0 mixes nothing (nothing was
launched before it; the workers start equal), and the first step after the change at E mixes x^E over the new
topology's round 0, never the exchange that was in flight at E. The gradient is taken at the un-mixed x_i^s.
The misses that ``prepare_membership_change()`` records while it completes the dropped exchange carry step E and the
old ranks; they belong to no mix, so the test keeps them apart (they must all be of the victim).

How the tests run: the parent hosts a TCPStore; each member is a forked process with a stable member id that
``reconfigure.join``s and then ``reconfigure``s into epoch 0 (ids [0, 1, 2, 3], a fresh uuid per epoch). Member 2
SIGKILLs itself (test 1: at a step boundary, or inside backward once its first bucket has mixed, stepped and launched
its next exchange); the survivors train on with it missing, then reconfigure over [0, 1, 3] at step E. Every member
writes its parameters at the start of every step to a file (the victim too, and in the backward variant its
half-updated parameters just before it dies), so the parent replays each survivor's steps from the recorded values,
with the gradients computed here by autograd on a fresh float64 model. Test 2 heals a new member (id 4) from a donor
(training/heal_state.py ``send_state``) and checks the joiner's state equals the donor's bit for bit. No member runs a
collective with a dead one; every child has an alarm and the parent a deadline, so the suite never hangs.
"""

from __future__ import annotations

import copy
import faulthandler
import multiprocessing
import os
import random
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from decent_train import DecentralizedDataParallel
from decent_train.engine import reconfigure
from decent_train.training.heal_state import receive_state, send_state

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)

if not reconfigure.supported():
    pytest.skip("live membership needs torch >= 2.14 (reconfigurable gloo process groups)", allow_module_level=True)

TOL = 1e-12
LR = 0.1
BUCKET_MB = 0.0004  # 419 bytes: one bucket per layer of the model below (checked)
TIMEOUT = timedelta(seconds=20)  # store, gloo and reconfigure; never reached in a passing run
ENGINE_TIMEOUT_S = 15.0  # an exchange that hangs fails with the engine's error instead of the alarm
CHILD_LIMIT_S = 45  # each member's alarm
PARENT_LIMIT_S = 60.0  # the parent kills whatever is left after this

FOUNDERS = [0, 1, 2, 3]
VICTIM = 2
SURVIVORS = [0, 1, 3]
JOINER = 4

KILL_STEP = 3
CHANGE_STEP = KILL_STEP + 3  # E
STEPS = CHANGE_STEP + 3


# -- the model, its data, its optimizers ------------------------------------------------------------------------------
def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(member: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7919 * member + 131 * step + 17)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)


def loss_of(model: nn.Module, member: int, step: int) -> Tensor:
    x, y = batch(member, step)
    return ((model(x) - y) ** 2).mean()


def plain_sgd(named: list[tuple[str, Tensor]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=LR, momentum=0.0)


def momentum_sgd(named: list[tuple[str, Tensor]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)


def params_of(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- the harness: a store in the parent, one forked process per member ------------------------------------------------
def _child(fn: Callable[..., Any], member: int, ctx: dict[str, Any]) -> None:
    code = 1
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(CHILD_LIMIT_S)
        stacks = open(os.path.join(ctx["workdir"], f"stacks{member}.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the parent asks a hung member
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", wait_for_port(ctx["workdir"]), is_master=False, timeout=TIMEOUT)
        # DECENT_TRAIN_LIVE_DATA_BACKEND=gloo (the two-group layout's tests): a data group beside the default one
        reconfigure.join(store, member, TIMEOUT, data_backend=reconfigure.data_backend_for("cpu"))
        result = fn(member, store, ctx)
        torch.save(result, os.path.join(ctx["workdir"], f"result{member}.pt"))
        code = 0
    except BaseException:
        with open(os.path.join(ctx["workdir"], f"error{member}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


def wait_for_port(workdir: str) -> int:
    path, deadline = os.path.join(workdir, "port"), time.monotonic() + TIMEOUT.total_seconds()
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError("the parent's store did not start")
        time.sleep(0.005)
    with open(path) as f:
        return int(f.read())


def run_members(fn: Callable[..., Any], members: list[int], killed: tuple[int, ...], workdir: str,
                **ctx: Any) -> dict[int, Any]:
    """``fn(member, store, ctx)`` in a forked process per member; the results of those not in ``killed``, which
    must die of SIGKILL. Each epoch's uuid is fresh (``ctx["uuids"][epoch]``). The parent hosts the store, started
    after the forks; its port reaches the members through a file."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)  # imports torch._dynamo once, before the forks
    draw = random.SystemRandom()
    ctx = {**ctx, "workdir": workdir, "uuids": {e: draw.randrange(1, 2**30) * 8 + e for e in range(4)}}
    fork = multiprocessing.get_context("fork")
    procs = {m: fork.Process(target=_child, args=(fn, m, ctx)) for m in members}
    for p in procs.values():  # forked before the store's server thread exists: no lock of it is copied held
        p.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    with open(os.path.join(workdir, "port.tmp"), "w") as f:
        f.write(str(store.port))
    os.rename(os.path.join(workdir, "port.tmp"), os.path.join(workdir, "port"))
    deadline = time.monotonic() + PARENT_LIMIT_S
    expected = {m: -signal.SIGKILL if m in killed else 0 for m in members}
    while any(p.is_alive() for p in procs.values()) and time.monotonic() < deadline:
        if any(p.exitcode is not None and p.exitcode != expected[m] for m, p in procs.items()):
            time.sleep(0.5)  # one failed: the others may wait on it
            break
        time.sleep(0.02)
    hung = [m for m, p in procs.items() if p.is_alive()]
    for m in hung:
        os.kill(procs[m].pid, signal.SIGUSR1)  # where it hangs, into stacks{m}.txt
    time.sleep(0.3 if hung else 0)
    for p in procs.values():
        if p.is_alive():
            p.kill()
        p.join()
    del store
    errors = [f"--- member {m} ---\n{open(path).read()}" for m in members
              if os.path.exists(path := os.path.join(workdir, f"error{m}.txt"))]
    errors += [f"--- member {m} hung here ---\n{open(path).read()}" for m in hung
               if os.path.exists(path := os.path.join(workdir, f"stacks{m}.txt"))]
    if errors:
        raise AssertionError("\n".join(errors))
    codes = {m: p.exitcode for m, p in procs.items()}
    assert codes == expected, f"exit codes {codes}, expected {expected} (a member hung past {PARENT_LIMIT_S} s?)"
    return {m: torch.load(os.path.join(workdir, f"result{m}.pt"), weights_only=False)
            for m in members if m not in killed}


def enter_epoch(store: dist.Store, ctx: dict[str, Any], epoch: int, members: list[int], member: int) -> None:
    if not reconfigure.reconfigure(store, epoch, ctx["uuids"][epoch], members, member, TIMEOUT):
        raise RuntimeError(f"member {member}: epoch {epoch} over {members} did not come together")
    assert dist.get_rank() == members.index(member) and dist.get_world_size() == len(members)


def finish(engine: DecentralizedDataParallel, store: dist.Store, members: list[int], member: int) -> None:
    """Complete the last exchange in flight, then leave only when every member has (no one's exit cuts a message)."""
    engine.prepare_membership_change()
    leave_when_all_finished(store, members, member)


def leave_when_all_finished(store: dist.Store, members: list[int], member: int) -> None:
    """Count this member finished and wait for the others (no one's exit cuts a message another still waits for)."""
    store.add("finished", 1)
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while store.add("finished", 0) < len(members):
        if time.monotonic() > deadline:
            raise RuntimeError(f"member {member}: the others did not finish")
        time.sleep(0.005)


def save_params(workdir: str, model: nn.Module, member: int, step: int, tag: str = "x") -> None:
    torch.save(params_of(model), os.path.join(workdir, f"{tag}_{member}_{step}.pt"))


def load_params(workdir: str, member: int, step: int, tag: str = "x") -> dict[str, Tensor] | None:
    path = os.path.join(workdir, f"{tag}_{member}_{step}.pt")
    return torch.load(path, weights_only=True) if os.path.exists(path) else None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# -- test 1: the survivors follow the documented rule through a kill and a shrink --------------------------------------
def _train_through_failure(member: int, store: dist.Store, ctx: dict[str, Any]) -> dict[str, Any]:
    workdir, where = ctx["workdir"], ctx["where"]
    enter_epoch(store, ctx, 0, FOUNDERS, member)
    engine = DecentralizedDataParallel(
        make_model(100 + member), plain_sgd, topology="ring", fault_tolerant=True, bucket_size_in_mb=BUCKET_MB,
        local_world_size=len(FOUNDERS), timeout=ENGINE_TIMEOUT_S,
    )
    params = dict(engine.module.named_parameters())
    if member == VICTIM and where == "backward":
        def kill_in_backward(_: Tensor) -> None:  # the first of bucket 1's gradients: bucket 0 has just launched
            if engine.step_count == KILL_STEP:
                save_params(workdir, engine.module, member, KILL_STEP, tag="dying")
                die()

        for name in engine.bucket_names[1]:  # registered after the engine's own hooks, so they run after them
            params[name].register_post_accumulate_grad_hook(kill_in_backward)
    missed_before = missed_during = None
    for s in range(STEPS):
        if s == CHANGE_STEP:
            missed_before = len(engine.missed_messages)
            engine.prepare_membership_change()
            missed_during = len(engine.missed_messages)
            enter_epoch(store, ctx, 1, SURVIVORS, member)
            engine.membership_changed("ring", local_world_size=len(SURVIVORS))
        save_params(workdir, engine.module, member, s)
        if member == VICTIM and s == KILL_STEP and where == "boundary":
            die()
        loss_of(engine, member, s).backward()
    save_params(workdir, engine.module, member, STEPS)
    missed = list(engine.missed_messages)
    finish(engine, store, SURVIVORS, member)
    data = reconfigure.data_group()
    return {
        # the group the engine exchanged over, after the change: the data group (two groups) or the default one
        "layout": None if data is None else {
            "exchanges_over_it": engine._members.exchange_group is data and engine._context.exchanger.group is data,
            "is_default": data is dist.group.WORLD, "size": data.size(), "rank": data.rank(),
        },
        "buckets": engine.bucket_names,
        "step": engine.step_count,
        "missed": missed[:missed_before] + missed[missed_during:],  # the steps' mixes
        "missed_dropped": missed[missed_before:missed_during],  # the exchange prepare_membership_change dropped
    }


def ring_row(member: int, s: int) -> tuple[dict[int, float], dict[int, int]]:
    """Row ``member`` of W(s) by member id (step s >= 1), and the members' ranks in that phase."""
    if s >= CHANGE_STEP:  # 3 members: one uniform group in both rounds, rounds counted from E
        return {m: 1.0 / 3.0 for m in SURVIVORS}, {m: r for r, m in enumerate(SURVIVORS)}
    pairs = [(0, 1), (2, 3)] if s % 2 == 0 else [(0, 3), (1, 2)]
    peer = next(b if a == member else a for a, b in pairs if member in (a, b))
    return {member: 0.5, peer: 0.5}, {m: m for m in FOUNDERS}


def gradient(member: int, s: int, x: dict[str, Tensor]) -> dict[str, Tensor]:
    model = make_model(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(x[name])
    loss_of(model, member, s).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["one group", "two groups"])
@pytest.mark.parametrize("where", ["boundary", "backward"])
def test_survivors_follow_the_documented_rule(where: str, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Acceptance: the survivors' parameters (and their mean) after the failure step are what the documented rule
    says, to 1e-12 in float64 on the engine level. "two groups": the layout of a GPU worker (the data over a group
    of its own, reconfigured with the default group at every change), gloo standing in for nccl2."""
    if layout == "two groups":
        monkeypatch.setenv(reconfigure.DATA_BACKEND_ENV, "gloo")
    with tempfile.TemporaryDirectory() as workdir:
        results = run_members(_train_through_failure, FOUNDERS, (VICTIM,), workdir, where=where)
        x = {m: {} for m in FOUNDERS}
        for m in FOUNDERS:
            for s in range(STEPS + 1):
                if (values := load_params(workdir, m, s)) is not None:
                    x[m][s] = values
        dying = load_params(workdir, VICTIM, KILL_STEP, tag="dying")

    for m in SURVIVORS:  # the layout asked for was the one used
        expected = None if layout == "one group" else {
            "exchanges_over_it": True, "is_default": False, "size": len(SURVIVORS), "rank": SURVIVORS.index(m)}
        assert results[m]["layout"] == expected, (m, results[m]["layout"])
    buckets = results[0]["buckets"]
    assert len(buckets) >= 2 and buckets[0] == ["4.bias", "4.weight"], buckets
    assert all(r["buckets"] == buckets and r["step"] == STEPS for r in results.values())
    assert all(len(x[m]) == STEPS + 1 for m in SURVIVORS)
    assert sorted(x[VICTIM]) == list(range(KILL_STEP + 1)), "the victim records x^0..x^K, then dies"
    sent = {(VICTIM, s): values for s, values in x[VICTIM].items()}  # what the victim could have sent at step s
    if where == "backward":  # it died with bucket 0 mixed, stepped and launched, the others untouched
        assert dying is not None
        assert all(not torch.equal(dying[n], x[VICTIM][KILL_STEP][n]) for n in buckets[0])
        assert all(torch.equal(dying[n], x[VICTIM][KILL_STEP][n]) for b in buckets[1:] for n in b)
        sent[(VICTIM, KILL_STEP + 1)] = {n: dying[n] for n in buckets[0]}
    else:
        assert dying is None

    # Every miss is of the victim, after it died; the exchange dropped at E is all of the victim too.
    for m, r in results.items():
        assert all(peer == VICTIM and s >= KILL_STEP for s, _, peer in r["missed"]), (m, r["missed"])
        assert all(s < CHANGE_STEP for s, _, _ in r["missed"]), (m, r["missed"])
        assert all(s == CHANGE_STEP and peer == VICTIM for s, _, peer in r["missed_dropped"]), (m, r["missed_dropped"])
    assert results[1]["missed"] and results[3]["missed"], "the victim's ring neighbours must have missed messages"
    assert not results[0]["missed"], "member 0 never exchanges with the victim in a ring of 4"

    worst, arrived_from_victim = 0.0, []
    grads = {(m, s): gradient(m, s, x[m][s]) for m in SURVIVORS for s in range(STEPS)}
    for i in SURVIVORS:
        missed = set(results[i]["missed"])
        for s in range(STEPS):
            row, ranks = ring_row(i, s) if s > 0 else ({i: 1.0}, {i: i})
            for b, names in enumerate(buckets):
                for name in names:
                    mixed = torch.zeros_like(x[i][s][name])
                    for j, weight in row.items():
                        if j == i or (s, b, ranks[j]) in missed:
                            value = x[i][s][name]
                        else:  # arrived: what j sent at step s, x_j^s (the victim's half step, if it died in one)
                            value = sent.get((j, s), x[j].get(s, {})).get(name)
                            assert value is not None, f"member {i} mixed a message of {j} at step {s} never sent"
                            if j == VICTIM:
                                arrived_from_victim.append(s)
                        mixed += weight * value
                    want = mixed - LR * grads[(i, s)][name]
                    worst = max(worst, (x[i][s + 1][name] - want).abs().max().item())
    assert worst <= TOL, f"a survivor's parameters differ from the documented rule by {worst:.3g}"

    # The survivors' mean is kept once no message of the victim arrives any more (W' is doubly stochastic on them).
    last = max(arrived_from_victim, default=0)
    assert last <= KILL_STEP + 1, last
    checked = range(last + 1, STEPS)
    assert CHANGE_STEP in checked and len(checked) >= 4
    worst_mean = 0.0
    for s in checked:
        for name in (n for names in buckets for n in names):
            before = torch.stack([x[i][s][name] - LR * grads[(i, s)][name] for i in SURVIVORS]).mean(0)
            after = torch.stack([x[i][s + 1][name] for i in SURVIVORS]).mean(0)
            worst_mean = max(worst_mean, (after - before).abs().max().item())
    assert worst_mean <= TOL, f"the survivors' mean moved by {worst_mean:.3g} beyond their mean gradient step"


# -- test 2: a new member heals from a live donor ---------------------------------------------------------------------
HEAL_KILL, HEAL_SHRINK, HEAL_JOIN = 2, 4, 6
HEALED = [0, 1, 3, JOINER]
DONOR = HEALED[HEALED.index(JOINER) - 1]
AFTER_JOIN = 2


def snapshot(engine: DecentralizedDataParallel) -> dict[str, Any]:
    return {
        "params": params_of(engine.module),
        "optimizers": [copy.deepcopy(o.state_dict()) for o in engine.optimizers],
        "step": engine.step_count,
    }


def _heal(member: int, store: dist.Store, ctx: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if member == JOINER:
        enter_epoch(store, ctx, 2, HEALED, member)
        engine = DecentralizedDataParallel(
            make_model(100 + member), momentum_sgd, topology="ring", fault_tolerant=True,
            bucket_size_in_mb=BUCKET_MB, local_world_size=len(HEALED), timeout=ENGINE_TIMEOUT_S, from_rank0=False,
        )
        state, _ = receive_state(HEALED.index(DONOR))
        engine.load_state_dict(state["model"])
        engine.load_engine_state_dict({**state["engine"], "averaged_from": 1})
        result["healed"] = snapshot(engine)
        engine.membership_changed("ring", local_world_size=len(HEALED))
        start = HEAL_JOIN
    else:
        enter_epoch(store, ctx, 0, FOUNDERS, member)
        engine = DecentralizedDataParallel(
            make_model(100 + member), momentum_sgd, topology="ring", fault_tolerant=True,
            bucket_size_in_mb=BUCKET_MB, local_world_size=len(FOUNDERS), timeout=ENGINE_TIMEOUT_S,
        )
        for s in range(HEAL_JOIN):
            if member == VICTIM and s == HEAL_KILL:
                die()
            if s == HEAL_SHRINK:
                engine.prepare_membership_change()
                enter_epoch(store, ctx, 1, SURVIVORS, member)
                engine.membership_changed("ring", local_world_size=len(SURVIVORS))
            loss_of(engine, member, s).backward()
        engine.prepare_membership_change()
        enter_epoch(store, ctx, 2, HEALED, member)
        if member == DONOR:
            engine_state = DecentralizedDataParallel.averageable_state(engine.engine_state_dict())
            send_state({"model": engine.state_dict(), "engine": engine_state}, HEALED.index(JOINER))
            result["healed"] = snapshot(engine)
        engine.membership_changed("ring", local_world_size=len(HEALED))
        start = HEAL_JOIN
    missed_before = len(engine.missed_messages)
    for s in range(start, start + AFTER_JOIN):
        loss_of(engine, member, s).backward()
    result["missed_after_join"] = engine.missed_messages[missed_before:]
    result["step"] = engine.step_count
    result["params"] = params_of(engine.module)
    finish(engine, store, HEALED, member)
    return result


def assert_same(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` equal bit for bit: tensors by ``torch.equal`` (and dtype), containers item by item."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for k, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_joiner_heals_bit_for_bit_from_its_donor() -> None:
    """Acceptance: after healing the joiner's state equals its donor's bit for bit (parameters, every optimizer
    state tensor, the step), after a kill and a shrink to [0, 1, 3]; then the 4 members train on without error."""
    with tempfile.TemporaryDirectory() as workdir:
        results = run_members(_heal, FOUNDERS + [JOINER], (VICTIM,), workdir)
    joiner, donor = results[JOINER]["healed"], results[DONOR]["healed"]
    assert donor["step"] == HEAL_JOIN
    assert any(state["state"] and all("momentum_buffer" in v for v in state["state"].values())
               for state in donor["optimizers"]), "the donor's optimizers must have state to heal"
    assert_same(joiner["params"], donor["params"], "parameters")
    assert_same(joiner["optimizers"], donor["optimizers"], "optimizers")
    assert joiner["step"] == donor["step"]
    for m in HEALED:
        assert results[m]["step"] == HEAL_JOIN + AFTER_JOIN, m
        assert results[m]["missed_after_join"] == [], (m, results[m]["missed_after_join"])
        assert all(torch.isfinite(v).all() for v in results[m]["params"].values()), m
