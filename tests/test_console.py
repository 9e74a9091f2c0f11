"""What a foreground node prints (`meshtrain.node.status.console`), on status documents without a node.

The formatters are pure: a status document in, text out. The plain (off-TTY) reporter says the
state when it changes, one line per completed round while training, and a wait once it has
lasted five seconds; the live (TTY) line is cut to the terminal and never wraps. `LiveStatus`
then runs against a scripted snapshot: nothing it prints comes after the block it wraps.
"""

from __future__ import annotations

import io
import logging

import trio

from meshtrain.node.status.console import (
    LiveStatus,
    Rate,
    RoundReporter,
    human_bytes,
    round_line,
    status_line,
)


def doc(
    state: str = "training",
    step: int = 120,
    rnd: int = 6,
    loss: float | None = 2.3456,
    peers: int = 3,
    waiting: str | None = None,
    parity: dict | None = None,
    sent: int = 0,
    phi_digest: str | None = None,
    eval_loss: float | None = None,
) -> dict:
    return {
        "node": {"peer_id": "12D3KooWself", "state": state, "started": 0.0, "uptime_s": 1.0},
        "training": {
            "step": step,
            "round": rnd,
            "loss": loss,
            "eval_loss": eval_loss,
            "bytes_sent": sent,
            "bytes_received": sent,
            "phi_round": rnd if phi_digest else None,
            "phi_digest": phi_digest,
            "parity": parity,
            "waiting": waiting,
        },
        "peers": [{"peer_id": f"p{i}"} for i in range(peers)],
    }


def test_live_line_shows_state_step_loss_peers_round_and_rate():
    line = status_line(doc(), 1.5 * 2**20)
    assert line == "training  step 120  loss 2.346  peers 3  round 6  1.5 MiB/s"
    assert "loss -" in status_line(doc(loss=None, state="starting", step=0), 0.0)


def test_live_line_says_what_it_waits_for_and_a_parity_problem_but_not_an_ok_one():
    waiting = "round 120: waiting for 2 peers to join (ab12cd34, 99ff0011)"
    line = status_line(doc(waiting=waiting, parity={"status": "minority", "agreeing": 1, "compared": 4}), 0.0)
    assert line.endswith("parity minority (1 of 4 agree)  waiting: " + waiting)
    for quiet in ({"status": "ok"}, {"status": "unchecked"}, {"status": "pending"}, None):
        assert "parity" not in status_line(doc(parity=quiet), 0.0)


def test_live_line_is_cut_to_the_terminal_width():
    line = status_line(doc(waiting="x" * 500), 0.0, width=60)
    assert len(line) == 60 and line.endswith("…")
    assert status_line(doc(), 0.0, width=200) == status_line(doc(), 0.0)


def test_round_line_has_the_round_its_numbers_and_the_phi_digest():
    line = round_line(doc(rnd=12, step=600, eval_loss=2.4, phi_digest="3fa9c2d1deadbeef", peers=4), 2048)
    assert line == "round 12  step 600  loss 2.346  eval 2.400  peers 4  2.0 KiB/s  phi 3fa9c2d1"
    assert round_line(doc(parity={"status": "minority"}), 0).endswith("parity minority")


def test_human_bytes():
    assert [human_bytes(x) for x in (0, 1023, 1024, 5 * 2**20, 3 * 2**30, 2**45)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 MiB",
        "3.0 GiB",
        "32768.0 GiB",
    ]


def test_rate_averages_a_bursty_counter_over_its_window():
    r = Rate(window=10)
    assert r.add(0.0, 0) == 0.0
    assert r.add(1.0, 1000) == 1000.0
    assert r.add(2.0, 1000) == 500.0  # a burst per round, spread over the window
    for t in range(3, 30):
        rate = r.add(float(t), 1000)
    assert rate == 0.0  # the burst has left the window
    assert Rate().add(5.0, 10) == 0.0  # one sample: no rate yet


def test_plain_reporter_says_states_that_came_and_went_between_two_polls():
    """A node that trains 7 rounds and stops between two polls still reads starting -> training
    -> stopping: the status document lists its recent states (found by a CI run under load)."""

    def node_doc(states: list[str], changes: int) -> dict:
        d = doc(state=states[-1], rnd=0)
        d["node"].update(state_changes=changes, recent_states=states)
        return d

    rep = RoundReporter()
    assert rep.lines(node_doc(["starting"], 0), 0.0) == ["state: starting"]
    assert rep.lines(node_doc(["starting", "training", "stopping"], 2), 0.5) == [
        "state: starting -> training",
        "state: training -> stopping",
    ]
    assert rep.lines(node_doc(["starting", "training", "stopping"], 2), 1.0) == []
    # More changes than the node remembers: the ones it still lists, in order.
    rep2 = RoundReporter()
    rep2.lines(node_doc(["starting"], 0), 0.0)
    assert rep2.lines(node_doc(["training", "syncing", "training"], 6), 0.5) == [
        "state: starting -> syncing",
        "state: syncing -> training",
    ]


def test_plain_reporter_says_state_changes_and_one_line_per_round_while_training():
    rep = RoundReporter()
    assert rep.lines(doc(state="starting", rnd=0, step=0), 0.0) == ["state: starting"]
    assert rep.lines(doc(state="starting", rnd=0, step=0), 0.5) == []
    # A checkpoint resumed at round 40 is not a round we trained: no round line.
    assert rep.lines(doc(state="syncing", rnd=40, step=400), 1.0) == ["state: starting -> syncing"]
    assert rep.lines(doc(state="training", rnd=40, step=401), 1.5) == ["state: syncing -> training"]
    assert rep.lines(doc(state="training", rnd=40, step=409), 2.0) == []
    out = rep.lines(doc(state="training", rnd=41, step=410), 2.5, bytes_per_s=1024)
    assert out == [round_line(doc(state="training", rnd=41, step=410), 1024)]
    assert rep.lines(doc(state="training", rnd=41, step=415), 3.0) == []
    # Two rounds between two polls: one line, for the latest.
    assert [x.split("  ")[0] for x in rep.lines(doc(rnd=43), 3.5)] == ["round 43"]
    # The last round finished while stopping still gets its line.
    assert rep.lines(doc(state="stopping", rnd=44), 4.0) == [
        "state: training -> stopping",
        round_line(doc(state="stopping", rnd=44), 0),
    ]


