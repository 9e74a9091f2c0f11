"""A grouped swarm as users run it: real `meshtrain node start` processes with the spec's
`group_size` set and a small connection bound (`--max-peers`), a late joiner, and rounds grouped as
collective/groups.py designs it.

Five daemons (groups of at most 3, so every round runs in groups; 12 daemons with groups of 4, as
issue 32 asks, do not fit the 2-core CI machine beside the rest of the suite: they run in
scripts/bench/bench_grouped_swarm.py, which also reads every daemon's connections) train; a sixth joins
late through the first one's address. It announces the round from which it is in the roster,
ahead (node/roster.py), so every daemon computes each round's groups from the same trainers: after
its first round every daemon averaged exactly with its group of `round_groups` (the trainers, the
round index, the spec's seed), as each one's status lists who took part in its newest exchanges
(`round_peers`), and every daemon holds the same roster for those rounds. Parity is "unchecked"
while rounds run in groups; once three daemons leave, the three left are one group, and parity
resumes: checked, "ok", one φ digest.

What it does not check, and why:
- φ digests. The consensus term (optim/outer.py, "Grouped rounds") makes a group's φ its members'
  mean only up to rounding when their φ differed before the round, so a group's daemons rarely
  hold one digest (tests/test_grouped_rounds.py checks the identity with a tolerance).
- The connection bound. Every daemon runs with `--max-peers 3`, so presence's bounded plan and its
  closing of the surplus are in play while the rounds run (and the rounds above still form), but
  with six peers on a 3 x 2 grid a peer's partners over three rounds are 3.6 of its 5 peers on
  average, and presence keeps the partners of its rounds under way and of its neighbours' (a round
  apart) beyond the bound: with sub-second rounds every daemon is connected to nearly all the
  others (~70% of samples over 3, measured). The bound itself is tested where it holds:
  tests/test_presence_plan.py (the plan), scripts/bench/bench_scale.py (hundreds of peers); what
  real daemons hold is measured by scripts/bench/bench_grouped_swarm.py (`node.connections`: over
  the bound, closed connections being opened again; docs/benchmarks.md).
"""

from __future__ import annotations

import signal
import time

import pytest

from meshtrain.collective.groups import round_groups
from meshtrain.optim.outer import JOIN_WARMUP_STEPS

from .test_daemon_matrix import status
from .test_node_cli import create, no_daemon_outlives_its_test, start, wait_daemon  # noqa: F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # each wait fails once the swarm stops moving (`until`), not at a fixed pace
    # Gated off until stop 47: under load, rounds around each join re-synced in chains and a
    # group of 2 was averaged alone. Three causes, fixed: the consensus term's second exchange
    # waited for a member that had left the Δ exchange (it now runs among the Δ exchange's
    # members: RoundRequest.among); a coordinator waited for its own trainer, gone on to a later
    # round (collective/own_rounds.py); presence closed an old connection to a partner of the
    # round after next the moment it left the plan, and that round ran without it
    # (node/connections.py `UnwantedSince`). A joiner's warm-up (weight 0) now shows in
    # `round_peers` too (the round's members, not only its contributors). After stop 47 (CI, and
    # 3 of 5 runs here two at a time): when three daemons left, each survivor still counted a
    # different one of them and entered the round under another group's tag, and all three
    # waited out the hard deadline (90 s) for each other; the coordinator's probe now finds them
    # under the other tags and has them regroup (collective/coordinator.py, "Groups that disagree").
]

GROUP_SIZE = 3
MAX_PEERS = 3
SEED = 7
H = 2


