"""Grouped rounds over real hosts on loopback (SwarmCollective with a GroupPlan): each group
all-reduces on its own to its members' exact mean, every update reaches every peer within one
epoch, a group survives one of its peers being killed, and grouped DiLoCo is FedAvg within each
group — through every wrapper an outer optimizer may sit on (a multi-GPU peer's local ranks, the
adversary hook, a pipeline stage's): each keeps the round's grouping visible."""

from __future__ import annotations

import copy
import threading
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.contract import Collective, CollectiveError, RoundRequest
from meshtrain.collective.flat import result_digest
from meshtrain.collective.groups import GroupPlan, epoch_length, round_groups
from meshtrain.collective.protocol import PROBE_AFTER
from meshtrain.node.ranks.group import LocalRanks
from meshtrain.node.trust.adversary import AdversarialCollective
from meshtrain.pipeline.replica_sync import StageCollective
from meshtrain.transport.identity import Identity

from .conftest import start_peers
from .proc_allreduce import inputs
from .test_allreduce import exact_mean, run_all, run_swarm


async def test_every_update_reaches_every_peer_within_one_epoch_of_grouped_rounds():
    n, g = 6, 2  # a 2x2x2 grid with a partial top layer: 4 rounds per epoch, groups of 1 or 2
    async with AsyncExitStack() as stack:
        peers = sorted(await start_peers(stack, n, full_mesh=True), key=lambda p: p.id)
        ids = [p.id for p in peers]
        plan = GroupPlan(group_size=g, seed=3, period=10)
        cols = [
            await stack.enter_async_context(
                SwarmCollective(p.host, p.ts, lambda r: ids, AllReduceConfig(join_timeout=5), grouping=plan)
            )
            for p in peers
        ]
        # Peer i starts holding only its own "update" e_i; each round it sends what it holds.
        held = [{"u": torch.eye(n)[i]} for i in range(n)]
        epoch = epoch_length(n, round_groups(ids, 0, g).sides)
        assert epoch == 4
        for rnd in range(epoch):
            round_id = rnd * plan.period
            results = await run_all(cols, held, round_id=round_id)
            expected = plan.groups(ids, round_id)
            assert not expected.whole_swarm and max(len(x) for x in expected.groups) <= g
            for grp in expected.groups:
                members = [ids.index(p) for p in grp]
                mean = exact_mean([held[i] for i in members])
                for i in members:
                    assert results[i].contributors == grp  # the group, and only the group
                    assert results[i].digest == result_digest(mean)
            held = [{"u": r.tensors["u"]} for r in results]
            reached = [int((h["u"] > 0).sum()) for h in held]
            if rnd < epoch - 1:
                assert min(reached) < n, "a partial grid needs the whole epoch"
        assert all(bool((h["u"] > 0).all()) for h in held)
        assert all(col.grouped for col in cols)


async def test_small_swarm_under_automatic_group_size_is_one_group_as_before():
    async with AsyncExitStack() as stack:
        peers = sorted(await start_peers(stack, 3, full_mesh=True), key=lambda p: p.id)
        ids = [p.id for p in peers]
        cols = [SwarmCollective(p.host, p.ts, lambda r: ids, grouping=GroupPlan(group_size=0)) for p in peers]
        tensors = [inputs(i, 0, 1000) for i in range(3)]
        results = await run_all(cols, tensors, round_id=0, tag="f0")
        assert {r.digest for r in results} == {result_digest(exact_mean(tensors))}
        assert all(r.contributors == tuple(ids) for r in results)
        assert not any(col.grouped for col in cols)


