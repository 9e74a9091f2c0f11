"""TensorBoard event files of a node's training: `meshtrain node start --tensorboard DIR`.

Problem. Operators watch training in the tools they already use; the status page and `/metrics`
show the present, and a Prometheus server keeps only what it scraped. TensorBoard reads event
files from a directory, with each point at its training step.

Design. `TensorBoardLog` is a small `Service` beside the status server. Every `every` seconds, on
the trio thread, it takes the node's status document (the same snapshot `/status` serves, so the
training thread is never touched) and writes the trainer's history points it has not written yet
— one every `REPORT_EVERY` steps (node/trainer.py keeps the newest 500, minutes at any speed, so a
2 s poll misses none) — as scalars at their step and wall time:

    loss/train, loss/held_out        the training loss, the held-out loss when evaluated
    swarm/round, swarm/contributors  outer rounds done; peers in the newest round
    bytes/sent, bytes/received       outer-optimizer payload bytes, cumulative
    throughput/samples_per_s         from the document, at the newest point

The writer is tensorboardX's `SummaryWriter` (event files TensorBoard reads; the `tensorboard`
package itself, which torch's writer needs, brings a web server we do not use). It writes from
its own thread; `close()` at shutdown flushes. A restarted node appends a new event file to the
same directory and writes only steps after its checkpoint's, so curves continue.

Failures. Without tensorboardX the node refuses to start, in one line naming the package. A
write that fails (disk full) is logged once and the node trains on without it.

Not here: what the document holds (document.py), Prometheus (server.py).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from meshtrain.errors import ConfigError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.node.status.client import Snapshot

log = get_logger(__name__)

POLL_EVERY_S = 2.0


class TensorBoardLog(Service):
    """`async with TensorBoardLog(node.snapshot, logdir):` writes the training's scalars to
    `logdir` until the block ends (module docstring)."""

    def __init__(self, snapshot: Snapshot, logdir: Path, *, every: float = POLL_EVERY_S) -> None:
        self._snapshot, self.logdir, self.every = snapshot, Path(logdir).expanduser(), every
        self.last_step = -1
        self.points_written = 0
        self._writer: Any = None
        self._failed = False

    async def _start(self, stack: AsyncExitStack) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError(
                "--tensorboard needs the tensorboardX package: pip install tensorboardX "
                "(or pip install 'meshtrain[tensorboard]')"
            ) from None
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot write TensorBoard logs to {self.logdir} ({e.strerror or e})") from None
        self._writer = SummaryWriter(logdir=str(self.logdir), flush_secs=10)
        stack.callback(self._writer.close)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._poll)

    async def _stop(self) -> None:
        self.write(self._snapshot())  # the last points before the writer closes

    async def _poll(self) -> None:
        while True:
            await trio.sleep(self.every)
            self.write(self._snapshot())

    def write(self, doc: dict[str, Any]) -> None:
        """The document's history points after the last one written."""
        if self._writer is None or self._failed:
            return
        training = doc.get("training", {})
        fresh = [p for p in training.get("history", []) if p["step"] > self.last_step]
        try:
            for point in fresh:
                step, t = point["step"], point["t"]
                scalars = {
                    "loss/train": point.get("loss"),
                    "loss/held_out": point.get("eval_loss"),
                    "swarm/round": point.get("round"),
                    "swarm/contributors": point.get("contributors"),
                    "bytes/sent": point.get("bytes_sent"),
                    "bytes/received": point.get("bytes_received"),
                }
                for tag, value in scalars.items():
                    if value is not None:
                        self._writer.add_scalar(tag, value, step, walltime=t)
                self.last_step = step
                self.points_written += 1
            if fresh:
                self._writer.add_scalar(
                    "throughput/samples_per_s",
                    training.get("samples_per_s", 0.0),
                    self.last_step,
                    walltime=fresh[-1]["t"],
                )
        except OSError as e:
            self._failed = True
            log.warning(kv("TensorBoard logging stopped", logdir=str(self.logdir), error=repr(e)))