def test_a_grouped_swarm_takes_a_late_joiner_into_rounds_every_daemon_groups_alike(tmp_path):
    flags = ("--model", "gpt-tiny", "--steps", "0", "--H", str(H), "--eval-every", "0", "--seed", str(SEED))
    dirs = [tmp_path / f"n{i}" for i in range(6)]
    logs = [tmp_path / f"n{i}.log" for i in range(6)]
    create(dirs[0], *flags, "--group-size", str(GROUP_SIZE))
    bound = ("--max-peers", str(MAX_PEERS))
    procs = [start("--data-dir", str(dirs[0]), *bound, log=logs[0])]
    infos = [wait_daemon(dirs[0], procs[0], logs[0])]
    join = ("--join", infos[0]["addrs"][0])
    for i in range(1, 5):
        procs.append(start("--data-dir", str(dirs[i]), *join, *bound, log=logs[i]))
    infos += [wait_daemon(dirs[i], procs[i], logs[i]) for i in range(1, 5)]

    def until(what: str, k: int, done, stalled: float = 60.0, timeout: float = 240.0) -> list[dict]:
        """Poll the first k daemons until they all train and `done(statuses)`. Fails once no
        daemon's step has moved for `stalled` seconds, or after `timeout`: on a loaded machine
        (two daemon tests and stress-ng on two cores) rounds of H = 2 took 3-5 s, and the
        swarm was still moving when a fixed 60 s ran out."""
        start = moved = time.monotonic()
        steps: list[int | None] = []
        while True:
            sts = [status(i) for i in infos[:k]]
            if all(s and s["node"]["state"] == "training" for s in sts) and done(sts):
                return sts  # type: ignore[return-value]
            now = time.monotonic()
            now_steps = [s and s["training"]["step"] for s in sts]
            if now_steps != steps:
                steps, moved = now_steps, now
            if now - moved > stalled or now - start > timeout:
                break
            time.sleep(0.3)  # sleep: poll interval
        where = [s and (s["node"]["state"], s["training"]["step"], s["training"]["waiting"]) for s in sts]
        stuck = f"no step moved for {now - moved:.0f} s" if now - moved > stalled else f"{timeout:.0f} s passed"
        raise AssertionError(f"timed out waiting for {what} ({stuck}): {where} (logs follow)")

    until("five daemons training", 5, lambda sts: True)
    procs.append(start("--data-dir", str(dirs[5]), *join, *bound, log=logs[5]))
    infos.append(wait_daemon(dirs[5], procs[5], logs[5]))
    ids = [i["peer_id"] for i in infos]

    def entered(st: dict) -> dict[str, int]:
        """The round (index) from which each trainer is in the roster, as a daemon's view says."""
        return {p["peer_id"]: p["in_from"] // H for p in st["peers"] if p["role"] == "trainer"}

    def averaged(st: dict) -> dict[int, list[str]]:
        """Round (index) -> who took part in that exchange, for a daemon's newest exchanges."""
        return {step // H: peers for step, peers in st["training"]["round_peers"]}

    def checked_rounds(sts: list[dict]) -> list[int]:
        """The newest two rounds after the joiner's weight-0 ones (its first, and as many more as
        `JOIN_WARMUP_STEPS` of its own take: its partners' reports leave it out of those) that
        every daemon's newest exchanges list."""
        first = entered(sts[5]).get(ids[5])
        rounds = set.intersection(*(set(averaged(s)) for s in sts))
        warm = -(-JOIN_WARMUP_STEPS // H)
        return [] if first is None else sorted(r for r in rounds if r > first + warm)[-2:]

    sts = until("six daemons with two rounds in common", 6, lambda sts: len(checked_rounds(sts)) == 2)
    for r in checked_rounds(sts):
        # Every daemon holds the same roster for the round: the joiner in from the round it announced.
        rosters = {tuple(sorted(p for p, e in entered(s).items() if e <= r)) for s in sts}
        assert rosters == {tuple(sorted(ids))}, (r, rosters)
        groups = round_groups(ids, r, GROUP_SIZE, SEED)
        for peer, s in zip(ids, sts, strict=True):
            assert averaged(s)[r] == list(groups.groups[groups.index_of(peer)]), (r, peer, averaged(s)[r], groups)
    # Parity is paused while rounds run in groups (each group applies its own mean) ...
    assert {s["training"]["parity"]["status"] for s in sts} == {"unchecked"}, [s["training"]["parity"] for s in sts]

    # ... and resumes once they no longer do: three daemons leave (a clean stop), the other three
    # are a swarm of group_size, one group, and their φ agree again (the minority re-syncs).
    for p in procs[3:]:
        p.send_signal(signal.SIGINT)
    for p, log in zip(procs[3:], logs[3:], strict=True):
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]

    def agree(sts: list[dict]) -> bool:
        """Parity checked and ok on each, and one φ digest for a round all three hold."""
        if {s["training"]["parity"]["status"] for s in sts} != {"ok"}:
            return False
        held = [dict(s["training"]["phi_history"]) for s in sts]
        common = set.intersection(*(set(h) for h in held))
        return bool(common) and len({h[max(common)] for h in held}) == 1

    until("the three left to check parity and agree", 3, agree)
    for p in procs[:3]:
        p.send_signal(signal.SIGINT)
    for p, log in zip(procs[:3], logs[:3], strict=True):
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]
