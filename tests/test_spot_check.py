"""Replay spot-checks (node/trust/spot_check.py): an owner recomputes a sampled peer's
first inner steps from φ on its assigned batches and compares the result with the peer's update
on its part; an update that agrees with it less than the round's aggregate does, by a margin, is
flagged. Pure-function level with a real tiny model trained for real (DiLoCo rounds of gpt-tiny
on the built-in corpus in one process, every peer's inner AdamW kept across rounds as the
daemon's is), and the spot strike format, as a property."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.contract import sampled_peers
from meshtrain.collective.flat import flatten_fp32, part_bounds
from meshtrain.crdt.entries import CrdtError
from meshtrain.crdt.strikes import LOSS, SPOT, Strike
from meshtrain.errors import ConfigError
from meshtrain.models import Corpus
from meshtrain.models.sources import build_model
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec
from meshtrain.node.trust.spot_check import recompute_update, spot_check_round
from meshtrain.node.trust.strikes import StrikeBook, quorum, spot_flagged

from .test_screening import JUNK, PEERS

H, BATCH, CONTEXT = 10, 8, 32  # as tests/test_scoring.py and scripts/bench/bench_adversarial.py
HONEST = ["p0", "p1", "p2", "p3"]
LIARS = ("replay", "zeros", "lazy")  # "lazy": trains only the last 2 of its H steps
SPEC = SwarmSpec(model="gpt-tiny", H=H, batch_size=BATCH, spot_check_steps=H, spot_check_samples=5)


class Peer:
    """One peer's θ and inner AdamW, kept across rounds (θ ← φ at each round's start)."""

    def __init__(self, model: torch.nn.Module, corpus: Corpus, name: str) -> None:
        self.name, self.corpus = name, corpus
        self.model = copy.deepcopy(model)
        self.inner = torch.optim.AdamW(
            self.model.parameters(), lr=SPEC.outer.inner_lr, weight_decay=SPEC.outer.weight_decay
        )

    def train(self, phi: dict[str, torch.Tensor], steps: range) -> torch.Tensor:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(phi[n])
        for s in steps:
            x, y = self.corpus.batch(BATCH, CONTEXT, seed=0, peer=self.name, step=s)
            loss = self.model(x, y).loss
            self.inner.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), SPEC.outer.clip)
            self.inner.step()
        return flatten_fp32({n: phi[n] - p.detach() for n, p in self.model.named_parameters()})


@pytest.fixture(scope="module")
def fourth_round() -> dict:
    """φ after three DiLoCo rounds (trimmed mean, Nesterov SGD) of HONEST plus a replaying
    adversary, and round 4's updates: the honest peers', the replay of the adversary's round-1
    update, zeros, and a lazy peer's; each peer's recomputation of every update's first H steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        corpus = Corpus.default("chars")
        model = build_model("gpt-tiny", vocab_size=corpus.vocab_size, seed=0, context=CONTEXT)
        names = [n for n, _ in model.named_parameters()]
        phi = {n: p.detach().clone() for n, p in model.named_parameters()}
        momentum = {n: torch.zeros_like(p) for n, p in phi.items()}
        peers = {p: Peer(model, corpus, p) for p in [*HONEST, "lazy"]}
        first = None
        for r in (H, 2 * H, 3 * H):
            deltas = [peers[p].train(phi, range(r - H, r)) for p in HONEST]
            peers["lazy"].train(phi, range(r - 2, r))
            first = first if first is not None else Peer(model, corpus, "replay").train(phi, range(r - H, r))
            agg = torch.stack([*deltas, first]).sort(dim=0).values[1:-1].mean(dim=0)
            pos = 0
            for n in names:
                g = agg[pos : pos + phi[n].numel()].view(phi[n].shape)
                pos += phi[n].numel()
                momentum[n].mul_(0.9).add_(g)
                phi[n] -= SPEC.outer.outer_lr * (g + SPEC.outer.outer_momentum * momentum[n])
        r = 4 * H
        updates = {p: peers[p].train(phi, range(r - H, r)) for p in HONEST}
        updates["replay"] = first
        updates["zeros"] = torch.zeros_like(first)
        updates["lazy"] = peers["lazy"].train(phi, range(r - 2, r))
        # Every owner's recomputation of a peer's first H steps is the same (a fresh AdamW from φ).
        recomputed = {
            p: recompute_update(
                copy.deepcopy(model),
                phi,
                names,
                [corpus.batch(BATCH, CONTEXT, seed=0, peer=p, step=s) for s in range(r - H, r)],
                lr=SPEC.outer.inner_lr,
                weight_decay=SPEC.outer.weight_decay,
                clip=SPEC.outer.clip,
            )
            for p in updates
        }
    finally:
        torch.set_num_threads(threads)
    return {"updates": updates, "recomputed": recomputed}


