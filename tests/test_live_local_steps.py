"""DiLoCo and LocalSGD under live membership (``fault_tolerance=live``): real SIGKILLs, torch 2.14's reconfigurable gloo
groups, a float64 replay of the outer step's rule across a change (docs/fault-tolerance.md, "Local steps under live
membership").

The rule the replay states, for DiLoCo over ``complete`` (worker i, members M of the outer step, H = ``SYNC_EVERY``)::

    after inner steps H, 2H, ...:  a = mean_{j in M} anchor_j;  g = mean_{j in M} (anchor_j - x_j)
                                   m <- mu m + g;  x_i <- a - lr (g + mu m)  (Nesterov);  anchor_i <- x_i

A member lost between outer steps leaves at the next change (a record step E between two outer steps): the inner
steps it took since the last outer step are lost with it, and the next outer step's M is the survivors: the mean is
over them (not over the old world size, and without the lost member's pseudo-gradient). At the change the anchors and
the outer momentum become their mean over the new members, which after complete outer steps that missed nothing is
what each already holds; when the lost member's messages were missed in an outer step before E (each survivor mixed
its own payload in their place), the mean makes them equal again. LocalSGD: the parameters' mean. A joiner takes its
donor's parameters, inner optimizer state, anchors, outer momentum and counters (bit for bit), and starts its inner
steps from the donor's current parameters.

How the tests run: the harness of ``test_live_engine.py`` (a store in the parent, one forked process per member, each
epoch a fresh uuid). The replay here recomputes every survivor's trajectory from the common initial model (rank 0's,
which the front broadcasts) with gradients from a fresh float64 model, independent of the front's code.
"""

from __future__ import annotations

import copy
import re
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from decent_train.algorithms.local_steps import DiLoCo, LocalSGD
from decent_train.algorithms.local_steps_algorithms import FrontAlgorithm
from decent_train.engine import reconfigure
from decent_train.training.heal_state import receive_state, send_state

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)

if not reconfigure.supported():
    pytest.skip("live membership needs torch >= 2.14 (reconfigurable gloo process groups)", allow_module_level=True)

from .test_live_engine import (  # noqa: E402  (after the skip: the harness needs reconfigurable groups)
    ENGINE_TIMEOUT_S, FOUNDERS, JOINER, SURVIVORS, VICTIM, assert_same, die, enter_epoch,
    leave_when_all_finished, loss_of, make_model, params_of, run_members,
)
from .test_live_launcher import KILL_AT, Signal, at_step, check_trained_to_the_end, launch  # noqa: E402
from .test_live_launcher import JOIN_STEPS  # noqa: E402

TOL = 1e-12
INNER_LR = 0.1
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
SYNC_EVERY = 4  # H: outer steps after inner steps 4, 8, 12
DIE_STEP = 5  # the victim dies before its inner step 5 (after the outer step at 4: it took one inner step since)
CHANGE_STEP = 6  # E: a record step between the outer steps at 4 and 8
STEPS = 12  # two outer steps over the survivors (8, 12)


def make_front(model: nn.Module, inner: torch.optim.Optimizer, world: int, from_rank0: bool = True,
               fragments: int = 1, offload: bool = False) -> DiLoCo:
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return DiLoCo(model, inner, outer, SYNC_EVERY, "complete", local_world_size=world, timeout=ENGINE_TIMEOUT_S,
                  fault_tolerant=True, from_rank0=from_rank0, fragments=fragments, offload=offload)


def inner_step(model: nn.Module, inner: torch.optim.Optimizer, member: int, step: int) -> None:
    loss_of(model, member, step).backward()
    inner.step()  # the front's hook takes the outer step after every SYNC_EVERY-th
    inner.zero_grad(set_to_none=True)


def front_state(front: DiLoCo) -> dict[str, Any]:
    """What the replay compares: the parameters, the anchors and the outer momentum, by parameter name."""
    names = [n for n, _ in front.model.named_parameters()]
    params = list(front.model.parameters())
    return {
        "x": params_of(front.model),
        "anchor": dict(zip(names, [a.clone() for a in front.anchors()])),
        "momentum": {n: front.outer.state[p]["momentum_buffer"].clone() for n, p in zip(names, params)},
        "outer_steps": front.outer_steps,
    }


