"""The trainer: one peer's model, data, inner optimizer and outer optimizer, glued per the spec.

Torch runs in a worker thread (`run` is called through `trio.to_thread.run_sync`); only the outer
optimizer's collective calls hop back onto the trio thread, so the network keeps flowing during
compute (`OuterOptimizer`'s threading bridge).

Data (`load_data`): the built-in corpus (`Corpus`), or a file dataset (`meshtrain.data`: text,
JSONL or Parquet, streamed through Hugging Face `datasets`, tokenised once into a token cache in
the data dir, checked against the spec's `dataset_digest`). Assignment is a pure function of
(swarm seed, peer id, step) — `batch` — as in Psyche: peers train on different samples without
coordinating, and a peer restarted from a checkpoint at step s draws exactly the batches it
would have drawn, so no sample is trained twice or skipped. The step is the data position; the
checkpoint records it with the data's digest and the peer id (`checkpoint_state()["data"]`), and
`load_checkpoint` refuses a checkpoint made on other data.

Models: the built-in GPT presets, any `torch.nn.Module` handed in through the Python API (its
`forward(x, y)` returns the loss, or an object with `.loss`), and Hugging Face `transformers`
causal-LM configs (`hf:<config.json>`, built from the config, never downloaded) when
transformers is installed.

Devices and precision (node/devices.py). The model θ, the batches and the inner optimizer live
on `device`; the outer optimizer keeps φ and its own state fp32 on the host (optim/outer.py).
The spec's `precision` wraps the forward pass in autocast ("bf16", "fp16"; fp16 also scales the
loss through a `GradScaler` the outer optimizer steps as "the inner optimizer", `ScaledInner`).
Evaluation runs in the same precision as training.

The hot path. An inner step is the user's own loop — batch, forward, backward, clip, optimizer
step — plus a step counter: `outer.step()` returns at once when no round is due. Everything else
runs every `REPORT_EVERY` steps, when a round completed, or at the last step: reading the loss
(`float(loss)` is a host-device sync on a GPU), the throughput window, the history, and
`after_step` (the node's progress report, donor publishing and checkpoint scheduling, each a hop
onto the trio thread). `scripts/bench_trainer.py` measures what is left against a bare loop.

Local ranks (node/local_ranks.py). With `local` (a multi-GPU peer), the same loop runs on every
local rank of the peer: the model is wrapped in DistributedDataParallel, rank r trains rows
[r·b/N, (r+1)·b/N) of the peer's batch of b = `spec.batch_size` (so an N-rank peer trains the
same samples per step as a single-rank one, and the swarm's progress counts its ranks' samples
together), rank 0 sends the others the state to start from at every `run`, and the ranks agree
every `REPORT_EVERY` steps whether to go on (rank 0's stop decides). A failed local rank surfaces
as `local_failure` and a stop, not a hang.

State: `checkpoint_state()` (model θ, outer state with the inner optimizer) is what the node
saves; `donor_state()` (the outer state without the inner optimizer: φ, outer optimizer, step
counters) is what late joiners download — θ is φ after a round, and inner state is never shared
(ALGORITHMS.md).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshtrain.collective import Collective
from meshtrain.data import PackedDataset, open_dataset
from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv
from meshtrain.models import GPT, Corpus, GPTConfig, Vocab
from meshtrain.node.config import SwarmSpec, default_data_dir
from meshtrain.node.devices import Precision, ScaledInner, resolve_device, to_host
from meshtrain.optim import DiLoCo, NoLoCo, OuterOptimizer, SparseLoCo, StreamingDiLoCo

if TYPE_CHECKING:
    from meshtrain.node.rank_group import LocalRanks

log = get_logger(__name__)

REPORT_EVERY = 10  # steps between loss reads, throughput updates, history points and after_step
DATA_CACHE = "datacache"  # the token cache's folder in the node's data dir (meshtrain/data/cache.py)

OuterFactory = Callable[[torch.nn.Module, torch.optim.Optimizer, Collective], OuterOptimizer]


def load_data(spec: SwarmSpec, data_dir: Path | None = None) -> Corpus | PackedDataset:
    """The spec's data: the built-in corpus, or a file dataset tokenised into the token cache
    under `data_dir` (default: the default data dir), its content checked against the spec's
    `dataset_digest` (a peer whose files differ is refused: ConfigError)."""
    if spec.dataset == "builtin":
        return Corpus.default()
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return open_dataset(spec.dataset, Vocab.of_bytes(), root / DATA_CACHE, field=spec.dataset_field,
                        held_out=spec.held_out, eval_path=spec.eval_dataset,
                        expected_digest=spec.dataset_digest)


def build_model(spec: SwarmSpec, vocab_size: int) -> torch.nn.Module:
    """The spec's model, initialised from the swarm seed: identical on every peer."""
    if spec.model.startswith("hf:"):
        return _hf_model(spec.model[3:], vocab_size, spec.seed)
    preset = {"gpt-tiny": GPTConfig.tiny, "gpt-small": GPTConfig.small, "gpt-large": GPTConfig.large}[spec.model]
    return GPT(preset(vocab_size), seed=spec.seed)


