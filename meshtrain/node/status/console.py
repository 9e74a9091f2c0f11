"""What a foreground node prints while it runs: a live status line on a terminal, plain lines
elsewhere.

Why: a node started by hand (`meshtrain node start`, `meshtrain swarm join`) said nothing at the
default log level until it exited, and a wait of a minute for a peer looked like a hang. The
status document (`Node.snapshot()`) already knows what the node does; this module shows it.

Design:
- On a TTY, one line redrawn in place every `INTERVAL` seconds (`\\r` + erase to end of line,
  cut to the terminal's width so it never wraps): state, step, loss, live peers, outer round,
  network bytes/s, the φ parity when it is not "ok", and what the node waits for. Log lines on
  the same terminal clear it first and redraw it after (`meshtrain.log.set_emit_guard`).
- Elsewhere (a pipe, CI, systemd), one plain line per completed outer round, one when the state
  changes (syncing -> training), and one when the node has been waiting for more than
  `WAIT_NOTICE_S` seconds, saying for what. Journals and CI logs then read like a story.
- The snapshot is read on the trio thread (never from the trainer's), and every write happens
  in a worker thread: a terminal paused with Ctrl-S or a pipe nobody reads stalls this module,
  never the node's event loop.
- `status_line`, `RoundReporter` and `Rate` are pure: they take snapshot dicts and times and
  return text, and are tested without a node.

Not here: the status document itself (`Node.snapshot`, schema in `node/status/client.py`), the demo's table
(`demo.py`: it runs nodes off a TTY and reads only their last JSON line), logging (`log.py`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from typing import Any, TextIO

import trio

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv, set_emit_guard

log = get_logger(__name__)

INTERVAL = 0.5  # seconds between two reads of the snapshot
WAIT_NOTICE_S = 5.0  # off a TTY, a wait is reported once it has lasted this long
RATE_WINDOW_S = 10.0  # bytes/s is averaged over this window (exchanges come in bursts per round)

Snapshot = Callable[[], dict[str, Any]]


class Rate:
    """Bytes per second of a growing counter over the last `window` seconds (pure: feed it
    `(t, total)` samples)."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, total: float) -> float:
        self._samples.append((t, total))
        while len(self._samples) > 2 and t - self._samples[1][0] >= self.window:
            self._samples.popleft()
        t0, v0 = self._samples[0]
        return max(0.0, (total - v0) / (t - t0)) if t > t0 else 0.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _parity_note(training: dict[str, Any]) -> str | None:
    parity = training.get("parity")
    if not isinstance(parity, dict) or parity.get("status") in (None, "ok", "unchecked", "pending"):
        return None
    agreeing, compared = parity.get("agreeing"), parity.get("compared")
    if isinstance(agreeing, int) and isinstance(compared, int) and compared:
        return f"parity {parity['status']} ({agreeing} of {compared} agree)"
    return f"parity {parity['status']}"


def status_line(st: dict[str, Any], bytes_per_s: float, width: int | None = None) -> str:
    """The live line for a terminal: `training  step 120  loss 2.345  peers 3  round 6  1.2 MiB/s`,
    then the parity when it is not ok and what the node waits for; cut to `width` characters."""
    n, t = st["node"], st["training"]
    parts = [
        n["state"],
        f"step {t['step']}",
        f"loss {_loss(t['loss'])}",
        f"peers {len(st['peers'])}",
        f"round {t['round']}",
        f"{human_bytes(bytes_per_s)}/s",
    ]
    if (note := _parity_note(t)) is not None:
        parts.append(note)
    if t.get("waiting"):
        parts.append(f"waiting: {t['waiting']}")
    line = "  ".join(parts)
    if width is not None and len(line) > width:
        line = line[: max(0, width - 1)] + "…"
    return line


def round_line(st: dict[str, Any], bytes_per_s: float) -> str:
    """The plain line for one completed outer round."""
    t = st["training"]
    parts = [f"round {t['round']}", f"step {t['step']}", f"loss {_loss(t['loss'])}"]
    if t.get("eval_loss") is not None:
        parts.append(f"eval {_loss(t['eval_loss'])}")
    parts += [f"peers {len(st['peers'])}", f"{human_bytes(bytes_per_s)}/s"]
    if t.get("phi_digest"):
        parts.append(f"phi {str(t['phi_digest'])[:8]}")
    if (note := _parity_note(t)) is not None:
        parts.append(note)
    return "  ".join(parts)


