"""Verification end to end: an open swarm of four real `Node`s on loopback (gpt-tiny,
robust by default), one of them an adversary (`MESHTRAIN_ADVERSARY`, node/trust/adversary.py). The
honest owners flag its contributions, file strikes, and after `spec.verification.strikes` rounds every honest
peer excludes it; no honest peer is ever excluded (with screening alone, never even flagged), and
the rounds go on without it. A replay of its first update passes norm and direction screening
while it points the right way; replay screening (collective/echoes.py, on by default) drops and
flags it from its second round on, as an echo of its first; with that off, loss scoring (node/trust/scoring.py)
scores it on the adversary's own assigned batches, and with loss scoring off too, replay
spot-checks (node/trust/spot_check.py) catch it: it does not follow a recomputation of the adversary's
first inner steps. A replay that also publishes φ digests other than its own (`replay-phi`) is
passed over by spot-checks for a few rounds (node/trust/strikes.py, `lineage_passes`), then struck out
by them all the same."""

from __future__ import annotations

import pytest
import trio

import meshtrain
from meshtrain.node.state import run_state
from meshtrain.node.trust import adversary
from meshtrain.transport.identity import Identity

from .test_aggregation_swarm import mesh_config

pytestmark = pytest.mark.slow

PEERS = 4
H = 2


