"""The trainer: one peer's model, data, inner optimizer and outer optimizer, glued per the spec.

Torch runs in a worker thread (`run` is called through `trio.to_thread.run_sync`); only the outer
optimizer's collective calls hop back onto the trio thread, so the network keeps flowing during
compute (`OuterOptimizer`'s threading bridge).

Data (`load_data`): the built-in corpus (`Corpus`), or a file dataset (`meshtrain.data`: text,
JSONL or Parquet, streamed through Hugging Face `datasets`, tokenised once with the spec's
tokenizer into a token cache in the data dir, checked against the spec's `dataset_digest`; the
digest is reused and a killed tokenising resumed at the next start, and `on_progress` hears how far
both are).
Assignment is a pure function of (swarm seed, peer id, step) — `batch` — as in Psyche: peers
train on different samples without coordinating, and a peer restarted from a checkpoint at step
s draws exactly the batches it would have drawn, so no sample is trained twice or skipped. The
step is the data position; the checkpoint records it with the data's digest and the peer id
(`checkpoint_state()["data"]`), and `load_checkpoint` refuses a checkpoint made on other data.

Models and tokenizers: the spec's `model` (built-in GPT presets, hf:<pretrained dir>,
hf-config:<config.json>, py:<module>:<factory>; models/sources.py) or any `torch.nn.Module` handed
in through the Python API (its `forward(x, y)` returns the loss, or an object with `.loss`); the
spec's `tokenizer` (chars, bytes, hf:<dir>; models/tokenizers.py) tokenises the corpus. The
sequence length is the spec's `context` or the model's own (`resolve_context`), never capped.

Devices and precision (node/ranks/devices.py). The model θ, the batches and the inner optimizer live
on `device`; the outer optimizer keeps φ and its own state fp32 on the host (optim/outer.py).
The spec's `precision` wraps the forward pass in autocast ("bf16", "fp16"; fp16 also scales the
loss through a `GradScaler` the outer optimizer steps as "the inner optimizer", `ScaledInner`).
Evaluation runs in the same precision as training.

Pace (the spec's `pace` "swarm", node/pace.py). With `pace` set, a single-rank peer behind the
swarm (`pace(step)`, the node's `SwarmPace.behind`) skips steps (`OuterOptimizer.skip`: the counter
and the rounds advance, the batch is not trained) until it is back within it; the throughput
counts the steps trained, and `steps_per_s` (the others' estimate of our pace) the counter's
speed outside round waits.

The hot path. An inner step is the user's own loop — batch, forward, backward, clip, optimizer
step — plus a step counter: `outer.step()` returns at once when no round is due. Everything else
runs every `REPORT_EVERY` steps, when a round completed, or at the last step: reading the loss
(`float(loss)` is a host-device sync on a GPU), the throughput window, the history, and
`after_step` (the node's progress report, donor publishing and checkpoint scheduling, each a hop
onto the trio thread). `scripts/bench/bench_trainer.py` measures what is left against a bare loop.

Local ranks (node/local_ranks.py). With `local` (a multi-GPU peer), the same loop runs on every
local rank of the peer: the model is wrapped in DistributedDataParallel, rank r trains rows
[r·b/N, (r+1)·b/N) of the peer's batch of b = `spec.data.batch_size` (so an N-rank peer trains the
same samples per step as a single-rank one, and the swarm's progress counts its ranks' samples
together), rank 0 sends the others the state to start from at every `run`, and the ranks agree
every `REPORT_EVERY` steps whether to go on (rank 0's stop decides). A failed local rank surfaces
as `local_failure` and a stop, not a hang. Under FSDP (`sharded`, node/ranks/sharding.py) the model is
sharded instead of wrapped, the trainer steps the sharded inner optimizer itself, and the outer
step (rank 0's optimizer on its host replica, a `RoundClock` elsewhere) is framed by a gather of θ
to rank 0 and a scatter of the new θ whenever a round is due; the ranks also agree after each
such round and at evaluation steps — after every step rank 0 reports from — so rank 0's re-sync
ends every rank's run at once, and a checkpoint rank 0 takes there can order every rank to save
its shard of the inner state (`ShardedModel.agree`).

State: `checkpoint_state()` (model θ, outer state with the inner optimizer; under FSDP, on rank 0,
θ and the outer state with the name of the DCP directory where every rank saved its shard of the
inner state, node/ranks/sharding.py) is what the node saves; `donor_state()` (the outer state
without the inner optimizer: φ, outer optimizer, step counters) is what late joiners download — θ
is φ after a round, and inner state is never shared (docs/algorithms.md). Both are the live
tensors, not copies (the memory budget, docs/guide.md): the node writes a checkpoint between two
steps, and lends the donor state until the next round (node/state/run_state.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshtrain.collective import Collective
from meshtrain.data import PackedDataset, ProgressCallback, open_dataset
from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv
from meshtrain.models import Corpus
from meshtrain.models.sources import build_model as build_source_model
from meshtrain.models.sources import loss_of, resolve_context
from meshtrain.models.tokenizers import load_tokenizer
from meshtrain.node.ranks.devices import (
    Precision,
    ScaledInner,
    check_fits,
    out_of_memory,
    resolve_device,
    to_host,
)
from meshtrain.node.ranks.sharding import DCP_METADATA, InnerShards, RoundClock, ShardedModel, load_inner_shards
from meshtrain.node.spec.config import default_data_dir
from meshtrain.node.spec.data_dir import CHECKPOINT_DIR
from meshtrain.node.spec.outer import build_outer, check_matches
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.optim import OuterOptimizer
from meshtrain.optim.inner_moments import InnerMoments

if TYPE_CHECKING:
    from meshtrain.node.ranks.group import LocalRanks

log = get_logger(__name__)

DATA_CACHE = "datacache"  # the token caches of file datasets, under the data dir
REPORT_EVERY = 10  # steps between loss reads, throughput updates, history points and after_step

OuterFactory = Callable[[torch.nn.Module, torch.optim.Optimizer, Collective], OuterOptimizer]


def load_data(
    spec: SwarmSpec, data_dir: Path | None = None, on_progress: ProgressCallback | None = None
) -> Corpus | PackedDataset:
    """The spec's data tokenised with the spec's tokenizer: the built-in corpus, or a file dataset
    tokenised into the token cache under `data_dir` (default: the default data dir), its content
    checked against the spec's `dataset_digest` (a peer whose files differ is refused).
    `on_progress`: told how far digesting and tokenising are (`meshtrain.data.Progress`)."""
    if spec.data.dataset == "builtin":
        tokenizer = (
            spec.model.tokenizer if spec.model.tokenizer in ("chars", "bytes") else load_tokenizer(spec.model.tokenizer)
        )
        return Corpus.default(tokenizer)  # type: ignore[arg-type]
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return open_dataset(
        spec.data.dataset,
        load_tokenizer(spec.model.tokenizer),
        root / DATA_CACHE,
        field=spec.data.dataset_field,
        held_out=spec.data.held_out,
        eval_path=spec.data.eval_dataset,
        expected_digest=spec.data.dataset_digest,
        progress=on_progress,
    )


def build_model(spec: SwarmSpec, vocab_size: int) -> torch.nn.Module:
    """The spec's model, initialised from the swarm seed: identical on every peer."""
    return build_source_model(spec.model.source, vocab_size=vocab_size, seed=spec.seed, context=spec.model.context)