class MachineRanks(LocalRanks):
    """One rank of a two-rank peer whose ranks are threads of this process: `LocalRanks`' two
    in-machine steps (the reduce of Δ, the broadcast of the outcome) over a barrier instead of
    gloo; everything else — `LocalRanksCollective` on top — is the real thing."""

    def __init__(self, rank: int, machine: dict, peer_id: str) -> None:
        super().__init__(rank, 2, torch.device("cpu"), None, None, "ddp")
        self.machine, self.peer_id = machine, peer_id

    def _meet(self) -> None:
        self.machine["barrier"].wait()

    def reduce_mean(self, flat: torch.Tensor) -> None:
        slots = self.machine
        slots[self.rank] = flat
        self._meet()
        if self.is_gateway:
            flat.copy_((slots[0] + slots[1]) / 2)
        self._meet()

    def share_outcome(self, outcome, flat):
        slots = self.machine
        if self.is_gateway:
            slots["outcome"] = (outcome, None if flat is None else flat.clone())
        self._meet()
        outcome, mean = slots["outcome"]
        self._meet()
        if "error" in outcome:
            return outcome, None
        return outcome, flat if self.is_gateway else mean


def two_ranks(col: SwarmCollective) -> tuple[Collective, Collective]:
    """The collectives of rank 0 (over `col`) and rank 1 of a two-rank DDP peer."""
    machine: dict = {"barrier": threading.Barrier(2, timeout=30)}
    gateway, follower = MachineRanks(0, machine, col.peer_id), MachineRanks(1, machine, col.peer_id)
    return gateway.collective(col), follower.collective(None)


# Every wrapper of a SwarmCollective an outer optimizer may sit on: each must keep the round's
# grouping visible (`GroupsRounds`), or the consensus term is silently skipped.
WRAPPERS = {
    "bare": lambda col: col,
    "local-ranks-fsdp": lambda col: LocalRanks(0, 1, torch.device("cpu"), None, None, "fsdp").collective(col),
    "adversary-otherdata": lambda col: AdversarialCollective(col, "otherdata"),  # honest exchanges
    "stage": lambda col: StageCollective(lambda: col, "s0/outer/"),
}


@pytest.mark.parametrize("wrapper", [*WRAPPERS, "local-ranks-ddp"])
async def test_grouped_diloco_with_outer_lr_1_and_no_momentum_is_fedavg_within_each_group(wrapper):
    # Peers whose φ already differ (as after earlier grouped rounds): averaging Δ alone would leave
    # φ_i − Δ̄, different on every peer; the consensus term makes each group's φ its members' mean θ.
    # With "local-ranks-ddp" the first peer is a two-rank machine: its second rank, which has no
    # swarm collective, must run the consensus term with rank 0 (or the two would deadlock).
    from meshtrain.optim.diloco import DiLoCo

    n = 4
    async with AsyncExitStack() as stack:
        peers = sorted(await start_peers(stack, n, full_mesh=True), key=lambda p: p.id)
        ids = [p.id for p in peers]
        plan = GroupPlan(group_size=2, seed=1, period=1)  # a full 2x2 grid: groups of two
        models, outers = [], []
        follower = None
        for i, p in enumerate(peers):
            col = await stack.enter_async_context(
                SwarmCollective(p.host, p.ts, lambda r: ids, AllReduceConfig(join_timeout=5), grouping=plan)
            )
            torch.manual_seed(100 + i)  # a different φ on every peer
            model = torch.nn.Linear(8, 4)
            models.append(model)
            if wrapper == "local-ranks-ddp" and i == 0:
                wrapped, second = two_ranks(col)
                twin = copy.deepcopy(model)  # DDP: every rank holds the same θ and φ
                follower = (twin, DiLoCo(twin, None, second, H=1, lr=1.0, momentum=0.0))
            else:
                wrapped = WRAPPERS.get(wrapper, WRAPPERS["bare"])(col)
            outers.append(DiLoCo(model, None, wrapped, H=1, lr=1.0, momentum=0.0))
        phi0 = [{k: v.clone() for k, v in o.outer_params.items()} for o in outers]
        with torch.no_grad():  # "inner training": every peer moves θ its own way
            for i, m in enumerate(models + ([follower[0]] if follower else [])):
                for prm in m.parameters():
                    prm.add_(0.01 * (min(i, n) % n + 1))  # the follower (i = n) moves as peer 0
        thetas = [{k: v.detach().clone() for k, v in m.named_parameters()} for m in models]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for o in outers + ([follower[1]] if follower else []):
                    nursery.start_soon(o.astep)
        groups = plan.groups(ids, 1)
        assert not groups.whole_swarm
        for grp in groups.groups:
            members = [ids.index(p) for p in grp]
            for name in phi0[0]:
                fedavg = torch.stack([thetas[i][name] for i in members]).mean(0)
                for i in members:
                    assert torch.allclose(outers[i].outer_params[name], fedavg, atol=2e-3), name
                    delta_only = phi0[i][name] - torch.stack([phi0[j][name] - thetas[j][name] for j in members]).mean(0)
                    assert not torch.allclose(delta_only, fedavg, atol=2e-2)  # the term mattered
        assert all(o.history[-1].contributors == 2 for o in outers)
        if follower is not None:  # rank 1 ends the round where rank 0 does, bit for bit
            for name, phi in outers[0].outer_params.items():
                assert torch.equal(follower[1].outer_params[name], phi), name