def _hf_model(config_path: str, vocab_size: int, seed: int) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model hf:... needs the `transformers` package: pip install transformers") from None
    try:
        data = json.loads(Path(config_path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read Hugging Face config {config_path}: {e}") from None
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ConfigError(f"{config_path}: a Hugging Face config needs a model_type (e.g. gpt2, llama)")
    data["vocab_size"] = vocab_size
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the config's ids are for another vocab
        if not isinstance(data.get(special), int) or not 0 <= data[special] < vocab_size:
            data[special] = None
    config = transformers.AutoConfig.for_model(model_type, **data)
    torch.manual_seed(seed)
    return _HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))


class _HFCausalLM(torch.nn.Module):
    """Adapts a transformers causal LM to `model(x, y) -> loss` (HF shifts labels itself, so it
    gets the inputs as labels: the same next-token objective)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(input_ids=x, labels=x).loss


def context_of(model: torch.nn.Module, default: int = 32) -> int:
    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig):
        return cfg.context
    inner = getattr(model, "inner", None)
    n = getattr(getattr(inner, "config", None), "n_positions", None) or getattr(
        getattr(inner, "config", None), "max_position_embeddings", None)
    return min(int(n), 128) if n else default


def _loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


@dataclass
class StepInfo:
    """What the trainer thread last published (read by the node for status and metrics)."""

    step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    samples_per_s: float = 0.0
    rounds: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    """One peer's training (or one local rank's share of it). Build it on the trio thread; call
    `run` in a worker thread.

    spec: the swarm's spec. collective: what the outer optimizer averages through.
    peer_id: this peer's id (data assignment). model, outer_factory, corpus: the Python API's hooks.
    data_dir: the node's data dir (the token cache of a file dataset lives in it).
    device: where θ, batches and the inner optimizer live (default: `resolve_device("auto")`).
    local: the peer's local-rank group when it runs several (node/local_ranks.py), else None.
    """

    def __init__(self, spec: SwarmSpec, collective: Collective, peer_id: str, *,
                 model: torch.nn.Module | None = None, outer_factory: OuterFactory | None = None,
                 corpus: Corpus | PackedDataset | None = None, device: torch.device | str | None = None,
                 local: LocalRanks | None = None, data_dir: Path | None = None) -> None:
        self.spec = spec
        self.peer_id = peer_id
        self.local = local
        self.device = (local.device if local is not None else
                       torch.device(device) if device is not None else resolve_device("auto"))
        self.precision = Precision(spec.precision, self.device)
        self.corpus = corpus or load_data(spec, data_dir)
        model = model if model is not None else build_model(spec, self.corpus.vocab_size)
        self.model = model.to(self.device)
        self.context = context_of(self.model)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=spec.inner_lr, weight_decay=spec.weight_decay)
        scaler = self.precision.scaler
        stepped = ScaledInner(self.inner, scaler) if scaler is not None else self.inner
        self.outer = (outer_factory or self._default_outer)(self.model, stepped, collective)  # type: ignore[arg-type]
        self._evals = [(x.to(self.device), y.to(self.device))
                       for x, y in self.corpus.eval_batches(spec.eval_batches, 32, self.context)]
        self._train_model: torch.nn.Module = self.model  # DDP-wrapped at the first run with local ranks
        self._rows = slice(None)
        if local is not None:
            self._rows = local.batch_rows(spec.batch_size)
            if local.is_gateway:
                local.prepare(self)
        self.info = StepInfo()
        self.lock = threading.Lock()  # guards `info` (written by the trainer thread)
        self.local_failure: str | None = None

    def _default_outer(self, model: torch.nn.Module, inner: torch.optim.Optimizer,
                       collective: Collective) -> OuterOptimizer:
        s = self.spec
        if s.optimizer == "diloco":
            return DiLoCo(model, inner, collective, H=s.H, lr=s.outer_lr, momentum=s.outer_momentum, codec=s.codec)
        if s.optimizer == "streaming":
            return StreamingDiLoCo(model, inner, collective, H=s.H, fragments=s.fragments, delay=s.delay,
                                   alpha=s.alpha, codec=s.codec if s.codec != "none" else "fp4", lr=s.outer_lr,
                                   momentum=s.outer_momentum, eager=s.eager)
        if s.optimizer == "sparseloco":
            return SparseLoCo(model, inner, collective, H=s.H, lr=s.outer_lr, beta=s.error_decay, chunk=s.sparse_chunk,
                              k=s.sparse_k)
        return NoLoCo(model, inner, collective, H=s.H, codec=s.codec)

    @property
    def step(self) -> int:
        return self.outer.inner_steps

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def evaluate(self) -> float:
        """Held-out loss of the outer parameters φ (what the swarm agrees on), not our replica.

        Runs under every optimizer, also while a fragment's exchange is in flight (Streaming
        DiLoCo always has one at the default eval steps): φ only changes when a round completes,
        which happens on this thread, between steps; the exchange in flight reads only its own
        pseudo-gradient, computed when it was sent. So φ is swapped into the model here and θ
        swapped back before the next step (`outer_weights`), touching nothing the exchange uses."""
        self.model.eval()
        try:
            with self.outer.outer_weights(), torch.no_grad(), self.precision.autocast():
                losses = [_loss_of(self.model(x, y)).float() for x, y in self._evals]
        finally:
            self.model.train()
        return float(torch.stack(losses).mean())

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This peer's (this rank's rows of its) batch at `step`, on the device."""
        x, y = self.corpus.batch(self.spec.batch_size, self.context, seed=self.spec.seed, peer=self.peer_id,
                                 step=step)
        x, y = x[self._rows], y[self._rows]
        if self.device.type == "cuda":
            return (x.pin_memory().to(self.device, non_blocking=True),
                    y.pin_memory().to(self.device, non_blocking=True))
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
                self._train_model = self.local.wrap(self.model, self._train_model)
            except RuntimeError as e:  # torch.distributed: a local rank is gone
                self._fail(stop, e)
                return
        try:
            self._loop(stop, until, after_step)
        except RuntimeError as e:
            if self.local is None or not self.local.is_failure(e):
                raise
            self._fail(stop, e)

    def _fail(self, stop: threading.Event, e: BaseException) -> None:
        self.local_failure = f"a local rank of this peer failed ({str(e).splitlines()[0][:200]})"
        log.warning(kv("local rank group failed; stopping the peer", error=self.local_failure))
        stop.set()

    def _loop(self, stop: threading.Event, until: int, after_step: Callable[[Trainer], None]) -> None:
        spec, outer, model, scaler, local = self.spec, self.outer, self._train_model, self.precision.scaler, self.local
        autocast = self.precision.autocast
        params = list(self.model.parameters())
        t_last, step_last, rounds_last = time.monotonic(), self.step, outer.rounds
        loss = None
        first = True
        while (until == 0 or self.step < until) and not outer.needs_resync:
            step = self.step
            if local is None:
                if stop.is_set():
                    break
            elif (first or step % REPORT_EVERY == 0) and not local.keep_going(stop.is_set()):
                break
            first = False
            # -- the inner step: the user's loop and a counter (outer.step() is a counter unless
            # a round is due) ------------------------------------------------------------------
            x, y = self.batch(step)
            with autocast():
                loss = _loss_of(model(x, y))
            outer.zero_grad()
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(self.inner)
            torch.nn.utils.clip_grad_norm_(params, spec.clip)
            outer.step()
            # -- reporting, every REPORT_EVERY steps or after a round -----------------------------
            step = self.step
            if step % REPORT_EVERY and outer.rounds == rounds_last and step != until and not (
                    spec.eval_every and step % spec.eval_every == 0):
                continue
            rounds_last = outer.rounds
            value = float(loss.detach())
            now = time.monotonic()
            rate = spec.batch_size * (step - step_last) / max(now - t_last, 1e-9)
            t_last, step_last = now, step
            eval_loss = None
            if spec.eval_every and step % spec.eval_every == 0 and (local is None or local.is_gateway):
                eval_loss = self.evaluate()
                t_last = time.monotonic()  # evaluation is not training throughput
            self._publish(step, value, rate, eval_loss)
            if not math.isfinite(value):
                log.warning(kv("training loss is not finite", step=step))
            after_step(self)

    def _publish(self, step: int, value: float, rate: float, eval_loss: float | None) -> None:
        with self.lock:
            info = self.info
            info.step, info.loss, info.rounds = step, value, self.outer.rounds
            info.samples_per_s = rate
            if eval_loss is not None:
                info.eval_loss = eval_loss
            st = self.outer.stats()
            info.history.append({"step": step, "t": time.time(), "loss": value, "eval_loss": eval_loss,
                                 "bytes_sent": st["bytes_sent"], "bytes_received": st["bytes_received"]})
            del info.history[:-500]

    # -- state ----------------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything to resume bit-exactly (host copies; call between steps), with the data
        position: the next step's batch is `batch(step)`, a pure function of it."""
        return {"model": to_host(self.model.state_dict()),
                "outer": to_host(self.outer.state_dict(inner=True), copy=False),  # copies already
                "eval_loss": self.info.eval_loss,
                "data": {"digest": self.corpus.digest, "source": self.corpus.source, "peer": self.peer_id,
                         "seed": self.spec.seed, "step": self.step}}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore `checkpoint_state()` (host tensors; they land on this trainer's device).
        A checkpoint made on other data is refused (ConfigError): resuming it would not continue
        the same sample stream. One made under another peer id resumes with a warning (the
        samples of the steps to come are this id's)."""
        data = state.get("data")
        if data is not None:
            if data["digest"] != self.corpus.digest:
                raise ConfigError(f"the checkpoint was trained on other data ({data['source']}, digest "
                                  f"{str(data['digest'])[:16]}…) than this peer's ({self.corpus.source}, "
                                  f"{self.corpus.digest[:16]}…); it cannot resume exactly")
            if data["step"] != state["outer"]["inner_steps"]:
                raise ConfigError(f"the checkpoint's data position (step {data['step']}) is not its "
                                  f"optimizer's step ({state['outer']['inner_steps']}): a corrupt checkpoint")
            if data["peer"] != self.peer_id or data["seed"] != self.spec.seed:
                log.warning(kv("resuming a checkpoint of another peer id or seed: the data from here on "
                               "is this peer's", checkpoint_peer=data["peer"], peer=self.peer_id))
        self.model.load_state_dict(state["model"])
        self.outer.load_state_dict(state["outer"], inner=True)
        with self.lock:
            self.info.step, self.info.rounds = self.step, self.outer.rounds
            self.info.eval_loss = state.get("eval_loss")

    def donor_state(self) -> dict[str, Any]:
        """What a late joiner needs: the outer state without the inner optimizer."""
        return self.outer.state_dict(inner=False)

    def join(self, state: dict[str, Any], at_step: int | None = None) -> None:
        self.outer.join(state, at_step=at_step)
        with self.lock:
            self.info.step, self.info.rounds = self.step, self.outer.rounds