def verdicts(round4: dict, liar: str) -> dict[str, int]:
    """How many honest owners (each on its own part) flag each peer of a round of HONEST + `liar`."""
    updates = round4["updates"]
    group = sorted([*HONEST, liar])
    agg = torch.stack([updates[p] for p in group]).sort(dim=0).values[1:-1].mean(dim=0)
    bounds = part_bounds(agg.numel(), len(group))
    flags = dict.fromkeys(group, 0)
    for j, owner in enumerate(group):
        if owner not in HONEST:
            continue  # the liar's verdicts count for nothing here
        part = (bounds[j], bounds[j + 1])
        samples = {p: updates[p][part[0] : part[1]] for p in group if p != owner}
        checks = spot_check_round(round4["recomputed"], part, samples, agg[part[0] : part[1]])
        assert {c.peer for c in checks} == set(samples)
        for c in checks:
            flags[c.peer] += spot_flagged(c.match, c.ref, SPEC)
    return flags


@pytest.mark.parametrize("liar", LIARS)
def test_a_replayed_empty_or_lazy_update_is_flagged_by_a_quorum_and_no_honest_one(fourth_round, liar) -> None:
    flags = verdicts(fourth_round, liar)
    need = quorum(len(HONEST) + 1)
    assert flags[liar] >= need, flags
    assert all(flags[p] < need for p in HONEST), flags
    assert sum(flags[p] for p in HONEST) == 0, flags  # not one honest part-check, in fact


def test_the_recomputation_is_the_trainers_own_steps_when_the_state_is_fresh() -> None:
    """From a fresh optimizer (a peer's first round) the recomputation is exactly what the peer
    computed: the tolerance is for the inner state kept across rounds, nothing else."""
    torch.manual_seed(0)
    corpus = Corpus.default("chars")
    model = build_model("gpt-tiny", vocab_size=corpus.vocab_size, seed=0, context=CONTEXT)
    names = [n for n, _ in model.named_parameters()]
    phi = {n: p.detach().clone() for n, p in model.named_parameters()}
    peer = Peer(model, corpus, "p0")
    update = peer.train(phi, range(0, 3))
    batches = [corpus.batch(BATCH, CONTEXT, seed=0, peer="p0", step=s) for s in range(3)]
    again = recompute_update(
        copy.deepcopy(model),
        phi,
        names,
        batches,
        lr=SPEC.outer.inner_lr,
        weight_decay=SPEC.outer.weight_decay,
        clip=SPEC.outer.clip,
    )
    assert torch.allclose(again, update, atol=1e-7)
    (check,) = spot_check_round({"p0": again}, (0, update.numel()), {"p0": update}, update)
    assert check.match == pytest.approx(1.0) and not spot_flagged(check.match, check.ref, SPEC)


def test_the_recomputation_trains_a_copy_of_phi_through_a_model_of_no_parameter_memory() -> None:
    """A spot-checker holds no model copy for the node's life (4 bytes per parameter): its model's
    parameters are on the meta device, each check trains a working copy of φ through it, and φ
    is left as it was; the result is the deep copy's, bit for bit."""
    from meshtrain.node.trust.scoring import scratch_model

    torch.manual_seed(0)
    corpus = Corpus.default("chars")
    model = build_model("gpt-tiny", vocab_size=corpus.vocab_size, seed=0, context=CONTEXT)
    names = [n for n, _ in model.named_parameters()]
    phi = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = {n: t.clone() for n, t in phi.items()}
    scratch = scratch_model(model, names)
    assert all(p.device.type == "meta" for p in scratch.parameters())
    batches = [corpus.batch(BATCH, CONTEXT, seed=0, peer="p0", step=s) for s in range(3)]
    knobs = {"lr": SPEC.outer.inner_lr, "weight_decay": SPEC.outer.weight_decay, "clip": SPEC.outer.clip}
    update = recompute_update(scratch, phi, names, batches, **knobs)
    assert torch.equal(update, recompute_update(copy.deepcopy(model), phi, names, batches, **knobs))
    assert all(torch.equal(phi[n], before[n]) for n in names)
    assert all(p.device.type == "meta" for p in scratch.parameters())


