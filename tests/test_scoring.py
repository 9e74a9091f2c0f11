"""Loss scoring (node/trust/scoring.py): an owner applies a sampled peer's update to its
part of φ and measures the loss on that peer's own assigned batches (the round's last
`score_batches` steps'); an update that does not lower it about as much as the round's aggregate
does is flagged. Pure-function level with a real tiny model trained for real (DiLoCo rounds of
gpt-tiny on the built-in corpus, in one process; on one batch and on the default number); the
sample among real hosts on loopback; the spec key; and the loss strike format, as a property."""

from __future__ import annotations

import copy
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.allreduce import AllReduceConfig
from meshtrain.collective.contract import RoundScreening, sampled_peers
from meshtrain.collective.flat import flatten_fp32, part_bounds
from meshtrain.crdt.entries import CrdtError
from meshtrain.crdt.strikes import LOSS, Strike
from meshtrain.errors import ConfigError
from meshtrain.models import Corpus
from meshtrain.models.sources import build_model
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec
from meshtrain.node.trust import scoring
from meshtrain.node.trust.scoring import score_round, scored_steps, scratch_model
from meshtrain.node.trust.strikes import excluded_at, loss_flagged, quorum

from .test_allreduce import mesh, run_all
from .test_screening import JUNK, PEERS

H, BATCH, CONTEXT = 10, 8, 32  # gpt-tiny's own context, as in scripts/bench/bench_adversarial.py
HONEST = ["p0", "p1", "p2", "p3"]


class Rounds:
    """DiLoCo among HONEST plus one adversary on gpt-tiny: each peer trains H AdamW steps from φ
    on its assigned batches (`Corpus.batch`, as the trainer does), the trimmed mean of the Δs
    moves φ by Nesterov SGD (the spec's defaults)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.corpus = Corpus.default("chars")
        self.model = build_model("gpt-tiny", vocab_size=self.corpus.vocab_size, seed=0, context=CONTEXT)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.phi = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.momentum = {n: torch.zeros_like(p) for n, p in self.phi.items()}

    def batch(self, peer: str, step: int, other: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.corpus.batch(BATCH, CONTEXT, seed=0, peer=peer, step=step)
        if other:  # the otherdata adversary's batches (node/trust/adversary.py): token order reversed
            seq = torch.cat([x[:, :1], y], dim=1).flip(1)
            return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        return x, y

    def train(self, peer: str, r: int, other: bool = False) -> torch.Tensor:
        """Δ = φ − θ (flat) of `peer` after the inner steps of round r (steps r − H .. r − 1)."""
        m = copy.deepcopy(self.model)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(self.phi[n])
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
        for s in range(r - H, r):
            loss = m(*self.batch(peer, s, other)).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        return flatten_fp32({n: self.phi[n] - p.detach() for n, p in m.named_parameters()})

    def step(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        agg = torch.stack(deltas).sort(dim=0).values[1:-1].mean(dim=0)
        pos = 0
        for n in self.names:
            g = agg[pos : pos + self.phi[n].numel()].view(self.phi[n].shape)
            pos += self.phi[n].numel()
            self.momentum[n].mul_(0.9).add_(g)
            self.phi[n] -= 0.7 * (g + 0.9 * self.momentum[n])
        return agg


ROUNDS = 8  # the run's outer rounds; every one from the second is scored
SCORE_BATCHES = (1, SwarmSpec().verification.score_batches)  # one batch (as before the key existed), the default


@dataclass(frozen=True)
class Run:
    """What `run` measured. flags[b][liar]: per scored round (2 .. ROUNDS), how many owners flagged
    each peer of HONEST + `liar`, scored on `b` batches. sim, updates: the last round's φ (before
    its step) and updates."""

    flags: dict[int, dict[str, list[dict[str, int]]]]
    sim: Rounds
    updates: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def run() -> Run:
    """ROUNDS rounds of DiLoCo among HONEST and an adversary whose round-1 update is replayed in
    every round (it moves φ with the honest ones); in every round from the second, each owner's
    verdicts on HONEST + the replay and on HONEST + an update trained on other data than the
    adversary was assigned, at each of SCORE_BATCHES."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and fair to a shared machine
    flags: dict[int, dict[str, list[dict[str, int]]]] = {b: {"replay": [], "otherdata": []} for b in SCORE_BATCHES}
    try:
        sim = Rounds()
        first = None
        for rnd in range(1, ROUNDS + 1):
            r = rnd * H
            deltas = {p: sim.train(p, r) for p in HONEST}
            first = first if first is not None else sim.train("adv", r)
            if rnd > 1:
                updates = {**deltas, "replay": first, "otherdata": sim.train("adv", r, other=True)}
                for b in SCORE_BATCHES:
                    spec = SwarmSpec(model="gpt-tiny", H=H, score_batches=b)
                    for liar in ("replay", "otherdata"):
                        flags[b][liar].append(verdicts(sim, updates, liar, spec, r))
            if rnd < ROUNDS:
                sim.step([*deltas.values(), first])
    finally:
        torch.set_num_threads(threads)
    return Run(flags, sim, updates)


