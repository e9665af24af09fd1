"""Compressed outer steps (int8, bf16) of DiLoCo and LocalSGD under live membership: real SIGKILLs, a float64 replay
of CHOCO's public copies through a loss between outer steps, a loss that an outer step misses, and a join
(docs/fault-tolerance.md, "Local steps under live membership").

The rule the replay states, over ``complete`` (one group of the epoch's n members, weight w = 1/n; γ the consensus
step; worker i's payload p_i = (x_i, anchor_i), LocalSGD's x_i; x̂_j^(i) member i's copy of member j's public value)::

    outer step:  d_j = D(Q(p_j − x̂_j^(j)))  for each member j alive (the compressor's own encode and decode)
                 x̂_j^(i) += d_j  for every holder i that got j's message (j itself included)
                 p_i <- p_i + γ (Σ_{j≠i} w x̂_j^(i) − (1 − w) x̂_i^(i))
                 then DiLoCo's outer step from the mixed (x, anchor) (test_live_local_steps.py)
    missed:      a message that never came is an empty difference: x̂_j^(i) does not move (the dead member's last
                 public value keeps its weight w until the change)
    change E:    the anchors and the outer momentum become their mean over the new members, then every copy of every
                 public value, on every member, restarts at (anchor, anchor) (LocalSGD: zero): equal wherever held
    join:        the joiner brings no copies (``averageable_state``); it restarts them at E like the others
    streaming:   each fragment's group keeps copies of its own payload (its parameters, then their anchors); the
                 fragments take outer steps in turn, and at E every fragment's copies restart

The replay keeps one copy per (holder, owner), which the front never does (a group's ``others`` is one weighted sum),
and computes the inner steps with a fresh float64 model: it shares the compressor's quantizer and nothing else with
the front. Harness: test_live_engine.py's (a forked process per member, a store in the parent).
"""

from __future__ import annotations

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
from decent_train.engine.compress import Compressor, make_compressor
from decent_train.training.heal_state import receive_state, send_state

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)

if not reconfigure.supported():
    pytest.skip("live membership needs torch >= 2.14 (reconfigurable gloo process groups)", allow_module_level=True)

from .test_live_engine import (  # noqa: E402  (after the skip: the harness needs reconfigurable groups)
    ENGINE_TIMEOUT_S, FOUNDERS, JOINER, SURVIVORS, VICTIM, die, enter_epoch, leave_when_all_finished, loss_of,
    make_model, params_of, run_members,
)
from .test_live_launcher import KILL_AT, Signal, at_step, check_trained_to_the_end, launch  # noqa: E402
from .test_live_launcher import JOIN_STEPS  # noqa: E402
from .test_live_local_steps import FRAGMENTS  # noqa: E402

TOL = 1e-12
INNER_LR = 0.1
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
GAMMA = 0.8  # below 1, so that the replay checks where the consensus step applies
BLOCK = 32  # int8: 10 blocks over DiLoCo's payload of 2 x 155 elements
SYNC_EVERY = 4  # outer steps after inner steps 4, 8, 12, 16
DIE_STEP = 5  # the victim dies before its inner step 5, after the outer step at 4
HEALED = [0, 1, 3, JOINER]
DONOR = HEALED[HEALED.index(JOINER) - 1]
# scenario: (the epochs as (first step, members), inner steps). "window": the outer step at 8 misses the victim.
SCENARIOS = {
    "between": ([(0, FOUNDERS), (6, SURVIVORS)], 12),
    "window": ([(0, FOUNDERS), (10, SURVIVORS)], 12),
    "join": ([(0, FOUNDERS), (6, SURVIVORS), (10, HEALED)], 16),
}
# "-offload": the public copies, anchors and outer state in host memory (CUDA's default), restarted there at a change
CASES = {f"{kind}-{compression}-{scenario}" + ("-offload" if offload else ""): (kind, compression, scenario, offload)
         for kind, compression, scenario, offload in [
             ("diloco", "int8", "between", False), ("diloco", "int8", "window", False),
             ("diloco", "int8", "join", False), ("diloco", "bf16", "between", False),
             ("diloco", "bf16", "window", False), ("diloco", "bf16", "join", False),
             ("localsgd", "int8", "window", False), ("streaming", "int8", "between", False),
             ("streaming", "int8", "join", False), ("streaming", "bf16", "window", False),
             ("diloco", "int8", "window", True), ("diloco", "bf16", "join", True), ("localsgd", "int8", "window", True),
             ("streaming", "int8", "join", True)]}


