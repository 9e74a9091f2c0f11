"""node layer of meshtrain: a peer that trains with its swarm (docs/architecture.md).

At the top, what runs a node: `cli` (`meshtrain ...`), `daemon` (`Node`, which composes the
parts), `training_run` (one training run over a signed spec), `trainer` (the inner loop),
`presence` (finding and keeping the swarm's peers), `user_loop` (`meshtrain.Swarm` for your own
loop), `local_ranks` (a multi-GPU peer's launcher), `export` and `demo`. The rooms:

- `spec/`: what a swarm trains and how this machine runs — swarm spec, signed spec, node
  config, outer-optimizer spec, the swarm listing.
- `state/`: the state a peer trains on and keeps — run state, checkpoints, the state sync
  (protocol, fetch, donor), parity, the address book.
- `trust/`: whom the swarm counts — admission, strikes, loss scoring, spot checks, the
  verification that wires them, and the adversary test hooks.
- `status/`: what a node tells its operator — the status document, its HTTP server and client,
  the console, plots, the dashboard.
- `ranks/`: a peer of several local ranks — the rank group, FSDP sharding, devices.
- `stages/`: a pipeline (SkipPipe) swarm's peer — its run path, stage trainer, stage state,
  handover, announcements, export, lab.
"""
