"""`MeshtrainCallback`: a `transformers.Trainer` script becomes a swarm peer with three lines.

    from meshtrain.integrations.hf import MeshtrainArguments, MeshtrainCallback       # 1
    mesh = MeshtrainArguments(join="/ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...")            # 2 (or create=True)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[MeshtrainCallback(mesh)])  # 3
    trainer.train()

Problem. Most people who would join a swarm already have a Trainer script; rewriting it as a
loop around `meshtrain.Swarm` is the step they will not take. The Trainer owns the loop, the inner
optimizer, the scheduler, mixed precision, logging and its checkpoints; what it lacks is the swarm.

Design. A `TrainerCallback` adds the swarm and touches nothing else of the Trainer:
- `on_init_end`: the peer's data dir is `output_dir/meshtrain` (unless `data_dir` says
  otherwise): its identity, the swarm's spec, the swarm's checkpoints live beside the Trainer's
  `checkpoint-N`. When `data_seed` is unset, it becomes `seed` plus a number from this peer's id,
  and the random generators are seeded with it (`transformers.set_seed`: the model is built by
  then), so every peer shuffles the same dataset in its own order and draws its own dropout (the
  same order everywhere would make N peers one). A Trainer with `model_init` reseeds with `seed`
  in `train()`: set `data_seed` per peer yourself there.
- `on_train_begin` (after the Trainer loaded a `resume_from_checkpoint`): join the swarm
  (`join=`), create it (`create=True`: a spec with `model = "user"`, the given `H` and optimizer,
  `max_steps` as its steps, `seed`, the Trainer's learning rate and per-update batch size), or
  rejoin the data dir's (neither); then build the outer optimizer the spec names (node/spec/
  outer.py `build_outer`) around the Trainer's model with no inner optimizer of its own: the
  Trainer steps that.
- `on_step_end` (after the Trainer's optimizer step, scheduler step and zero_grad): the outer
  optimizer's step — its first joins the swarm's state (this data dir's checkpoint, or the swarm's
  state downloaded when it has moved on; the one step taken before the join is applied to the
  joined state or replaced by it), then every H updates a round. When the *swarm's* step reaches
  the spec's `steps`, training stops (`control.should_training_stop`): a peer that joined late
  ends with the others, not `max_steps` later.
- `on_log`: the Trainer's `loss` and `eval_loss` go to the status page (`Swarm.report`).
- `on_train_end`: leave the swarm (finish an exchange in flight, checkpoint into the data dir,
  leave the membership); `trainer.train()` then returns as usual, and `result` is the `NodeResult`.

Gradient accumulation does not conflict: the callback sees one step per optimizer update, so H
counts updates, and the spec's batch size (for a swarm this callback creates) is
`per_device_train_batch_size × gradient_accumulation_steps`. Checkpoints: the Trainer's
`checkpoint-N` keeps what it always keeps (model, inner optimizer, scheduler, its step); the
swarm's checkpoints in the data dir keep θ, φ, the outer optimizer and the swarm's step — one at
each Trainer save (`on_save`: the same step as `checkpoint-N`, unless an exchange is in flight),
every `checkpoint_every` seconds and at the end. Resuming (`trainer.train(resume_from_checkpoint=
...)`) restores the Trainer's part from `checkpoint-N`, then the first step restores the swarm's
part from the data dir's newest checkpoint (or downloads the swarm's state when the swarm has
moved on): the swarm's state wins for θ.

Failures, in one line (`ConfigError`, from the Trainer's constructor or `train()`): a Trainer
with more than one process (`world_size` > 1: torchrun, DeepSpeed, FSDP — a multi-GPU peer is
`meshtrain.SwarmOptimizer` in a torchrun script, or `meshtrain node start --nproc-per-node N`),
`join` and `create` both set, neither with no swarm in the data dir, a spec the Trainer's model
cannot serve (another optimizer than the spec's is impossible here: the callback builds the
spec's). A Trainer that raises leaves the swarm with the process (the swarm's checkpoint from
before stands).

Not here: the swarm itself (node/user_loop.py), your own loop (optimizer.py `SwarmOptimizer`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments, set_seed

from meshtrain.errors import ConfigError
from meshtrain.node.spec.outer import build_outer
from meshtrain.node.spec.swarm import parse_spec
from meshtrain.node.training_run import NodeResult
from meshtrain.node.user_loop import Swarm
from meshtrain.optim.outer import OuterOptimizer
from meshtrain.transport.identity import Identity

DATA_DIR = "meshtrain"  # the peer's data dir under the Trainer's output_dir


@dataclass
class MeshtrainArguments:
    """The swarm a Trainer joins; a dataclass `HfArgumentParser` parses beside `TrainingArguments`."""

    join: str | None = field(
        default=None, metadata={"help": "join the swarm of the peer at this address (/ip4/.../p2p/<id>)"}
    )
    create: bool = field(default=False, metadata={"help": "create a swarm (the first peer)"})
    data_dir: str | None = field(default=None, metadata={"help": "the peer's data dir (default: output_dir/meshtrain)"})
    H: int = field(default=100, metadata={"help": "create: inner steps (optimizer updates) per outer round"})
    optimizer: str = field(default="diloco", metadata={"help": "create: the swarm's outer optimizer"})
    name: str = field(default="hf-trainer", metadata={"help": "create: the swarm's name"})
    listen: str | None = field(default=None, metadata={"help": "multiaddr to listen on (default: the node's)"})
    status_port: int | None = field(default=None, metadata={"help": "status page port (0: any)"})
    nat: bool = field(default=True, metadata={"help": "NAT traversal (relays, hole punching)"})
    wait_peers: int = field(default=0, metadata={"help": "start training once this many peers are in"})
    checkpoint_every: float | None = field(default=None, metadata={"help": "seconds between swarm checkpoints"})

    def node_options(self) -> dict[str, Any]:
        """The `NodeConfig` fields these arguments set (the others keep the node's defaults)."""
        options: dict[str, Any] = {"nat": self.nat, "wait_peers": self.wait_peers}
        if self.listen is not None:
            options["listen"] = [self.listen]
        if self.status_port is not None:
            options["status_port"] = self.status_port
        if self.checkpoint_every is not None:
            options["checkpoint_every"] = self.checkpoint_every
        return options


class MeshtrainCallback(TrainerCallback):
    """Makes the Trainer it is given to a peer of the swarm `mesh` names (module docstring).

    While training: `swarm` (the `meshtrain.Swarm`), `outer` (the spec's outer optimizer: `rounds`,
    `history`, `outer_params` φ); after it, `result` (the `NodeResult` of leaving).
    """

    def __init__(self, mesh: MeshtrainArguments | None = None) -> None:
        self.mesh = mesh or MeshtrainArguments()
        if self.mesh.join and self.mesh.create:
            raise ConfigError("MeshtrainArguments: join or create, not both")
        self.data_dir: Path | None = None
        self.swarm: Swarm | None = None
        self.outer: OuterOptimizer | None = None
        self.result: NodeResult | None = None

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if args.world_size > 1:
            raise ConfigError(
                f"MeshtrainCallback: this Trainer runs {args.world_size} processes; a swarm peer here is one "
                f"process (a multi-GPU peer: `meshtrain.SwarmOptimizer` in a torchrun script, or "
                f"`meshtrain node start --nproc-per-node N`)"
            )
        self.data_dir = Path(self.mesh.data_dir or Path(args.output_dir or ".") / DATA_DIR)
        if not self.mesh.join and not self.mesh.create and not (self.data_dir / "swarm.json").exists():
            raise ConfigError(
                f"MeshtrainArguments: set join=<peer address> or create=True (no swarm in {self.data_dir} to rejoin)"
            )
        if args.data_seed is None:  # every peer its own order of the same dataset
            self.data_dir.mkdir(parents=True, exist_ok=True)
            peer = Identity.load_or_create(self.data_dir).peer_id_str
            args.data_seed = (
                args.seed + int.from_bytes(hashlib.blake2b(peer.encode(), digest_size=4).digest())
            ) % 2**31
            # Accelerate's sampler took its seed from `data_seed` in the Trainer's constructor (None
            # then): it falls back to torch's initial seed, which the Trainer set to `seed`.
            set_seed(args.data_seed)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *, model: Any = None, **kw: Any
    ) -> None:
        assert self.data_dir is not None  # on_init_end ran
        options = self.mesh.node_options()
        if self.mesh.create:
            spec = parse_spec(  # flat keys; a bad value is a one-line ConfigError
                {
                    "name": self.mesh.name,
                    "model": "user",
                    "optimizer": self.mesh.optimizer,
                    "H": self.mesh.H,
                    "steps": max(args.max_steps, 0),
                    "seed": args.seed,
                    "inner_lr": args.learning_rate,
                    "batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps,
                },
                form="flat",
            )
            self.swarm = Swarm.create(spec, data_dir=self.data_dir, **options)
        elif self.mesh.join:
            self.swarm = Swarm.join(self.mesh.join, data_dir=self.data_dir, **options)
        else:
            self.swarm = Swarm.open(self.data_dir, **options)
        self.outer = build_outer(self.swarm.spec, model, None, self.swarm)  # the Trainer steps the inner one

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        assert self.swarm is not None and self.outer is not None  # on_train_begin ran
        self.outer.step()
        steps = self.swarm.spec.steps
        if steps and self.swarm.step >= steps:
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.swarm is not None:
            self.swarm.save_checkpoint()  # the swarm's state at the step of the Trainer's checkpoint-N

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        if self.swarm is not None and logs:
            self.swarm.report(loss=logs.get("loss"), eval_loss=logs.get("eval_loss"))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.swarm is not None:
            self.result = self.swarm.leave()