@pytest.mark.parametrize(
    ("mode", "h", "batch", "rounds", "samples", "spot", "overrides"),
    # Screening's modes with screening alone (at batch 4 and H 2 an honest update's loss change on
    # its own batch is noise, node/trust/scoring.py). A replay passes screening while it looks fresh and
    # is left to loss scoring, which needs updates worth scoring: the benchmark's H 10 and batch 8,
    # every peer scored every round, and rounds past the first two (a replay of round 1 is honest
    # in round 1 and barely stale in round 2).
    # Twelve rounds at H 10: which rounds loss scoring flags a replay in varies with the peers'
    # assigned data, and CI once saw its third strike only in round 9 of 9, which still held it.
    # Spot-checks: loss scoring off, every peer checked on its first 5 of 10 steps every round.
    # Replay screening (echo, the spec's default) alone catches the replay at screening's scale;
    # the loss scoring and spot-check cases turn it off to test those alone, and the spot-check
    # case the direction rule too (a replay drifting from the swarm's direction was struck out by
    # it before spot strikes counted, in 1 run of ~10; `screen_alignment` 0 once still flagged a
    # negative cosine, and CI saw it do so in rounds 4 and 5).
    [
        ("signflip10", H, 4, 16, 0, 0, {}),
        ("zeros", H, 4, 16, 0, 0, {}),
        ("replay", H, 4, 16, 0, 0, {}),
        ("replay", 10, 8, 12, PEERS, 0, {"screen_echo": 0.0}),
        ("replay", 10, 8, 12, 0, 5, {"screen_echo": 0.0, "screen_alignment": 0.0}),
        ("replay-phi", 10, 8, 12, 0, 5, {"screen_echo": 0.0, "screen_alignment": 0.0}),
    ],
)
async def test_an_adversary_is_struck_out_and_no_honest_peer_is_excluded(
    tmp_path, monkeypatch, mode, h, batch, rounds, samples, spot, overrides
) -> None:
    monkeypatch.setattr(run_state, "ENTER_WAIT", 1.0)  # a fresh swarm: nobody to wait for
    # The swarm trains until every honest peer has excluded the adversary, has run at least
    # `rounds` rounds, and has completed a round without it (`struck_out`), then stops. A fixed step
    # count was load-sensitive: on a loaded machine loss scoring cuts short the rounds whose result
    # it would hold back past `WAIT_SHARE` of the round (node/trust/scoring.py; it skipped rounds it
    # fell behind on before), and strikes travel by anti-entropy (~1.5 s)
    # until the first gossip mesh forms, so the third strike could land after the last round. How
    # many rounds exclusion takes is scripts/bench/bench_adversarial.py's measure, not this test's.
    spec = meshtrain.SwarmSpec(
        model="gpt-tiny",
        H=h,
        steps=0,
        batch_size=batch,
        eval_every=0,
        pow_bits=4,
        score_samples=samples,
        spot_check_steps=spot,
        spot_check_samples=PEERS,
        **overrides,
    )
    assert spec.aggregation.rule == "trimmed_mean" and spec.verification.strikes == 3  # the open swarm's defaults
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "n0"))
    nodes: list[meshtrain.Node] = []
    histories: dict[int, list] = {}  # each honest peer's rounds when the swarm was stopped

    def struck_out(n: meshtrain.Node, liar: str) -> bool:
        standing = n.presence.standing().get(liar)
        history = n.trainer.outer.history if n.trainer is not None else []
        return (
            standing is not None
            and standing.excluded
            and len(history) >= rounds
            and history[-1].contributors == PEERS - 1
        )

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            honest_done = trio.Semaphore(0)
            for i in range(PEERS):
                if i == PEERS - 1:
                    monkeypatch.setenv(adversary.ENV, mode)  # read once, as this node is built
                node = meshtrain.Node(mesh_config(tmp_path / f"n{i}", nodes, PEERS), spec=signed)
                monkeypatch.delenv(adversary.ENV, raising=False)
                nodes.append(node)

                async def run(node=node) -> None:
                    await node.run()
                    if node.adversary is None:
                        honest_done.release()

                nursery.start_soon(run)
                while node.host is None:
                    await trio.sleep(0.05)  # sleep: poll interval
            *honest_nodes, adversarial = nodes
            while not all(struck_out(n, adversarial.host.peer_id) for n in honest_nodes):
                await trio.sleep(0.05)  # sleep: poll interval
            for i, n in enumerate(honest_nodes):  # what the swarm did, before stopping cuts a round short
                histories[i] = list(n.trainer.outer.history)
                n.stop()
            for _ in range(PEERS - 1):
                await honest_done.acquire()
            if mode == "signflip10":  # shut out, it re-syncs (as its missed rounds make it): its status says why
                liar = nodes[-1]  # nobody serves it, not "state download from N peers"
                liar.trainer.outer.needs_resync = True
                with trio.fail_after(10):
                    while "does not admit" not in (liar.snapshot()["training"]["waiting"] or ""):
                        await trio.sleep(0.05)  # sleep: poll interval
            nodes[-1].stop()  # the adversary, shut out, would train alone until its last step
    *honest, liar = nodes
    assert liar.adversary == mode and all(n.adversary is None for n in honest)
    for i, n in enumerate(honest):
        standing = n.presence.standing()
        assert standing[liar.host.peer_id].excluded, standing
        others = {p: s for p, s in standing.items() if p != liar.host.peer_id}
        if samples or spot:
            # Loss scoring at this scale (batch 8, one batch per score) flags an honest peer by a
            # quorum in a round now and then (node/trust/scoring.py, "Not caught"; 3 of 25 runs here),
            # and so do spot-checks (two owners in one round while the replay was in it, 1 of 6
            # runs here): the promise is that such a round never adds up to an exclusion.
            assert all(not s.excluded and s.rounds < spec.verification.strikes for s in others.values()), standing
        else:
            assert not others, standing
        history = histories[i]
        # It took part at first (a fast swarm's very first round may form before the last of
        # the four is connected, so not necessarily in round one) ...
        assert any(r.contributors == PEERS for r in history)
        assert history[-1].contributors == PEERS - 1  # ... and is out by the end
        assert n.presence.strikes.path.exists()
    # The status page shows each peer's standing.
    doc = honest[0].snapshot()
    shown = doc["node"]["admission"]["standing"][liar.host.peer_id]
    assert shown["excluded"] and shown["strikes"] >= 3
    assert list(doc["node"]["admission"]["ignored"]) == [liar.host.peer_id]
    assert all(p["strikes"] < spec.verification.strikes if samples or spot else p["strikes"] == 0 for p in doc["peers"])
    if samples:
        # Every owner scored rounds. Whether loss strikes or screening's count first against a
        # replay of round 1 within 12 rounds varies from run to run (screening flags it once it has
        # drifted from the swarm's direction, at round 3 to 5); that loss scoring flags replay
        # and other data by a quorum, and no honest peer, is tests/test_scoring.py's.
        assert all(n.scorer is not None and n.scorer.scored > 0 for n in honest)
        assert doc["node"]["admission"]["loss_scoring"]["scored"] > 0
        assert doc["node"]["admission"]["loss_scoring"]["waited_s"] >= 0  # how long results waited for it
    if spot:  # every owner spot-checked rounds, and spot strikes made most of the replay's counted rounds
        # (norm screening could still flag it in a round: then not by spot). replay-phi's spot
        # verdicts count only past its passes (3 rounds later): by then its round-1 update has
        # drifted enough for norm screening to flag it in some runs (CI: rounds 7 and 8, with spot
        # strikes in round 5 and checks skipped under load after), so one spot round is its promise.
        assert all(n.spot_checker is not None and n.spot_checker.checked > 0 for n in honest)
        by_spot = [n.presence.standing()[liar.host.peer_id].by_spot for n in honest]
        assert all(b >= (1 if mode == "replay-phi" else 2) for b in by_spot), by_spot
        assert doc["node"]["admission"]["spot_check"]["checked"] > 0
    if mode == "replay-phi":  # it held another φ on every honest peer: its spot strikes came past the passes
        assert sum(n.presence.strikes.filed_other_phi for n in honest) >= 2, doc["node"]["admission"]["other_phi"]
    if mode == "replay" and not overrides:  # every counted round of the replay was an echo's
        standings = [n.presence.standing()[liar.host.peer_id] for n in honest]
        assert all(s.by_echo == s.rounds >= spec.verification.strikes for s in standings), standings
        assert shown["by_echo"] == shown["strikes"]