def verdicts(sim: Rounds, updates: dict[str, torch.Tensor], liar: str, spec: SwarmSpec, r: int) -> dict[str, int]:
    """How many owners (each on its own part) flag each peer of the round of HONEST + `liar` that
    ends at step `r`, each scored on its batches of the round's last `spec.verification.score_batches` steps."""
    group = [*HONEST, liar]
    agg = torch.stack([updates[p] for p in group]).sort(dim=0).values[1:-1].mean(dim=0)
    bounds = part_bounds(agg.numel(), len(group))
    # The scored peer's own batches: `liar`'s assignment is the adversary's ("adv").
    steps = scored_steps(r, H, spec.verification.score_batches)
    batches = {p: [sim.batch("adv" if p == liar else p, s) for s in steps] for p in group}
    flags = dict.fromkeys(group, 0)
    for j, owner in enumerate(group):
        part = (bounds[j], bounds[j + 1])
        samples = {p: updates[p][part[0] : part[1]] for p in group if p != owner}
        scores = score_round(
            copy.deepcopy(sim.model), sim.phi, sim.names, part, samples, agg[part[0] : part[1]], batches
        )
        assert {s.peer for s in scores} == set(samples)
        for s in scores:
            flags[s.peer] += loss_flagged(s.gain, s.ref, spec)
    return flags


@pytest.mark.parametrize("liar", ["replay", "otherdata"])
def test_on_one_batch_a_replayed_or_other_data_update_is_flagged_by_a_quorum_in_round_3_and_no_honest_one(
    run, liar
) -> None:
    """score_batches = 1 is the rule as it was before the key existed: one batch, the last step's."""
    flags = run.flags[1][liar][3 - 2]
    need = quorum(len(HONEST) + 1)
    assert flags[liar] >= need, flags
    assert all(flags[p] < need for p in HONEST), flags


def test_at_the_default_no_owner_flags_an_honest_peer_and_a_replay_is_struck_out(run) -> None:
    """Rounds 2 .. ROUNDS at the default score_batches: no owner flags an honest peer (on one
    batch some do: the noise that more batches average out), a replay is flagged by a quorum in
    enough rounds within the window to be excluded, other data by a quorum in some rounds."""
    spec = SwarmSpec(model="gpt-tiny", H=H)
    need = quorum(len(HONEST) + 1)
    default = run.flags[spec.verification.score_batches]

    def honest_flags(b: int) -> int:
        return sum(v[p] for rounds in run.flags[b].values() for v in rounds for p in HONEST)

    assert honest_flags(spec.verification.score_batches) == 0 and honest_flags(1) > 0
    struck = [(i + 2) * H for i, v in enumerate(default["replay"]) if v["replay"] >= need]
    assert excluded_at(struck, spec) is not None, default["replay"]
    assert any(v["otherdata"] >= need for v in default["otherdata"]), default["otherdata"]