class RoundReporter:
    """Off a TTY: which plain lines a new snapshot calls for (pure; `lines(st, now, rate)`).

    - the state, when it is first seen and whenever it changes (`state: syncing -> training`),
      each change once, also those that came and went between two polls;
    - one line per completed outer round while training (a poll that sees several rounds at once
      reports the latest: rounds faster than the poll are not worth a line each);
    - `waiting (12 s): <what>` once a wait has lasted `wait_notice` seconds, again when what it
      waits for changes (at most once per `wait_notice` seconds).
    """

    def __init__(self, wait_notice: float = WAIT_NOTICE_S) -> None:
        self.wait_notice = wait_notice
        self._state: str | None = None
        self._state_changes = 0
        self._round: int | None = None
        self._waiting_since: float | None = None
        self._said: str | None = None
        self._said_at = -float("inf")

    def lines(self, st: dict[str, Any], now: float, bytes_per_s: float = 0.0) -> list[str]:
        out: list[str] = []
        state, t = st["node"]["state"], st["training"]
        out += self._state_lines(st["node"])
        rnd = t["round"]
        if self._round is not None and rnd > self._round and state in ("training", "stopping"):
            out.append(round_line(st, bytes_per_s))
        self._round = rnd  # a resumed or downloaded round is not one we trained: no line
        waiting = t.get("waiting")
        if not waiting:
            self._waiting_since, self._said = None, None
        else:
            if self._waiting_since is None:
                self._waiting_since = now
            waited = now - self._waiting_since
            if waited >= self.wait_notice and waiting != self._said and now - self._said_at >= self.wait_notice:
                out.append(f"waiting ({waited:.0f} s): {waiting}")
                self._said, self._said_at = waiting, now
        return out

    def _state_lines(self, node: dict[str, Any]) -> list[str]:
        """`state: a -> b` for every change since the last poll, including states that came and
        went between two polls (the node lists its recent states for that)."""
        state, changes, recent = node["state"], node.get("state_changes"), node.get("recent_states")
        new = [state]
        if isinstance(changes, int):
            missed = changes - self._state_changes
            if self._state is not None and isinstance(recent, list) and recent and recent[-1] == state and missed > 0:
                new = [str(x) for x in recent[-min(missed, len(recent) - 1) :]] if len(recent) > 1 else new
            self._state_changes = changes
        out = []
        for s in new:
            if s != self._state:
                out.append(f"state: {s}" if self._state is None else f"state: {self._state} -> {s}")
                self._state = s
        return out


class LiveStatus(Service):
    """`async with LiveStatus(node.snapshot): await node.run()` — shows the node while it runs.

    snapshot: called on the trio thread every `interval` seconds (`Node.snapshot`).
    out: where to write (default stdout). tty: draw a live line (default: whether `out` is a
        terminal and TERM is not "dumb"); otherwise plain lines (`RoundReporter`).
    Leaving the block ends the live line with a newline, so what is printed next starts clean;
    off a TTY it first reads the snapshot once more, so the plain lines end with the node's last
    state changes and round even when the run was shorter than a poll or two.
    """

    def __init__(
        self, snapshot: Snapshot, out: TextIO | None = None, *, tty: bool | None = None, interval: float = INTERVAL
    ) -> None:
        self._snapshot = snapshot
        self._out = out if out is not None else sys.stdout
        self._tty = _is_terminal(self._out) if tty is None else tty
        self._interval = interval
        self._rate = Rate()
        self._reporter = RoundReporter()
        self._lock = threading.Lock()  # our writes vs. log lines from any thread
        self._line = ""  # what the live line shows now ("" = nothing drawn)
        self._closed = False  # set when the block is left: a write still in flight is dropped

    async def _start(self, stack: AsyncExitStack) -> None:
        if self._tty and _is_terminal(sys.stderr):
            set_emit_guard(self._around_log_line)
            stack.callback(set_emit_guard, None)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._run)

    async def _stop(self) -> None:
        # Shielded: a Ctrl-C that cancels the node must still leave the terminal on a new line,
        # and nothing of ours may be written after what the caller prints next (the CLI's JSON).
        # Plain lines get one last read first: a run shorter than a few polls (or one whose polls
        # a busy machine delayed) still shows its state changes and its last round.
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            text = ""
            if not self._tty:
                with contextlib.suppress(Exception):
                    text = self._render(self._snapshot(), time.monotonic())
            await trio.to_thread.run_sync(self._close, text, abandon_on_cancel=True)

    def _close(self, last: str = "") -> None:
        with self._lock:
            if last and not self._closed:
                with contextlib.suppress(OSError, ValueError):
                    self._out.write(last)
                    self._out.flush()
            if self._line and not self._closed:
                with contextlib.suppress(OSError, ValueError):
                    self._out.write("\n")
                    self._out.flush()
            self._closed, self._line = True, ""

    async def _run(self) -> None:
        failed = False
        while True:
            try:
                text = self._render(self._snapshot(), time.monotonic())
            except Exception as e:  # noqa: BLE001 - showing the node must never stop it
                if not failed:
                    log.warning(kv("the status line failed; the node runs on without it", error=repr(e)))
                failed, text = True, ""
            if text:
                await trio.to_thread.run_sync(self._write, text, abandon_on_cancel=True)
            await trio.sleep(self._interval)

    def _render(self, st: dict[str, Any], now: float) -> str:
        t = st["training"]
        rate = self._rate.add(now, t["bytes_sent"] + t["bytes_received"])
        if self._tty:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            self._line = status_line(st, rate, width)
            return "\r" + self._line + "\x1b[K"
        return "".join(f"{time.strftime('%H:%M:%S')} {x}\n" for x in self._reporter.lines(st, now, rate))

    def _write(self, text: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):  # a closed terminal: nothing to show
            if not self._closed:
                self._out.write(text)
                self._out.flush()

    @contextlib.contextmanager
    def _around_log_line(self) -> Iterator[None]:
        """A log line is about to go to the terminal: clear the live line, redraw it after."""
        with self._lock:
            drawn = bool(self._line) and not self._closed
            with contextlib.suppress(OSError, ValueError):
                if drawn:
                    self._out.write("\r\x1b[K")
                    self._out.flush()
            try:
                yield
            finally:
                with contextlib.suppress(OSError, ValueError):
                    if drawn:
                        self._out.write("\r" + self._line)
                        self._out.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