# -- a peer killed inside its group, separate processes ------------------------------------------

N_PEERS, GROUP_SIZE, NUMEL, ROUNDS = 6, 3, 1 << 16, 3


@pytest.mark.slow
def test_grouped_round_survives_a_peer_killed_mid_reduce(tmp_path):
    # 6 peers in groups of at most 3: a full 3x2 grid, so round 1 (dimension 0) has two groups of
    # three. The victim dies 30 ms into its first send of round 1.
    victim_rank = 2
    infos, index_of, outputs = run_swarm(
        tmp_path,
        "while_sending",
        victim_rank,
        "--group-size",
        str(GROUP_SIZE),
        "--linger",
        "1",
        peers=N_PEERS,
        numel=NUMEL,
        rounds=ROUNDS,
    )
    ids = sorted(index_of)
    victim = ids[victim_rank]
    plan = GroupPlan(group_size=GROUP_SIZE)
    for info, out in zip(infos, outputs, strict=True):
        if info["peer"] != victim:
            assert len(out) == ROUNDS, f"peer {info['index']} printed {out}; its log ends:\n{info.get('stderr_tail')}"
    by_peer = {info["peer"]: out for info, out in zip(infos, outputs, strict=True)}
    for r in range(ROUNDS):
        for grp in plan.groups(ids, r).groups:
            survivors = [p for p in grp if p != victim]
            rows = [next(x for x in by_peer[p] if x["round"] == r) for p in survivors]
            assert all("digest" in x for x in rows), (r, grp, rows)
            assert len({x["digest"] for x in rows}) == 1, (r, rows)  # bit-identical within the group
            contributors = rows[0]["contributors"]
            assert set(contributors) <= set(grp)  # nobody outside the group is mixed in
            if victim in grp and r >= 1:
                assert contributors == survivors, (r, rows[0])
                assert max(x["seconds"] for x in rows) < 16, (r, rows)
            elif r == 0 or victim not in grp:
                assert contributors == list(grp)
            contribs = [inputs(index_of[p], r, NUMEL) for p in contributors]
            assert rows[0]["digest"] == result_digest(exact_mean(contribs)).hex()


def disagreeing_plan(ids: list[str], departed: list[str], round_id: int, *, step: int) -> GroupPlan:
    """A plan under which peer i, counting `departed[i]` in the roster, groups `round_id` with
    peer i+`step` (mod 3), who groups it otherwise: every peer's group is another pair.

    Each joins its pair's lower id, and a coordinator hands a join over to a lower id of its own
    pair (coordinator.py). With `step` 1 no join reaches a coordinator whose own pair is the
    joiner's: no round can form before the views converge. With `step` -1 the highest peer's join
    is handed to the lowest, whose pair it is: under one tag, the middle peer's another, the two
    form the round at once, without the middle peer. Whether a plan exists depends on the ids:
    the tests' are fixed (`DISAGREEING`), so each finds the same plan every run."""
    for seed in range(1000):
        plan = GroupPlan(group_size=3, seed=seed, period=1)
        mine, tags = [], []
        for i, p in enumerate(ids):
            groups = plan.groups(sorted([*ids, departed[i]]), round_id)
            mine.append(frozenset(groups.groups[groups.index_of(p)]) & set(ids))
            tags.append(plan.tag("f0", groups, p))
        if all(mine[i] == {ids[i], ids[(i + step) % 3]} for i in range(3)) and (
            step == 1 or tags[0] == tags[2] != tags[1]
        ):
            return plan
    raise AssertionError("no seed groups the round that way")