def test_several_batches_score_the_loss_on_their_concatenation_and_one_is_the_last_step(run) -> None:
    """`score_batches` = b scores the round's last b steps' batches (all H if fewer, the last
    one alone for b = 1, as before the key existed), the loss their mean: for batches of one size,
    the loss on their concatenation."""
    assert scored_steps(3 * H, H, 1) == range(3 * H - 1, 3 * H)
    assert scored_steps(3 * H, H, 4) == range(3 * H - 4, 3 * H)
    assert scored_steps(3 * H, 2, 4) == range(3 * H - 2, 3 * H) and scored_steps(0, H, 4) == range(0, 1)
    sim, updates = run.sim, run.updates
    part = (0, updates["p0"].numel() // 5)
    samples = {p: updates[p][: part[1]] for p in ("p0", "replay")}
    agg = updates["p1"][: part[1]]
    two = [sim.batch(p, s) for p in ("p0", "p1") for s in (28, 29)]
    joined = (torch.cat([x for x, _ in two]), torch.cat([y for _, y in two]))
    apart = score_round(copy.deepcopy(sim.model), sim.phi, sim.names, part, samples, agg, dict.fromkeys(samples, two))
    whole = score_round(
        copy.deepcopy(sim.model), sim.phi, sim.names, part, samples, agg, dict.fromkeys(samples, [joined])
    )
    for a, w in zip(apart, whole, strict=True):
        assert a.peer == w.peer and a.ref != 0
        assert a.gain == pytest.approx(w.gain, abs=1e-5) and a.ref == pytest.approx(w.ref, abs=1e-5)


@pytest.mark.parametrize("value", [0, 65, -1, "four", 2.5])
def test_score_batches_out_of_range_is_a_one_line_spec_error(value) -> None:
    with pytest.raises(ConfigError, match="score_batches") as e:
        parse_spec({"model": "gpt-tiny", "score_batches": value})
    assert "\n" not in str(e.value)
    assert (
        parse_spec({"model": "gpt-tiny", "score_batches": 64, "H": 5}).verification.score_batches == 64
    )  # all H are scored


def test_the_sample_is_a_function_of_the_committed_digest() -> None:
    group = tuple(f"peer{i}" for i in range(8))
    a, b = sampled_peers(group, b"\x01" * 32, 3), sampled_peers(group, b"\x02" * 32, 3)
    assert len(a) == 3 and set(a) <= set(group) and a == tuple(sorted(a))
    assert a == sampled_peers(tuple(reversed(group)), b"\x01" * 32, 3)  # the order handed in does not matter
    assert a != b or sampled_peers(group, b"\x03" * 32, 3) != a  # another digest, another sample
    assert sampled_peers(group, b"\x01", 0) == () and sampled_peers(group, b"\x01", 99) == group


async def test_owners_keep_the_sampled_contributions_to_their_part() -> None:
    """Among real hosts: every owner hands over the same sampled peers (not itself), their
    contributions to its part exactly as sent, and the committed result's slice."""
    cfg = AllReduceConfig(
        join_timeout=5, robust="trimmed_mean", screen_norm=4.0, screen_alignment=0.25, score_samples=2
    )
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(4000, generator=g) for _ in range(4)]
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 4, cfg)
        results = await run_all(cols, [{"w": x.reshape(40, -1)} for x in inputs], round_id=7)
    ids = [p.id for p in peers]
    group = tuple(sorted(ids))
    chosen = sampled_peers(group, results[0].digest, 2)
    for i, r in enumerate(results):
        s = r.screening
        assert s is not None and set(s.samples) == set(chosen) - {ids[i]}
        a, b = s.part
        assert (a, b) == tuple(part_bounds(4000, 4)[group.index(ids[i]) : group.index(ids[i]) + 2])
        for p, x in s.samples.items():
            assert torch.equal(x, inputs[ids.index(p)][a:b])
        assert torch.equal(s.aggregate, r.tensors["w"].reshape(-1)[a:b])


@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(["rule", "gain", "ref", "norm", "align", "drop-gain", "drop-rule", None]),
    junk=JUNK,
    gain=st.floats(-10, 10),
    ref=st.floats(-10, 10),
)
def test_a_loss_strike_round_trips_and_any_other_is_refused_with_a_crdt_error(field, junk, gain, ref) -> None:
    """Loss strikes (crdt/strikes.py): a well-formed one survives its record, a screening strike
    keeps the old form (no rule key), and a record with a loss field replaced by junk or missing
    is still well-formed or refused with `CrdtError`, never another exception."""
    reporter, peer = PEERS[1], PEERS[3]
    strike = Strike(reporter, 40, "f0", peer, tuple(PEERS), b"\x05" * 32, 1, 1.2, 0.4, LOSS, gain, ref)
    record = strike.to_record()
    assert Strike.from_record(reporter, record) == strike and record["rule"] == LOSS
    screen = Strike(reporter, 40, "f0", peer, tuple(PEERS), b"\x05" * 32, 1, 1.2, 0.4)
    assert "rule" not in screen.to_record() and Strike.from_record(reporter, screen.to_record()) == screen
    if field is None:
        pass
    elif field.startswith("drop-"):
        record = {k: v for k, v in record.items() if k != field[5:]}
    else:
        record = {**record, field: junk}
    try:
        parsed = Strike.from_record(reporter, record)
    except CrdtError:
        return
    assert Strike.from_record(reporter, parsed.to_record()) == parsed