def _front(model: nn.Module, inner: torch.optim.Optimizer, world: int, kind: str, compression: str, offload: bool,
           from_rank0: bool = True) -> DiLoCo:
    common: dict[str, Any] = dict(local_world_size=world, timeout=ENGINE_TIMEOUT_S, fault_tolerant=True,
                                  from_rank0=from_rank0, compression=compression, consensus_step=GAMMA,
                                  int8_block=BLOCK, offload=offload)
    if kind == "localsgd":
        return LocalSGD(model, inner, SYNC_EVERY, "complete", **common)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return DiLoCo(model, inner, outer, SYNC_EVERY, "complete", fragments=len(_fragments(kind)), **common)


def _fragments(kind: str) -> list[list[str]]:
    """The parameters' names by fragment: streaming's two (test_live_local_steps.py's cut), else one of all."""
    return FRAGMENTS if kind == "streaming" else [[n for n, _ in make_model(0).named_parameters()]]


def _copies(front: DiLoCo) -> dict[str, tuple[Tensor, Tensor]]:
    """This member's public copies (own, others) by fragment's group and peer group, as they stand."""
    copies = {}
    for index, group in enumerate(front.groups):
        state = group.copies_state()
        assert state is not None
        copies |= {f"{index}/{key}": (own.clone(), others.clone()) for key, (own, others) in state["copies"].items()}
    return copies


def _train(member: int, store: dist.Store, ctx: dict[str, Any]) -> dict[str, Any]:
    kind, compression, scenario, offload = CASES[ctx["case"]]
    epochs, steps = SCENARIOS[scenario]
    starts = {step: (epoch, members) for epoch, (step, members) in enumerate(epochs)}
    first = next(e for e, (_, members) in enumerate(epochs) if member in members)
    enter_epoch(store, ctx, first, epochs[first][1], member)
    model = make_model(100 + member)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)  # no state: the joiner heals from the front alone
    front = _front(model, inner, len(epochs[first][1]), kind, compression, offload, from_rank0=first == 0).__enter__()
    assert front.offloaded == offload
    result: dict[str, Any] = {"copies": {}, "device_bytes": {}}
    if first > 0:  # the joiner: its donor's model and the front's averageable state (no public copies)
        state, _ = receive_state(epochs[first][1].index(DONOR))
        model.load_state_dict(state["model"])
        front.load_state_dict(state["algorithm"]["front"])
        front.membership_changed("complete", len(epochs[first][1]))
        result["copies"][first] = _copies(front)
        result["device_bytes"][first] = front.memory_bytes()["device"]
    for s in range(epochs[first][0], steps):
        if member == VICTIM and s == DIE_STEP:
            die()
        if s in starts and s > epochs[first][0]:
            epoch, members = starts[s]
            front.prepare_membership_change()
            enter_epoch(store, ctx, epoch, members, member)
            if member == DONOR and JOINER in members:  # what live_changes.py's donor sends
                algorithm = FrontAlgorithm.averageable_state({"inner": inner.state_dict(), "front": front.state_dict()})
                send_state({"model": model.state_dict(), "algorithm": algorithm}, members.index(JOINER))
            front.membership_changed("complete", len(members))
            result["copies"][epoch] = _copies(front)
            result["device_bytes"][epoch] = front.memory_bytes()["device"]
        loss_of(model, member, s).backward()
        inner.step()  # the front's hook takes the outer step after every SYNC_EVERY-th
        inner.zero_grad(set_to_none=True)
    names = [n for n, _ in model.named_parameters()]
    result |= {"x": params_of(model), "outer_steps": front.outer_steps, "missed": list(front.exchange.missed)}
    if kind != "localsgd":
        result["anchor"] = dict(zip(names, [a.clone() for a in front.anchors()]))
        result["momentum"] = {n: front.outer.state[p]["momentum_buffer"].clone()
                              for n, p in zip(names, model.parameters())}
    front.__exit__(None, None, None)
    leave_when_all_finished(store, epochs[-1][1], member)
    return result