def leave_together(front: DiLoCo, store: dist.Store, members: list[int], member: int) -> None:
    """Leave only when every member is done (no one's exit cuts a message another still waits for)."""
    front.__exit__(None, None, None)
    leave_when_all_finished(store, members, member)


# -- test 1: the outer steps after a member is lost follow the rule ---------------------------------------------------
# case: (E, front, offload). At 10 the outer step at 8 ran without the victim; "streaming": 2 fragments, one synced
# every 2 inner steps (fragment 0 at 2, 6, 10; fragment 1 at 4, 8, 12), fragment 0's at 6 without the victim.
# "-offload": the outer state in host memory (CUDA's default), the same rule: the change's mean runs on device copies
# of it, a part at a time (here host to host: the CPU runs the same code path).
CASES = {"between": (CHANGE_STEP, "diloco", False), "window": (10, "diloco", False),
         "localsgd": (10, "localsgd", False), "streaming": (CHANGE_STEP, "streaming", False),
         "window-offload": (10, "diloco", True), "localsgd-offload": (10, "localsgd", True),
         "streaming-offload": (CHANGE_STEP, "streaming", True)}
FRAGMENTS = [["0.weight", "0.bias"], ["2.weight", "2.bias", "4.weight", "4.bias"]]  # split_parameters' cut, by hand


def _train_through_loss(member: int, store: dist.Store, ctx: dict[str, Any]) -> dict[str, Any]:
    enter_epoch(store, ctx, 0, FOUNDERS, member)
    model = make_model(100 + member)  # the front starts every member from rank 0's (member 0's)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    if ctx["kind"] == "localsgd":
        front: DiLoCo = LocalSGD(model, inner, SYNC_EVERY, "complete", local_world_size=len(FOUNDERS),
                                 timeout=ENGINE_TIMEOUT_S, fault_tolerant=True, offload=ctx["offload"])
        front.__enter__()
    else:
        front = make_front(model, inner, len(FOUNDERS), fragments=len(FRAGMENTS) if ctx["kind"] == "streaming" else 1,
                           offload=ctx["offload"])
        front.__enter__()
    assert front.offloaded == ctx["offload"]
    for s in range(STEPS):
        if member == VICTIM and s == DIE_STEP:
            die()
        if s == ctx["change"]:
            front.prepare_membership_change()
            enter_epoch(store, ctx, 1, SURVIVORS, member)
            front.membership_changed("complete", len(SURVIVORS))
            on_device = front.memory_bytes()["device"]
        inner_step(model, inner, member, s)
    localsgd = ctx["kind"] == "localsgd"
    result = front_state(front) if not localsgd else {"x": params_of(model), "outer_steps": front.outer_steps}
    result["missed"] = list(front.exchange.missed)
    result["device_bytes_after_change"] = on_device
    leave_together(front, store, SURVIVORS, member)
    return result


Params = dict[str, Tensor]


def _mean(values: list[Params], divisor: int | None = None) -> Params:
    return {n: sum(v[n] for v in values) / (divisor or len(values)) for n in values[0]}


def _period(kind: str) -> int:
    return SYNC_EVERY // len(FRAGMENTS) if kind == "streaming" else SYNC_EVERY