def test_the_scratch_model_holds_no_parameter_memory_and_scores_as_a_full_copy_does(run) -> None:
    """The scorer runs φ in a `scratch_model` (its parameters on the meta device) instead of a
    deep copy of the model: the same scores, φ untouched, the model's own weights unread."""
    sim, updates = run.sim, run.updates
    scratch = scratch_model(sim.model, sim.names)
    assert all(p.device.type == "meta" for p in scratch.parameters())
    assert all(p.device.type == "cpu" for p in sim.model.parameters())  # the live model is left alone
    part = (0, updates["p0"].numel() // 5)
    samples = {p: updates[p][: part[1]] for p in ("p0", "replay")}
    agg = updates["p1"][: part[1]]
    batches = {p: [sim.batch(p, s) for s in (28, 29)] for p in samples}
    before = {n: t.clone() for n, t in sim.phi.items()}
    full = score_round(copy.deepcopy(sim.model), sim.phi, sim.names, part, samples, agg, batches)
    lean = score_round(scratch, sim.phi, sim.names, part, samples, agg, batches)
    assert full == lean and len(lean) == 2
    assert all(torch.equal(sim.phi[n], before[n]) for n in before)  # φ is only read
    # A model whose own weights are garbage scores the same: φ is what runs.
    garbage = copy.deepcopy(sim.model)
    with torch.no_grad():
        for p in garbage.parameters():
            p.fill_(float("nan"))
    assert score_round(garbage, sim.phi, sim.names, part, samples, agg, batches) == lean


def test_a_users_hugging_face_model_loaded_as_transformers_loads_it_is_scored_on_its_scratch_copy(tmp_path) -> None:
    """A Python-API user's model is loaded however they load it: transformers >= 5.25's
    `from_pretrained` swaps in the Hub's kernels by default, and such a model re-kernelizes on a
    train/eval switch for its parameters' device — the scratch copy's meta device, which no kernel
    supports. The scorer sets the eval flags itself: it scores as a full copy does."""
    transformers = pytest.importorskip("transformers")
    from meshtrain.models.sources import HFCausalLM

    from .tiny_hf import BPE_VOCAB, save_tiny_llama

    save_tiny_llama(tmp_path / "llama")
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama")).train())
    names = [n for n, _ in model.named_parameters()]
    phi = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(t.numel() for t in phi.values())
    gen = torch.Generator().manual_seed(0)
    samples = {p: torch.randn(total // 2, generator=gen) * 1e-3 for p in ("a", "b")}
    agg = (samples["a"] + samples["b"]) / 2
    tokens = torch.randint(0, BPE_VOCAB, (2, 9), generator=gen)
    batches = {p: [(tokens[:, :-1], tokens[:, 1:])] for p in samples}
    part = (0, total // 2)
    lean = score_round(scratch_model(model, names), phi, names, part, samples, agg, batches)
    assert lean == score_round(copy.deepcopy(model), phi, names, part, samples, agg, batches)
    assert len(lean) == 2


class LiveRound:
    """One owner's round of `run`'s last φ as the node scores it: a `LossScorer` over a stand-in
    trainer whose outer optimizer holds φ (`phi`, live) and awaits `before_state_change` before it
    would change it; every forward pass the scorer runs is recorded (`forwards`: the tensors it ran
    with, and whether φ had been released then)."""

    def __init__(self, run: Run, monkeypatch) -> None:
        sim, updates = run.sim, run.updates
        self.phi = {n: t.clone() for n, t in sim.phi.items()}
        self.outer = SimpleNamespace(
            outer_params=self.phi, fragments=[tuple(sim.names)], needs_resync=False, before_state_change=[]
        )
        spec = SwarmSpec(model="gpt-tiny", H=H, batch_size=BATCH, score_samples=4)
        trainer = SimpleNamespace(
            spec=spec,
            model=sim.model,
            outer=self.outer,
            corpus=sim.corpus,
            context=CONTEXT,
            precision=SimpleNamespace(autocast=None),
        )
        self.filed: list[list] = []
        self.filed_event = trio.Event()

        def on_scores(screening, scores) -> None:
            self.filed.append(scores)
            self.filed_event.set()

        self.scorer = scoring.LossScorer(trainer, SimpleNamespace(on_scores=on_scores))
        group = (*HONEST, "replay")
        agg = torch.stack([updates[p] for p in group]).sort(dim=0).values[1:-1].mean(dim=0)
        bounds = part_bounds(agg.numel(), len(group))
        self.part = (bounds[0], bounds[1])  # p0's, the owner's
        a, b = self.part
        digest = b"\x07" * 32
        self.screening = RoundScreening(
            (ROUNDS - 1) * H,
            "f0",
            group,
            digest,
            part=self.part,
            samples={p: updates[p][a:b] for p in group if p != "p0"},
            aggregate=agg[a:b],
        )
        chosen = [p for p in sampled_peers(group, digest, spec.verification.score_samples) if p != "p0"]
        self.batches = {
            p: [sim.batch(p, s) for s in scored_steps(self.screening.round_id, H, spec.verification.score_batches)]
            for p in chosen
        }
        # The scores as they were computed before: on a copy of φ taken as the round committed.
        self.expected = score_round(
            scratch_model(sim.model, sim.names),
            {n: t.clone() for n, t in self.phi.items()},
            sim.names,
            self.part,
            {p: updates[p][a:b] for p in chosen},
            agg[a:b],
            self.batches,
        )
        self.forwards: list[tuple[dict[str, torch.Tensor], bool]] = []
        self.released = False
        real = scoring.functional_call

        def spy(model, params, args):
            self.forwards.append((dict(params), self.released))
            return real(model, params, args)

        monkeypatch.setattr(scoring, "functional_call", spy)

    async def apply(self) -> None:
        """What the outer optimizer does after the collective returned: its hooks, then φ changes
        (to garbage: a forward pass that still read it would score garbage)."""
        for hook in self.outer.before_state_change:
            await hook()
        self.released = True
        with torch.no_grad():
            for t in self.phi.values():
                t.fill_(float("nan"))


async def test_a_round_is_scored_on_the_live_phi_before_its_result_changes_it(run, monkeypatch) -> None:
    """No copy of φ: every forward pass runs on the outer optimizer's own φ tensors (the part's
    parameters excepted: a working copy of those alone), φ is never written, and the round's
    result waits (`before_state_change`) until the scoring is done. The scores are the ones a
    copy of φ taken at the round's commit gave."""
    monkeypatch.setattr(scoring, "WAIT_SHARE", 1e9)  # never cut short here
    live = LiveRound(run, monkeypatch)
    before = {n: t.clone() for n, t in live.phi.items()}
    starts = torch.tensor([0] + [t.numel() for t in live.phi.values()]).cumsum(0).tolist()
    in_part = {
        n
        for n, lo, hi in zip(live.phi, starts[:-1], starts[1:], strict=True)
        if lo < live.part[1] and hi > live.part[0]
    }
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(live.scorer.run)
            await trio.testing.wait_all_tasks_blocked()  # it waits for rounds
            live.scorer.on_round(live.screening)
            # Scoring runs in its worker thread; φ is what the round started from until it is done.
            assert all(torch.equal(live.phi[n], before[n]) for n in before)
            await live.apply()
            await live.filed_event.wait()
            nursery.cancel_scope.cancel()
    assert len(live.forwards) == 3 * sum(len(b) for b in live.batches.values())
    assert 0 < len(in_part) < len(live.phi)
    for params, released in live.forwards:
        assert not released  # the result changed φ only after the last forward pass
        for n, t in params.items():
            assert (t is live.phi[n]) == (n not in in_part)  # φ's own tensors: no snapshot
    [scores] = live.filed
    assert {s.peer: s for s in scores} == {s.peer: s for s in live.expected} and len(scores) == len(live.batches)
    assert live.scorer.scored == 1 and live.scorer.skipped == 0 and live.scorer.waited > 0  # the result waited


async def test_a_round_that_would_wait_too_long_cuts_its_scoring_short(run, monkeypatch) -> None:
    """Past `WAIT_SHARE` of the round's length the scoring stops at its next forward pass: once the
    hook returns nothing reads φ, and the peers scored by then keep their scores."""
    monkeypatch.setattr(scoring, "WAIT_SHARE", 0.0)
    live = LiveRound(run, monkeypatch)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(live.scorer.run)
            await trio.testing.wait_all_tasks_blocked()  # it waits for rounds
            live.scorer.on_round(live.screening)
            await trio.testing.wait_all_tasks_blocked()  # the worker has begun
            await live.apply()
            await live.filed_event.wait()
            nursery.cancel_scope.cancel()
    assert not any(released for _, released in live.forwards)
    assert len(live.forwards) < 3 * sum(len(b) for b in live.batches.values())
    [scores] = live.filed
    expected = {s.peer: s for s in live.expected}
    assert all(expected[s.peer] == s for s in scores)
    assert live.scorer.scored == 0 and live.scorer.skipped == 1