@dataclass
class StepInfo:
    """What the trainer thread last published (read by the node for status and metrics)."""

    step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    samples_per_s: float = 0.0
    steps_per_s: float = 0.0  # the step counter's pace while not waiting on rounds, skips included (node/pace.py)
    rounds: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class TrainedState:
    """What `RunState` keeps in step with the swarm: a model θ, its outer optimizer, the step
    counter, and the numbers the status page shows. The daemon's `Trainer` is one; the user's
    own loop (`user_loop.LoopTrainer`) is the other. Subclasses set `spec`, `model`, `outer`,
    `device`, `info` and `lock` in their constructor."""

    spec: SwarmSpec
    model: torch.nn.Module
    outer: OuterOptimizer
    device: torch.device
    info: StepInfo
    lock: threading.Lock  # guards `info` (written by the training thread)

    @property
    def step(self) -> int:
        return self.outer.inner_steps

    # -- state ----------------------------------------------------------------------------------

    def publish(
        self, step: int, value: float | None, rate: float, eval_loss: float | None, steps_per_s: float = 0.0
    ) -> None:
        """Record a step's numbers for the status page (the training thread, every few steps)."""
        with self.lock:
            info = self.info
            info.step, info.loss, info.rounds = step, value, self.outer.rounds
            info.samples_per_s, info.steps_per_s = rate, steps_per_s
            if eval_loss is not None:
                info.eval_loss = eval_loss
            st = self.outer.stats()
            last = self.outer.history[-1] if self.outer.history else None
            info.history.append(
                {
                    "step": step,
                    "t": time.time(),
                    "loss": value,
                    "eval_loss": eval_loss,
                    "bytes_sent": st["bytes_sent"],
                    "bytes_received": st["bytes_received"],
                    "round": self.outer.rounds,
                    "contributors": last.contributors if last is not None else None,  # of the newest round
                }
            )
            del info.history[:-500]

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything to resume bit-exactly: the live tensors, not copies (device tensors come
        to the host): consistent only between two steps, so write it before the next one
        (`CheckpointStore.write`, node/state/run_state.py)."""
        return {
            "model": to_host(self.model.state_dict(), copy=False),
            "outer": to_host(self.outer.state_dict(inner=True, copy=False), copy=False),
            "eval_loss": self.info.eval_loss,
        }

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore `checkpoint_state()` (host tensors; they land on this trainer's device)."""
        self.model.load_state_dict(state["model"])
        self.outer.load_state_dict(state["outer"], inner=True)
        with self.lock:
            self.info.step, self.info.rounds = self.step, self.outer.rounds
            self.info.eval_loss = state.get("eval_loss")

    def donor_state(self) -> dict[str, Any]:
        """What a late joiner needs: the outer state without the inner optimizer — the live
        tensors, lent to the state donor until the next round (node/state/donor.py)."""
        return self.outer.state_dict(inner=False, copy=False)

    def join(self, state: dict[str, Any], at_step: int | None = None, moments: InnerMoments | None = None) -> None:
        self.outer.join(state, at_step=at_step, moments=moments)
        with self.lock:
            self.info.step, self.info.rounds = self.step, self.outer.rounds