def test_plain_reporter_says_a_wait_once_it_lasted_five_seconds_and_again_when_it_changes():
    rep = RoundReporter(wait_notice=5.0)
    rep.lines(doc(), 0.0)
    w1 = "round 7: waiting for 2 peers to join (ab12cd34, 99ff0011)"
    assert rep.lines(doc(waiting=w1), 10.0) == []
    assert rep.lines(doc(waiting=w1), 14.9) == []
    assert rep.lines(doc(waiting=w1), 15.0) == [f"waiting (5 s): {w1}"]
    assert rep.lines(doc(waiting=w1), 30.0) == []  # said once
    w2 = "round 7: waiting for 1 peer to join (99ff0011)"
    assert rep.lines(doc(waiting=w2), 31.0) == [f"waiting (21 s): {w2}"]  # what it waits for changed
    rep2 = RoundReporter(wait_notice=5.0)
    rep2.lines(doc(), 0.0)
    rep2.lines(doc(waiting=w1), 1.0)
    assert rep2.lines(doc(waiting=w1), 6.0) == [f"waiting (5 s): {w1}"]
    assert rep2.lines(doc(waiting=w2), 8.0) == []  # changed 2 s after the last notice: not yet
    assert rep2.lines(doc(waiting=w2), 11.0) == [f"waiting (10 s): {w2}"]
    # A wait that ends and starts again starts its clock again.
    assert rep2.lines(doc(), 12.0) == []
    assert rep2.lines(doc(waiting=w1), 13.0) == []
    assert rep2.lines(doc(waiting=w1), 18.0) == [f"waiting (5 s): {w1}"]


class Script:
    """A snapshot that follows a script of documents, one per call, then repeats the last."""

    def __init__(self, docs: list[dict]) -> None:
        self.docs, self.calls = docs, 0

    def __call__(self) -> dict:
        d = self.docs[min(self.calls, len(self.docs) - 1)]
        self.calls += 1
        return d


def plain_events(out: io.StringIO) -> tuple[list[str], str]:
    """The events LiveStatus printed off a TTY (each line's text after its time stamp, without
    the columns after it), and the last line (what the test wrote after the block)."""
    lines = out.getvalue().splitlines()
    return [x.split(" ", 1)[1].split("  ")[0] for x in lines[:-1]], lines[-1]


async def test_plain_output_prints_round_lines_and_nothing_after_the_block():
    out = io.StringIO()
    snap = Script([doc(state="starting", rnd=0), doc(rnd=0), doc(rnd=1), doc(rnd=2), doc(rnd=2)])
    async with LiveStatus(snap, out, tty=False, interval=0.01):
        while snap.calls < 6:
            await trio.sleep(0.01)  # sleep: poll interval
    out.write("{json}\n")
    await trio.sleep(0.05)  # sleep: time for a line after the block to show (none may)
    events, last = plain_events(out)
    assert events == [
        "state: starting",
        "state: starting -> training",
        "round 1",
        "round 2",
    ]
    assert last == "{json}"


async def test_a_run_shorter_than_a_poll_still_ends_its_plain_lines_with_its_last_state_and_round():
    """One poll while starting, then the block is left before the next: the last read, as the
    block is left, still prints the change of state and the last round (a busy machine once
    delayed every poll of a short CLI run past its end, and it printed only `state: starting`)."""
    out = io.StringIO()
    stopping = doc(state="stopping", rnd=3)
    stopping["node"] |= {"state_changes": 2, "recent_states": ["starting", "training", "stopping"]}
    snap = Script([doc(state="starting", rnd=0), stopping])
    async with LiveStatus(snap, out, tty=False, interval=60):
        while snap.calls < 1:
            await trio.sleep(0.01)  # sleep: poll interval
    out.write("{json}\n")
    events, last = plain_events(out)
    assert events == [
        "state: starting",
        "state: starting -> training",
        "state: training -> stopping",
        "round 3",
    ]
    assert last == "{json}" and snap.calls == 2


async def test_live_line_is_redrawn_in_place_and_ends_with_a_newline():
    out = io.StringIO()
    snap = Script([doc(step=1), doc(step=2), doc(step=3)])
    async with LiveStatus(snap, out, tty=True, interval=0.01):
        with trio.fail_after(10):  # wait for the third draw, not just the third snapshot
            while "step 3" not in out.getvalue():
                await trio.sleep(0.01)  # sleep: poll interval
    text = out.getvalue()
    assert text.startswith("\rtraining  step 1  ") and "\rtraining  step 3  " in text
    assert text.endswith("\n") and text.count("\n") == 1


async def test_a_failing_snapshot_never_stops_the_node(caplog):
    calls: list[int] = []

    def broken() -> dict:
        calls.append(1)
        raise KeyError("training")

    out = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        async with LiveStatus(broken, out, tty=False, interval=0.01):
            with trio.fail_after(10):  # several polls fail, and the node goes on
                while len(calls) < 3:
                    await trio.sleep(0.01)  # sleep: poll interval
    assert out.getvalue() == ""
    assert sum("status line failed" in r.getMessage() for r in caplog.records) == 1