# -- the replay -------------------------------------------------------------------------------------------------------
def _decoded(compressor: Compressor, difference: Tensor) -> Tensor:
    """What a receiver decodes from the message of ``difference`` (the compressor's own encode and decode)."""
    n = difference.numel()
    scratch = difference.new_zeros(compressor.padded_numel(n))
    scratch[:n] = difference
    message = torch.zeros(compressor.message_bytes(n), dtype=torch.uint8)
    compressor.encode_(scratch, message)
    received = difference.new_zeros(compressor.padded_numel(n))
    compressor.decode(message, received)
    return received[:n]


def _replay(case: str, variant: str = "right") -> dict[int, dict[str, dict[str, Tensor]]]:
    """Every last member's parameters (and DiLoCo's anchors and momentum) by the rule of the module, or a wrong
    variant: ``zero_restart`` (DiLoCo's copies restart at zero at a change, as the engine's), ``missed_as_zero`` (a
    missed message's public value mixed as zero), ``missed_as_own`` (its weight moved to the receiver's own copy: the
    uncompressed outer path's rule), ``joiner_own_copies`` (the joiner's copies left at its healed payload).
    Streaming: each fragment has copies of its own (payload: its parameters, then their anchors) and takes the outer
    step of every second period of SYNC_EVERY / 2 inner steps, in turn."""
    kind, compression, scenario, _ = CASES[case]
    epochs, steps = SCENARIOS[scenario]
    compressor = make_compressor(compression, BLOCK)
    assert compressor is not None
    anchored = kind != "localsgd"
    start = params_of(make_model(100 + FOUNDERS[0]))  # the front starts every member from rank 0's
    fragments = _fragments(kind)
    period = SYNC_EVERY // len(fragments)
    x = {m: dict(start) for m in FOUNDERS}
    anchor = {m: dict(start) for m in FOUNDERS}
    momentum: dict[int, dict[str, Tensor]] = {m: {} for m in FOUNDERS}

    def payload(m: int, names: list[str]) -> Tensor:
        return torch.cat([x[m][n].reshape(-1) for n in names] + [anchor[m][n].reshape(-1) for n in names if anchored])

    def restart(names: list[str]) -> Tensor:
        if not anchored or variant == "zero_restart":
            return torch.zeros_like(payload(members[0], names))
        return torch.cat([anchor[members[0]][n].reshape(-1) for n in names] * 2)

    members = FOUNDERS
    copies = [{i: {j: payload(0, names).clone() for j in members} for i in members} for names in fragments]
    model = make_model(0)
    for s in range(steps):
        new = next((ms for step, ms in epochs if step == s and s > 0), None)
        if new is not None:
            if JOINER in new and JOINER not in members:
                x[JOINER], anchor[JOINER], momentum[JOINER] = dict(x[DONOR]), dict(anchor[DONOR]), dict(momentum[DONOR])
            members = new
            if anchored:
                means = {n: sum(anchor[k][n] for k in members) / len(members) for n in start}
                moments = {n: sum(momentum[k][n] for k in members) / len(members) for n in momentum[members[0]]}
                anchor |= {m: dict(means) for m in members}
                momentum |= {m: dict(moments) for m in members}
            copies = [{i: {j: restart(names) for j in members} for i in members} for names in fragments]
            if variant == "joiner_own_copies" and JOINER in members:
                for held, names in zip(copies, fragments):
                    held[JOINER] = {j: payload(JOINER, names).clone() for j in members}
        alive = [m for m in members if not (m == VICTIM and s >= DIE_STEP)]
        for m in alive:  # the inner step, from a fresh float64 model
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(x[m][n])
                    p.grad = None
            loss_of(model, m, s).backward()
            x[m] = {n: x[m][n] - INNER_LR * p.grad for n, p in model.named_parameters()}
        if (s + 1) % period:
            continue
        fragment = ((s + 1) // period - 1) % len(fragments)
        names, held = fragments[fragment], copies[fragment]
        w = 1.0 / len(members)
        sent = {j: _decoded(compressor, payload(j, names) - held[j][j]) for j in alive}
        for i in alive:
            for j in alive:
                held[i][j] = held[i][j] + sent[j]
        mixed = {}
        for i in alive:
            seen = {j: held[i][j] for j in members}
            for j in set(members) - set(alive):  # a missed message
                if variant == "missed_as_zero":
                    seen[j] = torch.zeros_like(seen[j])
                elif variant == "missed_as_own":
                    seen[j] = seen[i]
            others = sum(w * seen[j] for j in members if j != i)
            mixed[i] = payload(i, names) + GAMMA * (others - (1.0 - w) * seen[i])
        sizes = [start[n].numel() for n in names]
        for i in alive:
            parts = mixed[i].split(sizes * (2 if anchored else 1))
            if not anchored:
                x[i] = x[i] | {n: part.view_as(start[n]) for n, part in zip(names, parts)}
                continue
            for n, xm, am in zip(names, parts, parts[len(names):]):
                a, g = am.view_as(start[n]), (am - xm).view_as(start[n])
                momentum[i][n] = OUTER_MOMENTUM * momentum[i][n] + g if n in momentum[i] else g
                x[i][n] = anchor[i][n] = a - OUTER_LR * (g + OUTER_MOMENTUM * momentum[i][n])

    return {m: {"x": x[m], **({"anchor": anchor[m], "momentum": momentum[m]} if anchored else {})} for m in members}


def _missed(case: str) -> list[tuple[int, int]]:
    """The (fragment's round, rank) of each outer message a last member never got: the victim's, from its death to
    the change that drops it."""
    kind, _, scenario, _ = CASES[case]
    epochs, steps = SCENARIOS[scenario]
    fragments, missed, rounds = len(_fragments(kind)), [], [0] * len(_fragments(kind))
    period = SYNC_EVERY // fragments
    for s in range(period - 1, steps, period):
        members = [ms for step, ms in epochs if step <= s][-1]
        fragment = ((s + 1) // period - 1) % fragments
        if VICTIM in members and s >= DIE_STEP:
            missed.append((rounds[fragment], members.index(VICTIM)))
        rounds[fragment] += 1
    return missed


def _worst(results: dict[int, dict[str, Any]], replayed: dict[int, dict[str, dict[str, Tensor]]]) -> float:
    return max((results[m][key][n] - replayed[m][key][n]).abs().max().item()
               for m in replayed for key in replayed[m] for n in replayed[m][key])


@pytest.fixture(scope="module", params=list(CASES))
def run(request: pytest.FixtureRequest) -> tuple[str, dict[int, dict[str, Any]]]:
    """The last members' results of one run per case, shared by the tests of that case."""
    epochs, _ = SCENARIOS[CASES[request.param][2]]
    everyone = sorted({m for _, members in epochs for m in members})
    with tempfile.TemporaryDirectory() as workdir:
        return request.param, run_members(_train, everyone, (VICTIM,), workdir, case=request.param)


def test_compressed_outer_steps_through_a_change_follow_the_replay(run: tuple[str, dict[int, dict[str, Any]]]) -> None:
    """Every last member's parameters, anchors and outer momentum equal the float64 replay of the rule to 1e-12,
    int8 and bf16: the victim lost between outer steps (the change at 6, before the outer step at 8), lost where an
    outer step misses its message (at 8: an empty difference; the change at 10), and a joiner healed at 10 from its
    donor; Streaming DiLoCo's 2 fragments (outer steps every 2 inner steps in turn: fragment 0's at 6 misses the
    victim; at 6 and 8 in the window case). Right after each change every member holds the same public copies (the
    joiner too). A front that restarts only the first fragment's copies fails the streaming cases alone."""
    case, results = run
    kind, _, scenario, offload = CASES[case]
    epochs, steps = SCENARIOS[scenario]
    for m, r in results.items():
        assert r["missed"] == (_missed(case) if m in FOUNDERS else []), (m, r["missed"])  # the joiner came after
    outer_steps = steps // (SYNC_EVERY // len(_fragments(kind)))
    assert results[0]["outer_steps"] == results.get(JOINER, results[0])["outer_steps"] == outer_steps
    worst = _worst(results, _replay(case))
    assert worst <= TOL, f"the members differ from the rule's replay by {worst:.3g}"
    for epoch, (_, members) in enumerate(epochs[1:], 1):
        held = [results[m]["copies"][epoch] for m in members if m in results]
        assert len(held) == len(members) and held[0], (epoch, members)
        for copies in held[1:]:
            assert copies.keys() == held[0].keys()
            for key, (own, others) in copies.items():
                assert (own - held[0][key][0]).abs().max() <= TOL and (others - held[0][key][1]).abs().max() <= TOL
        if kind == "localsgd":
            assert all(t.abs().max() == 0 for copies in held for pair in copies.values() for t in pair)
        if offload:  # the restarted copies at home, nothing of the front left on the device (its own accounting)
            assert all(results[m]["device_bytes"][epoch] == 0 for m in members if m in results), epoch


@pytest.mark.parametrize(("run", "variant"), [
    ("diloco-int8-between", "zero_restart"), ("diloco-bf16-between", "zero_restart"),
    ("diloco-int8-window", "missed_as_zero"), ("diloco-int8-window", "missed_as_own"),
    ("diloco-bf16-window", "missed_as_zero"), ("localsgd-int8-window", "missed_as_own"),
    ("diloco-int8-join", "joiner_own_copies"), ("diloco-bf16-join", "joiner_own_copies"),
    ("streaming-int8-between", "missed_as_own"), ("streaming-int8-join", "joiner_own_copies"),
    ("streaming-bf16-window", "zero_restart"), ("diloco-int8-window-offload", "missed_as_own"),
    ("streaming-int8-join-offload", "joiner_own_copies"),
], indirect=["run"])
def test_a_wrong_rule_deviates(run: tuple[str, dict[int, dict[str, Any]]], variant: str) -> None:
    """The replay can tell: copies restarted at zero, a missed message mixed as a zero public value or as the
    receiver's own, or a joiner keeping the copies of its healed payload, are far from what the members hold."""
    case, results = run
    worst = _worst(results, _replay(case, variant))
    assert worst > 1e-6, f"the wrong variant {variant} is within {worst:.3g} of the members"


# -- end to end: the launcher's compressed DiLoCo with a worker killed and its replacement healed ----------------------
@pytest.mark.slow
def test_compressed_diloco_trains_on_through_a_kill_and_a_replacement(tmp_path: Path) -> None:
    """``algorithm=diloco algorithm.sync_every=10 compression=int8`` under live: member 2 SIGKILLed after step 200,
    its replacement healed from a survivor (no public copies: every member restarts them at the change): exit 0, no
    step repeated, accuracy >= 0.95, members 4 -> 3 -> 4, every outer step taken."""
    run = launch(tmp_path, "algorithm=diloco", "algorithm.sync_every=10", "compression=int8", "launch.max_restarts=1",
                 signals=[Signal(at_step(KILL_AT), signal.SIGKILL, [2])], steps=JOIN_STEPS)
    check_trained_to_the_end(run)
    assert run.members() == [4, 3, 4], f"{run}"
    outer = [r["outer/step"] for r in run.records if "outer/step" in r]
    assert outer[-1] == JOIN_STEPS // 10, f"outer steps {outer}\n{run}"