def _replay(variant: str, case: str) -> dict[int, dict[str, Params]]:
    """Every survivor's parameters, anchors and outer momentum after STEPS inner steps, by the rule (``right``) or a
    wrong variant: ``old_world`` (the survivors' sum over the old world size), ``lost_included`` (the lost member's
    pseudo-gradient at its death kept in the mean), ``no_average`` (no mean of the anchors and momentum at E).
    LocalSGD: the parameters only, each outer step their mean (it keeps no anchors); streaming: each outer step
    steps one fragment's parameters (their momentum only), in turn.

    Before E a dead member's message is missed: each survivor mixes its own payload in its place (x and anchor).
    """
    change, kind, _ = CASES[case]
    localsgd, period = kind == "localsgd", _period(kind)
    start = params_of(make_model(100 + FOUNDERS[0]))
    x = {m: dict(start) for m in FOUNDERS}
    anchor = {m: dict(start) for m in FOUNDERS}
    momentum: dict[int, Params] = {}
    model = make_model(0)
    for s in range(STEPS):
        alive = FOUNDERS if s < DIE_STEP else SURVIVORS
        if s == change and variant != "no_average":
            anchor |= dict.fromkeys(SURVIVORS, _mean([anchor[m] for m in SURVIVORS]))
            if momentum:
                momentum |= dict.fromkeys(SURVIVORS, _mean([momentum[m] for m in SURVIVORS]))
        if s == change and variant == "lost_included":
            lost = {n: anchor[VICTIM][n] - x[VICTIM][n] for n in start}  # what it held when it died
        for m in alive:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(x[m][name])
                    p.grad = None
            loss_of(model, m, s).backward()
            x[m] = {n: x[m][n] - INNER_LR * p.grad for n, p in model.named_parameters()}
        if (s + 1) % period:
            continue
        names = FRAGMENTS[((s + 1) // period - 1) % len(FRAGMENTS)] if kind == "streaming" else list(start)
        world = FOUNDERS if s < change else SURVIVORS
        stepped = {}
        for i in alive:
            sent = [i if j not in alive else j for j in world]  # a dead member's message: i's own payload
            if localsgd:
                stepped[i] = ({}, _mean([x[j] for j in sent], len(FOUNDERS) if variant == "old_world" else None))
                continue
            a = _mean([{n: anchor[j][n] for n in names} for j in sent])
            g = _mean([{n: anchor[j][n] - x[j][n] for n in names} for j in sent],
                      len(FOUNDERS) if variant == "old_world" and s >= change else None)
            if variant == "lost_included" and s >= change:
                g = {n: (g[n] * len(sent) + lost[n]) / (len(sent) + 1) for n in names}
            held = momentum.get(i, {})
            m_i = {n: OUTER_MOMENTUM * held[n] + g[n] if n in held else g[n] for n in names}
            stepped[i] = (m_i, {n: a[n] - OUTER_LR * (g[n] + OUTER_MOMENTUM * m_i[n]) for n in names})
        for i, (m_i, new) in stepped.items():
            momentum[i] = {**momentum.get(i, {}), **m_i}
            anchor[i], x[i] = {**anchor[i], **new}, {**x[i], **new}
    if localsgd:
        return {m: {"x": x[m]} for m in SURVIVORS}
    return {m: {"x": x[m], "anchor": anchor[m], "momentum": momentum[m]} for m in SURVIVORS}


def _worst(results: dict[int, dict[str, Any]], replayed: dict[int, dict[str, Params]]) -> float:
    return max((results[m][key][n] - replayed[m][key][n]).abs().max().item()
               for m in SURVIVORS for key in replayed[m] for n in replayed[m][key])


@pytest.fixture(scope="module", params=list(CASES))
def through_loss(request: pytest.FixtureRequest) -> tuple[str, dict[int, dict[str, Any]]]:
    """The survivors' results of one run per case (``CASES``), shared by the tests of that case."""
    with tempfile.TemporaryDirectory() as workdir:
        change, kind, offload = CASES[request.param]
        return request.param, run_members(_train_through_loss, FOUNDERS, (VICTIM,), workdir, change=change, kind=kind,
                                          offload=offload)


def test_outer_steps_after_a_loss_average_over_the_survivors(
    through_loss: tuple[str, dict[int, dict[str, Any]]],
) -> None:
    """Acceptance 4's replay: every survivor's parameters, anchors and outer momentum after the outer steps over the
    survivors equal the rule's float64 replay to 1e-12: the victim dies between the outer steps at 4 and 8 and the
    members change at 6 (no outer message missed), or at 10 (the outer step at 8 missed the victim's messages, each
    survivor kept its weight; the mean at E makes the anchors and momentum equal again). LocalSGD, the window case:
    the parameters' mean over the survivors. Streaming (2 fragments, ``fragment_sync_delay=0``): nothing is in flight
    at E, each fragment's outer steps follow the rule."""
    case, results = through_loss
    change, kind, _ = CASES[case]
    localsgd, period = kind == "localsgd", _period(kind)
    in_window = any(t % period == 0 for t in range(DIE_STEP + 1, change + 1))  # an outer step without the victim
    for r in results.values():
        assert r["outer_steps"] == STEPS // period, r["outer_steps"]
        assert r["missed"] == ([(1, FOUNDERS.index(VICTIM))] if in_window else []), r["missed"]
    worst = _worst(results, _replay("right", case))
    assert worst <= TOL, f"the survivors differ from the rule's replay by {worst:.3g}"
    if CASES[case][2]:  # offloaded: the change leaves nothing of the front on the device (the front's own accounting)
        assert all(r["device_bytes_after_change"] == 0 for r in results.values()), results
    for key in ("anchor", "momentum") if not localsgd else ():  # complete: equal everywhere after an outer step
        assert all((results[m][key][n] - results[SURVIVORS[0]][key][n]).abs().max() <= TOL
                   for m in SURVIVORS for n in results[m][key]), key


@pytest.mark.parametrize(("through_loss", "variant"), [("between", "old_world"), ("between", "lost_included"),
                                                      ("window", "no_average"), ("localsgd", "old_world"),
                                                      ("streaming", "no_average"), ("window-offload", "no_average")],
                         indirect=["through_loss"])
def test_a_wrong_rule_deviates(through_loss: tuple[str, dict[int, dict[str, Any]]], variant: str) -> None:
    """The oracle can tell: a replay that averages over the old world size, keeps the lost member's
    pseudo-gradient, or skips the mean at E after a missed outer message, is far from what the survivors hold."""
    case, results = through_loss
    worst = _worst(results, _replay(variant, case))
    assert worst > 1e-4, f"the wrong variant {variant} is within {worst:.3g} of the survivors"


# -- test 2: a joiner heals all of it from its donor ------------------------------------------------------------------
SHRINK_STEP, JOIN_STEP, AFTER_JOIN = 6, 10, 6  # the join is between the outer steps at 8 and 12
HEALED = [0, 1, 3, JOINER]
DONOR = HEALED[HEALED.index(JOINER) - 1]


def snapshot(front: DiLoCo) -> dict[str, Any]:
    return {**front_state(front), "inner": copy.deepcopy(front.inner.state_dict()),
            "outer": copy.deepcopy(front.outer.state_dict()), "inner_steps": front.inner_steps,
            "syncs": [f.syncs for f in front.fragments]}


def momentum_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _heal(member: int, store: dist.Store, ctx: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if member == JOINER:
        enter_epoch(store, ctx, 2, HEALED, member)
        model = make_model(100 + member)
        inner = momentum_sgd(model)
        front = make_front(model, inner, len(HEALED), from_rank0=False, offload=ctx["offload"]).__enter__()
        state, _ = receive_state(HEALED.index(DONOR))
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["algorithm"]["inner"])
        front.load_state_dict(state["algorithm"]["front"])
        result["healed"] = snapshot(front)
        front.membership_changed("complete", len(HEALED))
    else:
        enter_epoch(store, ctx, 0, FOUNDERS, member)
        model = make_model(100 + member)
        inner = momentum_sgd(model)
        front = make_front(model, inner, len(FOUNDERS), offload=ctx["offload"]).__enter__()
        for s in range(JOIN_STEP):
            if member == VICTIM and s == DIE_STEP:
                die()
            if s == SHRINK_STEP:
                front.prepare_membership_change()
                enter_epoch(store, ctx, 1, SURVIVORS, member)
                front.membership_changed("complete", len(SURVIVORS))
            inner_step(model, inner, member, s)
        front.prepare_membership_change()
        enter_epoch(store, ctx, 2, HEALED, member)
        if member == DONOR:  # what live_changes.py's donor sends: the model and the algorithm's averageable state
            algorithm = FrontAlgorithm.averageable_state({"inner": inner.state_dict(), "front": front.state_dict()})
            send_state({"model": model.state_dict(), "algorithm": algorithm}, HEALED.index(JOINER))
            result["healed"] = snapshot(front)
        front.membership_changed("complete", len(HEALED))
    for s in range(JOIN_STEP, JOIN_STEP + AFTER_JOIN):
        inner_step(model, inner, member, s)
    result["after"] = front_state(front)
    result["missed"] = list(front.exchange.missed)
    leave_together(front, store, HEALED, member)
    return result


@pytest.mark.parametrize("offload", [False, True])
def test_a_joiner_heals_model_inner_state_anchors_and_outer_state(offload: bool) -> None:
    """After healing, the joiner's parameters, inner optimizer state, anchors, outer optimizer state and counters
    equal its donor's bit for bit; the next outer step over the four leaves every member's anchors and momentum
    equal (complete), and nobody missed a message. Offloaded too: the donor sends, and the joiner loads, host-resident
    anchors and outer state."""
    with tempfile.TemporaryDirectory() as workdir:
        results = run_members(_heal, FOUNDERS + [JOINER], (VICTIM,), workdir, offload=offload)
    joiner, donor = results[JOINER]["healed"], results[DONOR]["healed"]
    assert donor["outer_steps"] == JOIN_STEP // SYNC_EVERY and donor["inner_steps"] == JOIN_STEP
    assert donor["inner"]["state"] and donor["momentum"], "the donor must have inner and outer state to heal"
    assert_same(joiner, donor, "healed")
    last = results[DONOR]["after"]
    assert last["outer_steps"] == (JOIN_STEP + AFTER_JOIN) // SYNC_EVERY
    for m in HEALED:
        assert results[m]["missed"] == [], (m, results[m]["missed"])
        for key in ("anchor", "momentum"):
            for n, value in last[key].items():
                assert torch.allclose(results[m]["after"][key][n], value, rtol=0, atol=TOL), (m, key, n)


# -- end to end: the launcher's DiLoCo with a worker killed and its replacement healed ---------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one group", "two groups"])
def test_diloco_trains_on_through_a_kill_and_a_replacement(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Acceptance 4 on one node: ``algorithm=diloco algorithm.sync_every=10``, member 2 SIGKILLed after step 200,
    its replacement healed from a survivor: exit 0, no step repeated, accuracy >= 0.95, members 4 -> 3 -> 4.
    "two groups": as on GPUs, the workers' data over a data group beside the default group (gloo for nccl2), and
    the outer state offloaded (CUDA's default; host to host here)."""
    options = ["algorithm=diloco", "algorithm.sync_every=10", "launch.max_restarts=1"]
    if layout == "two groups":
        monkeypatch.setenv(reconfigure.DATA_BACKEND_ENV, "gloo")  # the workers inherit it
        options.append("algorithm.offload=true")
    run = launch(tmp_path, *options, signals=[Signal(at_step(KILL_AT), signal.SIGKILL, [2])], steps=JOIN_STEPS)
    check_trained_to_the_end(run)
    assert run.members() == [4, 3, 4], f"{run}"
    loss, join = run.result["membership_changes"]
    assert [lost["member"] for lost in loss["lost"]] == [2] and loss["members"] == 3, f"{run}"
    assert [j["member"] for j in join["joined"]] == [4] and join["members"] == 4 and join["heal_mb"] > 0, f"{run}"
    outer = [r["outer/step"] for r in run.records if "outer/step" in r]
    assert outer[-1] == JOIN_STEPS // 10, f"outer steps {outer}\n{run}"
    offloaded = {r["memory/outer_host_mib"] > 0 for r in run.records if "memory/outer_host_mib" in r}
    assert offloaded == {layout == "two groups"}, f"outer state in host memory: {offloaded}\n{run}"
    # every member's every change (its log's lines from LiveMembership._reconfigure) in the layout asked for
    changes = {m: re.findall(r"epoch \d+: (.*) reconfigured over \[(.*)\]", (run.run_dir / "logs" /
                                                                            f"member{m}.log").read_text())
               for m in (0, 1, 3, 4)}
    assert [len(members.split(",")) for _, members in changes[0]] == [4, 3, 4], f"{changes}"
    for m, lines in changes.items():
        for groups, members in lines:
            wanted = "default group" if layout == "one group" else \
                f"default group and data group (gloo, {len(members.split(','))} ranks)"
            assert groups == wanted, (m, groups, members)