class Trainer(TrainedState):
    """One peer's training (or one local rank's share of it). Build it in any thread (the daemon builds
    it in a worker thread: loading a model and tokenising a corpus take long, node/daemon.py); call
    `run` in a worker thread.

    spec: the swarm's spec. collective: what the outer optimizer averages through.
    peer_id: this peer's id (data assignment). model, outer_factory, corpus: the Python API's hooks.
    data_dir: the node's data dir (the token cache of a file dataset lives in it).
    device: where θ, batches and the inner optimizer live (default: `resolve_device("auto")`).
    local: the peer's local-rank group when it runs several (node/local_ranks.py), else None.
    on_progress: told, from the building thread, how far preparing a file dataset is (`load_data`).
    """

    def __init__(
        self,
        spec: SwarmSpec,
        collective: Collective,
        peer_id: str,
        *,
        model: torch.nn.Module | None = None,
        outer_factory: OuterFactory | None = None,
        corpus: Corpus | PackedDataset | None = None,
        device: torch.device | str | None = None,
        local: LocalRanks | None = None,
        data_dir: Path | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.spec = spec
        self.peer_id = peer_id
        self.local = local
        self.device = (
            local.device
            if local is not None
            else torch.device(device)
            if device is not None
            else resolve_device("auto")
        )
        self.precision = Precision(spec.model.precision, self.device)
        self.corpus = corpus or load_data(spec, data_dir, on_progress)
        # an FSDP peer's inner state is saved beside the checkpoints (node/ranks/sharding.py)
        self.checkpoints = (
            Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
        ) / CHECKPOINT_DIR
        user_model = model is not None
        model = model if model is not None else build_model(spec, self.corpus.vocab_size)
        self.context = resolve_context(model, spec.model.context, "the model" if user_model else spec.model.source)
        # FSDP (node/ranks/sharding.py): the model is sharded over the local ranks; rank 0's outer
        # optimizer works on a host replica, the other ranks keep a RoundClock.
        self.sharded = (
            ShardedModel(model, local, self.checkpoints)
            if local is not None and local.choose_sharding(model) == "fsdp"
            else None
        )
        if self.sharded is None:
            check_fits(model, self.device)  # a model that cannot fit is said before it moves there
        self.model = self.sharded.model if self.sharded is not None else model.to(self.device)
        self.inner = torch.optim.AdamW(
            self.model.parameters(), lr=spec.outer.inner_lr, weight_decay=spec.outer.weight_decay
        )
        scaler = self.precision.scaler
        self.stepped: Any = ScaledInner(self.inner, scaler) if scaler is not None else self.inner

        def make_outer(m: torch.nn.Module, inner: Any) -> OuterOptimizer:
            if outer_factory is None:
                return build_outer(spec, m, inner, collective)
            outer = outer_factory(m, inner, collective)
            check_matches(outer, spec)  # a hook may instrument the spec's optimizer, not swap it
            return outer

        self.outer: Any
        if self.sharded is None:
            self.outer = make_outer(self.model, self.stepped)
        elif self.sharded.replica is not None:  # the trainer steps the sharded inner optimizer itself
            self.outer = make_outer(self.sharded.replica, None)
        else:
            self.outer = RoundClock(**local.schedule)  # type: ignore[union-attr]
        self._eval_model = self.sharded.replica if self.sharded is not None else self.model
        eval_device = next(self._eval_model.parameters()).device if self._eval_model is not None else self.device
        # Held-out batches as large as a training step's: the batch the swarm chose is the one known
        # to fit the device (a fixed 32 rows at a real model's context did not).
        self._evals = [
            (x.to(eval_device), y.to(eval_device))
            for x, y in self.corpus.eval_batches(spec.data.eval_batches, spec.data.batch_size, self.context)
        ]
        self._train_model: torch.nn.Module = self.model  # DDP-wrapped at the first run with local ranks
        self._rows = slice(None)
        if local is not None:
            self._rows = local.batch_rows(spec.data.batch_size)
            if local.is_gateway:
                local.prepare(self)
        self.info = StepInfo()
        self.lock = threading.Lock()  # guards `info` (written by the trainer thread)
        self.local_failure: str | None = None
        # Whether to skip the next step, given ours (node/pace.py `SwarmPace.behind`), set where the
        # spec's pace is "swarm": a single-rank peer behind the swarm skips steps (`_loop`).
        self.pace: Callable[[int], bool] | None = None

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def evaluate(self) -> float:
        """Held-out loss of the outer parameters φ (what the swarm agrees on), not our replica
        (under FSDP: on rank 0's host replica).

        Runs under every optimizer, also while a fragment's exchange is in flight (Streaming
        DiLoCo always has one at the default eval steps): φ only changes when a round completes,
        which happens on this thread, between steps; the exchange in flight reads only its own
        pseudo-gradient, computed when it was sent. So φ is swapped into the model here and θ
        swapped back before the next step (`outer_weights`), touching nothing the exchange uses."""
        model = self._eval_model
        model.eval()
        try:
            with self.outer.outer_weights(), torch.no_grad(), self.precision.autocast():
                losses = [loss_of(model(x, y)).float() for x, y in self._evals]
        finally:
            model.train()
        return float(torch.stack(losses).mean())

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This peer's (this rank's rows of its) batch at `step`, on the device."""
        x, y = self.corpus.batch(
            self.spec.data.batch_size, self.context, seed=self.spec.seed, peer=self.peer_id, step=step
        )
        x, y = x[self._rows], y[self._rows]
        if self.device.type == "cuda":
            return (
                x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True),
            )
        return x.to(self.device), y.to(self.device)

    def run(self, stop: threading.Event, until: int, after_step: Callable[[Trainer], None]) -> None:
        """Train until `stop` is set, step `until` (0: forever) is reached, or the outer optimizer
        lost step with the swarm (`needs_resync`: the node downloads the state). Runs in a worker
        thread; `after_step(self)` is called from this thread every `REPORT_EVERY` steps, after a
        round and at the last step, between steps, where the state is consistent (checkpoints and
        donor snapshots are taken there). With local ranks, rank 0 first sends the others its
        state; a local rank that fails ends the run with `local_failure` set and `stop` set."""
        if self.local is not None:
            try:
                until = self.local.start_run(self, until)
                if self.sharded is None:
                    self._train_model = self.local.wrap(self.model, self._train_model)
            except RuntimeError as e:  # torch.distributed: a local rank is gone
                self._fail(stop, e)
                return
        try:
            self._loop(stop, until, after_step)
            if self.sharded is not None:
                self.sharded.finish(self.outer, self.stepped)
        except RuntimeError as e:
            if (oom := out_of_memory(e, self.device, self.step)) is not None:
                raise oom from None
            if self.local is None or not self.local.is_failure(e):
                raise
            self._fail(stop, e)

    def _fail(self, stop: threading.Event, e: BaseException) -> None:
        self.local_failure = f"a local rank of this peer failed ({str(e).splitlines()[0][:200]})"
        if self.sharded is not None:
            self.sharded.between_steps = False  # no collective can save anything now
        log.warning(kv("local rank group failed; stopping the peer", error=self.local_failure))
        stop.set()

    def _loop(self, stop: threading.Event, until: int, after_step: Callable[[Trainer], None]) -> None:
        spec, outer, model, scaler, local = self.spec, self.outer, self._train_model, self.precision.scaler, self.local
        sharded = self.sharded
        autocast = self.precision.autocast
        params = list(self.model.parameters())
        t_last, step_last, rounds_last = time.monotonic(), self.step, outer.rounds
        skipped_last, waited_last = outer.skipped_steps, outer.comm_wait_seconds
        # The swarm's pace (node/pace.py): a single-rank peer behind it skips steps.
        pace = self.pace if local is None and sharded is None else None
        loss = None
        agree = True  # local ranks agree whether to go on: first, every REPORT_EVERY steps, around rounds
        # With local ranks only rank 0 may know it must re-sync (its node's parity check or the
        # swarm's front says so, node/state/run_state.py): it says so as a stop at the next
        # agreement, so all ranks end the run together. Leaving the loop on its own flag, rank 0
        # began the next run's broadcast while rank 1 waited in `keep_going`'s: gloo aborted rank 1
        # (a collective of 8 bytes against 4; tests/test_multi_rank.py, the restarted peer).
        while (until == 0 or self.step < until) and (local is not None or not outer.needs_resync):
            step = self.step
            if local is None:
                if stop.is_set():
                    break
            elif agree or step % REPORT_EVERY == 0 or (sharded is None and any(outer.due(outer.inner_steps + 1))):
                if sharded is None:  # before a round, too: a peer to re-sync must not run it
                    if not local.keep_going(stop.is_set() or outer.needs_resync):
                        break
                elif not sharded.agree(self.stepped, step, stop.is_set() or outer.needs_resync):
                    break
            agree = False
            if pace is not None and pace(step):
                outer.skip()  # behind the swarm: this step's batch is not trained (node/pace.py)
            else:
                # -- the inner step: the user's loop and a counter (outer.step() is a counter
                # unless a round is due) ---------------------------------------------------------
                x, y = self.batch(step)
                with autocast():
                    loss = loss_of(model(x, y))
                if sharded is None:
                    outer.zero_grad()
                else:
                    self.inner.zero_grad()
                if scaler is None:
                    loss.backward()
                else:
                    scaler.scale(loss).backward()
                    scaler.unscale_(self.inner)
                torch.nn.utils.clip_grad_norm_(params, spec.outer.clip)
                if sharded is None:
                    # after a round the ranks agree (a failed one leaves every rank to re-sync)
                    agree = bool(outer.step()) and local is not None
                else:
                    self.stepped.step()
                    # after a round, and where rank 0 may report (so checkpoint), the ranks agree
                    agree = sharded.advance(outer, self.stepped) or bool(
                        spec.data.eval_every and self.step % spec.data.eval_every == 0
                    )
            # -- reporting, every REPORT_EVERY steps or after a round -----------------------------
            step = self.step
            if (
                step % REPORT_EVERY
                and outer.rounds == rounds_last
                and step != until
                and not (spec.data.eval_every and step % spec.data.eval_every == 0)
            ):
                continue
            rounds_last = outer.rounds
            value = float(loss.detach()) if loss is not None else None
            now = time.monotonic()
            trained = step - step_last - (outer.skipped_steps - skipped_last)  # samples trained, not skipped
            rate = spec.data.batch_size * trained / max(now - t_last, 1e-9)
            busy = now - t_last - (outer.comm_wait_seconds - waited_last)  # not waiting on rounds
            pace_rate = (step - step_last) / busy if busy > 0 else 0.0
            t_last, step_last, skipped_last, waited_last = now, step, outer.skipped_steps, outer.comm_wait_seconds
            eval_loss = None
            if spec.data.eval_every and step % spec.data.eval_every == 0 and (local is None or local.is_gateway):
                eval_loss = self.evaluate()
                t_last = time.monotonic()  # evaluation is not training throughput
            self.publish(step, value, rate, eval_loss, pace_rate)
            if value is not None and not math.isfinite(value):
                log.warning(kv("training loss is not finite", step=step))
            if sharded is not None:
                sharded.between_steps = True  # an agreement follows: a checkpoint can save the shards
            after_step(self)

    # -- state (FSDP: node/ranks/sharding.py) ----------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything to resume bit-exactly (the live tensors: write them between two steps, as
        `TrainedState.checkpoint_state` says). Under FSDP (rank 0): the replica's θ, the outer
        state, and the name of the directory beside the checkpoints where every rank saved its
        shard of the inner state with DCP (`inner_shards`), all of one step: called between steps
        in a run, every rank pulls θ and saves its shard now; between runs, the run end's save
        stands (node/ranks/sharding.py). Any rank count or sharding resumes it (`load_checkpoint`)."""
        sharded = self.sharded
        if sharded is None:
            state = super().checkpoint_state()
        elif sharded.replica is None:
            raise RuntimeError("under FSDP only local rank 0 holds the peer's full state")
        else:
            if sharded.between_steps:
                sharded.save_now(self.stepped, self.step)
            outer = self.outer.state_dict(inner=True, copy=False)  # no inner state: rank 0's optimizer has none
            # φ and the outer state have not moved since the replica's θ (a failed rank ends a
            # run without the run end's pull: the checkpoint is then the last round's state)
            outer["inner_steps"] = sharded.replica_step
            state = {"model": to_host(sharded.replica.state_dict()), "outer": outer, "eval_loss": self.info.eval_loss}
            inner = sharded.inner_for_checkpoint()
            if isinstance(inner, InnerShards):
                state["inner_shards"] = {"dir": inner.directory.name, "step": inner.step, "scaler": inner.scaler}
            elif inner is not None:  # resumed from a single-rank checkpoint, not trained since
                outer["inner"] = inner
        # The data position: the next step's batch is `batch(step)`, a pure function of it.
        state["data"] = {
            "digest": self.corpus.digest,
            "source": self.corpus.source,
            "peer": self.peer_id,
            "seed": self.spec.seed,
            "step": state["outer"]["inner_steps"],
        }
        return state

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore `checkpoint_state()` (host tensors; they land on this trainer's device; under
        FSDP in rank 0's replica, and in the shards at the next `run`). A checkpoint made on other
        data is refused (ConfigError): resuming it would not continue the same sample stream. One
        made under another peer id resumes with a warning (the samples to come are this id's)."""
        data = state.get("data")
        if data is not None:
            if data["digest"] != self.corpus.digest:
                raise ConfigError(
                    f"the checkpoint was trained on other data ({data['source']}, digest "
                    f"{str(data['digest'])[:16]}…) than this peer's ({self.corpus.source}, "
                    f"{self.corpus.digest[:16]}…); it cannot resume exactly"
                )
            if data["step"] != state["outer"]["inner_steps"]:
                raise ConfigError(
                    f"the checkpoint's data position (step {data['step']}) is not its "
                    f"optimizer's step ({state['outer']['inner_steps']}): a corrupt checkpoint"
                )
            if data["peer"] != self.peer_id or data["seed"] != self.spec.seed:
                log.warning(
                    kv(
                        "resuming a checkpoint of another peer id or seed: the data from here on is this peer's",
                        checkpoint_peer=data["peer"],
                        peer=self.peer_id,
                    )
                )
        shards = state.get("inner_shards")  # an FSDP peer's inner state, saved with DCP
        saved = (
            InnerShards(self.checkpoints / shards["dir"], int(shards["step"]), shards["scaler"])
            if shards is not None
            else None
        )
        if saved is not None and not (saved.directory / DCP_METADATA).is_file():
            log.warning(
                kv(
                    "the checkpoint's inner optimizer state is missing; resuming with a fresh one",
                    directory=str(saved.directory),
                )
            )
            saved = None
        sharded = self.sharded
        if sharded is None:
            super().load_checkpoint(state)
            if saved is not None:  # the whole state from the shards of any rank count, without a process group
                load_inner_shards(self.model, self.inner, saved.directory, collective=False)
                if saved.scaler is not None and self.precision.scaler is not None:
                    self.precision.scaler.load_state_dict(saved.scaler)
            return
        (sharded.replica if sharded.replica is not None else self.model).load_state_dict(state["model"])
        self.outer.load_state_dict(state["outer"], inner=True)
        sharded.resumed(saved if saved is not None else state["outer"].get("inner"), self.outer.inner_steps)
        with self.lock:
            self.info.step, self.info.rounds = self.step, self.outer.rounds
            self.info.eval_loss = state.get("eval_loss")

    def join(self, state: dict[str, Any], at_step: int | None = None, moments: InnerMoments | None = None) -> None:
        super().join(state, at_step, moments)
        if self.sharded is not None:  # θ ← φ in the replica; the inner state is kept
            self.sharded.replica_step = self.outer.inner_steps