DISAGREEING = [Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3)]


async def start_disagreeing(stack: AsyncExitStack, round_id: int, *, step: int):
    """Three peers, each of whose rosters holds its own departed peer until `converged` is set:
    their collectives, their ids and the event."""
    peers = sorted(await start_peers(stack, 3, full_mesh=True, identities=DISAGREEING), key=lambda p: p.id)
    ids = [p.id for p in peers]
    departed = [f"{p.id[:-1]}{'XYZ'[i]}" for i, p in enumerate(peers)]  # one each, never connected
    plan = disagreeing_plan(ids, departed, round_id, step=step)
    converged = trio.Event()

    def roster(i: int):
        return lambda r: sorted(ids) if converged.is_set() else sorted([*ids, departed[i]])

    config = AllReduceConfig(join_timeout=30.0)
    cols = [
        await stack.enter_async_context(
            SwarmCollective(p.host, p.ts, lambda r: ids, config, grouping=plan, roster=roster(i))
        )
        for i, p in enumerate(peers)
    ]
    return cols, ids, converged


async def test_peers_that_grouped_a_round_differently_regroup_and_average_together():
    """Three of six daemons left: for a few seconds each survivor still counted a different one of
    them in the round's roster, computed other groups and entered the round under another group's
    tag, and each waited out the hard join deadline (3 × 30 s) for the others. Here each peer's
    roster holds its own departed peer until the views converge a second in, and each groups the
    round with a partner that groups it otherwise: the coordinators' probes find the partners
    under sibling tags, everyone regroups from the converged view, and the round is one group of
    three, its exact mean, long before the join deadline."""
    async with AsyncExitStack() as stack:
        round_id = 4
        cols, ids, converged = await start_disagreeing(stack, round_id, step=1)
        tensors = [{"w": torch.randn(64) * (i + 1)} for i in range(3)]

        async def converge() -> None:
            await trio.sleep(1.0)  # sleep: the departures' records arrive a second in
            converged.set()

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(converge)
            results = await run_all(cols, tensors, round_id=round_id, tag="f0")
        took = trio.current_time() - t0
        mean = exact_mean(tensors)
        for r in results:
            assert r.contributors == tuple(ids)
            assert r.digest == result_digest(mean)
        assert took < cols[0].config.join_timeout / 2, took


async def test_a_pair_that_formed_the_round_before_the_views_converged_sends_the_third_to_resync():
    """The other way the same disagreement goes (2 of 7 CI-like runs of the test above, before
    the plan was chosen to exclude it): the lowest and the highest peer formed the round under one
    tag at once, and the middle peer waited at the lowest under its own. The lowest's trainer has
    ended the round; that is past, not another grouping: the middle peer is told so at the first
    probe and re-syncs, where it was told to regroup until `MAX_REGROUPS` (8 × 2 s) ran out."""
    async with AsyncExitStack() as stack:
        round_id = 4
        cols, ids, converged = await start_disagreeing(stack, round_id, step=-1)
        tensors = [{"w": torch.randn(64) * (i + 1)} for i in range(3)]
        results: dict[int, object] = {}
        t0 = trio.current_time()

        async def one(i: int) -> None:
            try:
                results[i] = await cols[i].all_reduce(RoundRequest(tensors[i], round_id=round_id, tag="f0"))
            except CollectiveError as e:
                results[i] = e
            if {0, 2} <= set(results):
                converged.set()  # the departures' records arrive after the pair's round

        with trio.fail_after(4 * PROBE_AFTER):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
        took = trio.current_time() - t0
        pair = exact_mean([tensors[0], tensors[2]])
        for i in (0, 2):
            assert results[i].contributors == (ids[0], ids[2]), results[i]
            assert results[i].digest == result_digest(pair)
        assert isinstance(results[1], CollectiveError) and "moved past this round" in str(results[1]), results[1]
        assert took < 3 * PROBE_AFTER, took