def test_the_spec_keys_and_the_sample() -> None:
    assert SwarmSpec(model="gpt-tiny").verification.spot_check_steps == 0  # off by default
    spec = SwarmSpec(model="gpt-tiny", spot_check_steps=5, spot_check_samples=3, score_samples=2)
    assert spec.aggregation_options()["score_samples"] == 3  # the collective keeps the larger sample
    assert SwarmSpec(model="gpt-tiny", score_samples=2).aggregation_options()["score_samples"] == 2
    group = tuple(f"peer{i}" for i in range(8))
    assert set(sampled_peers(group, b"\x01" * 32, 2)) <= set(sampled_peers(group, b"\x01" * 32, 3))
    with pytest.raises(ConfigError, match="at most H"):
        parse_spec({"model": "gpt-tiny", "H": 10, "spot_check_steps": 11})
    with pytest.raises(ConfigError, match="optimizer diloco"):
        parse_spec({"model": "gpt-tiny", "optimizer": "streaming", "spot_check_steps": 5})


def test_other_peers_count_a_spot_strike_only_with_evidence_and_a_sampled_peer() -> None:
    """What every peer re-checks before counting a spot strike (node/trust/strikes.py): the swarm
    spot-checks, the cosines break the rule, and the round's digest sampled the peer."""
    spec = SwarmSpec(model="gpt-tiny", spot_check_steps=5, spot_check_samples=1)
    view = SimpleNamespace(me=PEERS[0], replica=SimpleNamespace(on_change=lambda callback: None))
    book = StrikeBook(view, spec, admitted=lambda peer, caps: True)  # type: ignore[arg-type]
    group, digest = tuple(PEERS), b"\x05" * 32
    (chosen,) = sampled_peers(group, digest, 1)
    other = next(p for p in group if p not in (chosen, PEERS[1]))
    reporter = PEERS[1] if chosen != PEERS[1] else PEERS[2]

    def strike(peer: str, match: float, ref: float) -> Strike:
        return Strike(
            reporter, 40, "f0", peer, group, digest, group.index(reporter), 1.0, 0.5, SPOT, ref=ref, match=match
        )

    assert book.why_not_counted(strike(chosen, 0.1, 0.6), True) is None
    assert "no evidence" in book.why_not_counted(strike(chosen, 0.5, 0.6), True)
    assert "did not sample" in book.why_not_counted(strike(other, 0.1, 0.6), True)
    assert "not admitted" in book.why_not_counted(strike(chosen, 0.1, 0.6), False)
    book.spec = SwarmSpec(model="gpt-tiny")  # a swarm without spot-checks counts none
    assert "does not spot-check" in book.why_not_counted(strike(chosen, 0.1, 0.6), True)


@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(["rule", "match", "ref", "gain", "drop-match", "drop-ref", "drop-rule", None]),
    junk=JUNK,
    match=st.floats(-1, 1),
    ref=st.floats(-1, 1),
)
def test_a_spot_strike_round_trips_and_any_other_is_refused_with_a_crdt_error(field, junk, match, ref) -> None:
    """Spot strikes (crdt/strikes.py): a well-formed one survives its record, and a record with a
    spot field replaced by junk, missing, or a loss field added is still well-formed or refused
    with `CrdtError`, never another exception."""
    reporter, peer = PEERS[1], PEERS[3]
    strike = Strike(reporter, 40, "f0", peer, tuple(PEERS), b"\x05" * 32, 1, 1.0, 0.8, SPOT, ref=ref, match=match)
    record = strike.to_record()
    assert Strike.from_record(reporter, record) == strike and record["rule"] == SPOT and "gain" not in record
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
    assert parsed.rule in (SPOT, LOSS) or field == "rule"
    assert Strike.from_record(reporter, parsed.to_record()) == parsed
