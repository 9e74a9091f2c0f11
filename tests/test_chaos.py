"""Chaos: real node processes under random SIGKILL, restart and SIGSTOP (and a netns partition
when root) keep training, never exit on their own and never leave a corrupt checkpoint; live
peers agree on φ within a round of any disagreement.

The soak itself is `scripts/bench/bench_chaos.py` (10 minutes by default); here it runs CI-sized:
4 nodes, 60 s of chaos, under 2 minutes in all. The parity rule is pinned without processes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts.bench.bench_chaos import PARITY_HEAL_S, Life, Monitor

from .conftest import ROOT

SOAK_MINUTES = 1.0
SOAK_NODES = 4


def _observe(m: Monitor, node: int, t: float, peer: str, history: list[list]) -> None:
    life = Life(gen=0, kind="join", pid=0, started=0.0, log_line=1)
    st = {
        "node": {"peer_id": peer, "state": "training"},
        "training": {"round": history[-1][0] if history else 0, "phi_history": history},
    }
    m.observe(SimpleNamespace(i=node), life, t, st)  # type: ignore[arg-type]


def test_parity_is_unknown_not_zero_while_nodes_report_no_digests():
    m = Monitor()
    _observe(m, 0, 1.0, "peer-a", [])
    out = m.parity()
    assert out["parity_violations"] is None
    assert "phi_history" in out["parity_reason"]


def test_minority_peer_that_matches_the_swarm_a_round_later_is_not_a_violation():
    m = Monitor()
    _observe(m, 0, 1.0, "peer-a", [[5, "aa"], [6, "ab"], [7, "ac"], [8, "ad"]])
    _observe(m, 1, 1.0, "peer-b", [[5, "aa"], [6, "ab"], [7, "ac"], [8, "ad"]])
    _observe(m, 2, 1.0, "peer-c", [[5, "zz"], [6, "ab"], [7, "ac"], [8, "ad"]])  # re-synced at 6
    out = m.parity()
    assert out["parity_violations"] == 0
    assert out["parity_split_rounds"] == 1


def test_minority_peer_still_apart_two_rounds_later_is_a_violation():
    m = Monitor()
    _observe(m, 0, 1.0, "peer-a", [[5, "aa"], [6, "ab"], [7, "ac"], [8, "ad"]])
    _observe(m, 1, 1.0, "peer-b", [[5, "aa"], [6, "ab"], [7, "ac"], [8, "ad"]])
    _observe(m, 2, 1.0, "peer-c", [[5, "zz"], [6, "zy"], [7, "zx"], [8, "zw"]])  # silent divergence
    out = m.parity()
    assert out["parity_violations"] >= 1
    assert {v["round"] for v in out["parity_violation_list"]} >= {5}
    assert all(v["peer"] == "peer-c"[-8:] for v in out["parity_violation_list"])


def test_minority_peer_that_rejoins_the_plurality_within_seconds_but_three_rounds_on_is_healed():
    """Rounds of a few steps outrun the node's timed parity check (a lone creator did 5 a second
    and was caught as the minority three rounds after a stale majority forked: seen in CI)."""
    m = Monitor()
    majority = [[5, "aa"], [6, "ab"], [7, "ac"], [8, "ad"], [9, "ae"]]
    _observe(m, 0, 1.0, "peer-a", majority)
    _observe(m, 1, 1.0, "peer-b", majority)
    _observe(m, 2, 1.0, "peer-c", [[5, "zz"], [6, "zy"], [7, "zx"]])
    _observe(m, 2, 2.0, "peer-c", [[8, "ad"], [9, "ae"]])  # re-synced within a second
    assert m.parity()["parity_violations"] == 0


def test_minority_peer_that_rejoins_only_after_the_heal_time_is_a_violation():
    m = Monitor()
    majority = [[5, "aa"], [6, "ab"], [7, "ac"], [8, "ad"], [9, "ae"]]
    _observe(m, 0, 1.0, "peer-a", majority)
    _observe(m, 1, 1.0, "peer-b", majority)
    _observe(m, 2, 1.0, "peer-c", [[5, "zz"], [6, "zy"], [7, "zx"]])
    _observe(m, 2, 1.0 + PARITY_HEAL_S + 1, "peer-c", [[8, "ad"], [9, "ae"]])
    out = m.parity()
    assert out["parity_violations"] >= 1 and out["parity_violation_list"][0]["round"] == 5


def test_a_tie_goes_to_the_lowest_peer_id_as_on_the_node():
    """Two lineages of one peer each: the node's rule (`parity.winning_digest`) keeps the lowest
    peer id's and re-syncs the other. Seen in CI: the lowest id, which trained on correctly while
    its tied twin was killed, was judged a violation because a tie had no plurality at all."""
    m = Monitor()
    for t, r in ((1.0, 5), (2.0, 6), (3.0, 7)):
        _observe(m, 0, t, "peer-a", [[r, f"a{r}"]])
        _observe(m, 1, t, "peer-b", [[r, f"b{r}"]])  # then killed before it could re-sync
    for t, r in ((1.0 + PARITY_HEAL_S + 1, 8), (1.0 + PARITY_HEAL_S + 2, 9)):
        _observe(m, 0, t, "peer-a", [[r, f"a{r}"]])
    out = m.parity()
    assert out["parity_violations"] == 0
    assert out["parity_unresolved"] >= 1
    assert {u["peer"] for u in out["parity_unresolved_list"]} == {"peer-b"}


def test_the_loser_of_a_tie_that_stays_apart_is_a_violation():
    m = Monitor()
    for t, r in ((1.0, 5), (2.0, 6), (3.0, 7), (4.0, 8), (5.0, 9)):
        _observe(m, 0, t, "peer-a", [[r, f"a{r}"]])
        _observe(m, 1, t, "peer-b", [[r, f"b{r}"]])
    out = m.parity()
    assert out["parity_violations"] >= 1
    assert {v["peer"] for v in out["parity_violation_list"]} == {"peer-b"}


def test_minority_peer_not_seen_past_the_slack_is_unresolved_not_a_violation():
    m = Monitor()
    _observe(m, 0, 1.0, "peer-a", [[5, "aa"], [6, "ab"]])
    _observe(m, 1, 1.0, "peer-b", [[5, "aa"], [6, "ab"]])
    _observe(m, 2, 1.0, "peer-c", [[5, "zz"]])  # killed right after round 5
    out = m.parity()
    assert out["parity_violations"] == 0
    assert out["parity_unresolved"] == 1


def test_peer_training_far_behind_on_its_own_lineage_is_reported_as_behind_and_split():
    m = Monitor()
    _observe(m, 0, 0.0, "peer-a", [[1, "a1"], [2, "a2"], [8, "a8"]])  # the swarm's own early rounds
    for t in (1.0, 2.0, 8.0):
        r = 100 + int(t)
        _observe(m, 0, t, "peer-a", [[r - 1, f"a{r - 1}"], [r, f"a{r}"]])
        _observe(m, 1, t, "peer-b", [[r - 1, f"a{r - 1}"], [r, f"a{r}"]])
        # restarted without a checkpoint and cut off: rounds 1, 2, ... of a swarm of its own
        _observe(m, 2, t, "peer-c", [[int(t), f"c{int(t)}"]])
    out = m.parity()
    assert out["parity_violations"] == 0  # not "at the same round" as the live swarm ...
    assert out["parity_split_rounds"] >= 1  # ... but a second φ for a round is on record
    behind = m.behind_swarm()
    assert behind["max_behind_swarm_s"] >= 5.0
    assert behind["behind_swarm_episodes"][0]["node"] == "node2"


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("chaos")
    r = subprocess.run(
        [
            sys.executable,
            "scripts/bench/bench_chaos.py",
            "--minutes",
            str(SOAK_MINUTES),
            "--nodes",
            str(SOAK_NODES),
            "--seed",
            "1",
            "--spare",
            str(SOAK_NODES - 1),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _brief(result: dict) -> str:
    keys = (
        "join_failure_list",
        "corrupt_checkpoint_list",
        "actions",
        "rounds_completed_swarm",
        "max_roundless_gap_s",
        "log_findings",
        "unclean_shutdowns",
        "run_dir",
    )
    return json.dumps({k: result.get(k) for k in keys}, indent=1)[:6000]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_no_node_exits_on_its_own_and_no_checkpoint_is_corrupt_under_chaos(soak):
    assert soak["actions"].get("kill", 0) >= 1 and soak["actions"].get("restart", 0) >= 1, _brief(soak)
    assert soak["join_failures"] == 0, _brief(soak)
    assert soak["corrupt_checkpoints"] == 0, _brief(soak)
    assert soak["checkpoints_checked"] >= 1, _brief(soak)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_spared_node_is_never_killed_so_one_process_lives_the_whole_soak(soak):
    """`--spare`: the node whose process the soak measures memory growth over a whole run by."""
    assert soak["spare"] == SOAK_NODES - 1
    events = [json.loads(line) for line in (Path(soak["run_dir"]) / "events.jsonl").read_text().splitlines()]
    killed = {e["node"] for e in events if e.get("event") == "sigkill"}
    assert killed and soak["spare"] not in killed, _brief(soak)
    of_spare = [e["event"] for e in events if e.get("node") == soak["spare"]]
    assert of_spare.count("restart") <= of_spare.count("exited_on_its_own"), of_spare  # restarted only if it died


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_swarm_keeps_completing_rounds_under_chaos(soak):
    assert soak["rounds_completed_swarm"] >= 10, _brief(soak)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_live_peers_agree_on_phi_within_a_round_under_chaos(soak):
    # A soak that measured no parity at all is a failure, not a pass: nothing was checked.
    assert soak["parity_violations"] is not None, f"parity not measured: {soak.get('parity_reason')}"
    assert soak["parity_violations"] == 0, _parity_story(soak)


STORY = re.compile(
    r"proceeding alone|out of step|nobody is training|joined the swarm|fixing the group|behind the swarm|"
    r"minority|re-sync|=== chaos"
)


def _parity_story(soak: dict) -> str:
    """The violations, and what every node's log said about rounds and re-syncs around them
    (CI keeps no run directory: this message is all there is to read afterwards)."""
    lines = [json.dumps(soak.get("parity_violation_list"), indent=1)]
    for log in sorted(Path(soak["run_dir"]).glob("node*.log")):
        story = [line[:220] for line in log.read_text(errors="replace").splitlines() if STORY.search(line)]
        lines += [f"--- {log.name}", *story[-40:]]
    return "\n".join(lines)[-12000:]


def test_swarm_that_lost_its_front_and_retrains_old_rounds_is_reported_as_redone_not_parity():
    m = Monitor()
    _observe(m, 0, 1.0, "peer-a", [[49, "a49"], [50, "a50"]])
    _observe(m, 1, 1.0, "peer-b", [[49, "a49"], [50, "a50"]])
    # peers a and b are killed; c and d come back from older checkpoints and redo rounds 41-45
    _observe(m, 2, 60.0, "peer-c", [[44, "c44"], [45, "c45"]])
    _observe(m, 3, 60.0, "peer-d", [[44, "c44"], [45, "c45"]])
    out = m.parity()
    assert out["parity_violations"] == 0
    assert out["rounds_redone"] == 2
