"""A multi-GPU machine as one peer: N local ranks on torch.distributed, one swarm identity.

The problem. A volunteer with 8 GPUs should be one peer of the swarm, not 8: one identity, one
member of every round, one state download when it joins. Inside the machine the GPUs share fast
links and should train as ordinary data parallelism.

Design: a *gateway-reduced peer*.
- `meshtrain node start --nproc-per-node N` (or `nproc_per_node` in the node config) starts N
  local ranks with torch's own elastic launcher (`torch.distributed.launcher.api.elastic_launch`,
  what `torchrun` runs: rendezvous on a local c10d store, `max_restarts=0`, worker monitoring).
  meshtrain does no process management of its own.
- Inner data parallelism is DistributedDataParallel over the default process group: NCCL on
  GPUs, gloo on CPUs — or, for a model that does not fit one device, FSDP2 `fully_shard`
  (node config `sharding`, `--sharding ddp|fsdp|auto`; node/ranks/sharding.py tells that variant). The spec's `batch_size` is what the peer trains per step; rank r trains rows
  [r·b/N, (r+1)·b/N) of it (b must divide by N), so an N-rank peer trains exactly the samples a
  single-rank peer would, and the swarm's progress (`samples = step × batch_size`) counts the
  samples of all N ranks as this peer's.
- Local rank 0 is the gateway: it alone runs the `Node` — libp2p host, CRDT replica, collective,
  checkpoints, status page. Ranks 1..N-1 run the same `Trainer` loop without a network.
- A round: every rank computes Δ (identical under DDP, but computed where the data is), the
  ranks reduce it to rank 0 inside the machine (gloo over host tensors, a process group of its
  own so it never interleaves with DDP's), rank 0 exchanges that mean with the swarm through
  its real collective, then broadcasts the outcome — the swarm's mean, or "you are alone" — to
  the other ranks; every rank applies the same outer step, so φ and the outer state stay
  identical on all ranks (`LocalRanksCollective`, which wraps the swarm's `Collective`, so the
  outer optimizers need no change).
- Why not prime's design (PCCL/prime: every rank exchanges its own shard of the pseudo-gradient
  with the same-numbered rank of the other peers, one peer group per shard): that needs every
  rank reachable from the internet and N swarm identities per machine, and a peer with a
  different GPU count cannot pair its shards with anyone. Ours puts one NAT-traversing identity
  per machine and lets peers of any size meet; the cost is that rank 0 moves the whole Δ
  (fine while the swarm's links, not the machine's, are the bottleneck).
- Control: when rank 0 builds its trainer it sends the others the spec and its peer id, so they
  build theirs (model, data, DDP) while rank 0 enters the swarm — a peer slow to reach its first
  round makes the others wait. At every `Trainer.run`, rank 0 sends the step to stop at and its
  full state (model, inner and outer state) — at start, after a resume, after a late joiner's
  download. Every `REPORT_EVERY` steps the ranks agree whether to go on (rank 0's
  stop flag decides), one small broadcast on a third process group. When the node ends, rank 0
  sends "done".

Failures.
- A local rank that dies (kill -9, OOM) closes its gloo/NCCL connections: the blocked
  collective in every other rank fails at once — no rank waits on a dead one (the FSDP footgun
  PCCL warns about). The gateway's trainer then records `local_failure` and stops the node
  cleanly: it leaves the swarm (the swarm sees one peer leave), saves a checkpoint, exits non-zero.
  The elastic agent stops the other ranks, and `launch_peer` ends in one line. Restarted, the
  peer resumes from that checkpoint (or downloads the swarm's state if it fell behind).
- Non-gateway ranks ignore SIGINT/SIGTERM (Ctrl-C reaches every process of the terminal): they
  stop when rank 0 says so, or when rank 0 is gone.
- SIGTERM to the launcher: the elastic agent passes it on to the ranks and waits for them to
  exit, reading no results (and kills them after 30 s) — while a rank that returns a result
  waits for it to be read. So rank 0, stopped cleanly by a SIGTERM (it leaves the swarm and
  saves a checkpoint), tells the others "done; exit at once", and every rank exits as soon as
  its work is done: the peer ends within seconds, during start-up as during training. (During
  start-up, once the trainer builds under way have finished: a rank builds its model and data in
  one piece, and a follower reads "done" only after its build — ~3 s for a tiny model here, 11 s
  on a loaded 2-core machine; a large model's load takes as long as it takes, up to the agent's
  30 s, after which it kills the ranks.)
- Process-group timeouts are long (`LOCAL_GROUP_TIMEOUT`: rank 0 may be downloading the swarm's
  state while the others wait); a dead rank is found by its closed connections, not by a timeout.

The FSDP variant (node/ranks/sharding.py) keeps this design with one change: the ranks hold shards of
one θ rather than N replicas, so the in-machine reduce of Δ becomes a gather of θ to rank 0,
which alone holds φ and the outer optimizer (over a host replica of the model) and runs the
round; the broadcast of the outcome becomes a scatter of the new θ's shards. The other ranks keep
a clock of the round schedule instead of an outer optimizer, so every rank reaches each gather
and scatter at the same step without a message, and rank 0's re-sync reaches them as a stop.
Its checkpoints hold θ and the outer state whole and the inner state in shards any rank count
reads (DCP), so a peer resumes with another rank count or sharding.

Not here: models handed in through the Python API (ranks 1..N-1 build the spec's model); several
machines as one peer.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import trio

from meshtrain.allocator import release_freed_memory
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.log import configure, get_logger, kv
from meshtrain.node.ranks.devices import resolve_device
from meshtrain.node.ranks.group import DONE_EXIT, LocalRankError, LocalRanks
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.spec.swarm import parse_spec

log = get_logger(__name__)


# -- the launcher and the ranks' entry points ----------------------------------------------------


def launch_peer(config: NodeConfig, *, spec_path: str | None, join: str | None, log_level: str | None) -> dict:
    """Run this peer as `config.nproc_per_node` local ranks through torch's elastic launcher;
    returns rank 0's result (with every rank's peak RSS). A failed rank is a `LocalRankError`."""
    n = config.nproc_per_node
    for rank in range(n):  # a device the machine lacks: one line now, not a hang in the rendezvous
        if resolve_device(config.device, rank).type == "mps":
            raise ConfigError(
                "device mps runs one rank (nproc_per_node = 1): there is no process-group "
                "backend for several ranks on MPS"
            )
    # Ctrl-C reaches every process of the terminal: rank 0 stops the peer cleanly on it, the other
    # ranks ignore it, and so does the agent (passing it on would be rank 0's second signal, "exit
    # at once"); it then returns when the ranks have. SIGTERM to the agent is passed on to the ranks.
    # What the launcher leaves in the temp folder goes in one folder of ours, removed when the
    # launcher ends (a kill -9 of the launcher alone leaves it): the agent's log folder, which it
    # would make under the system's temp folder and never remove, and the error file of a rank
    # that was killed (torch.multiprocessing writes one per rank and removes it after a clean exit).
    with tempfile.TemporaryDirectory(prefix="meshtrain-ranks-") as scratch:
        system_temp, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            return _launch(config, scratch, spec_path=spec_path, join=join, log_level=log_level)
        finally:
            tempfile.tempdir = system_temp


def _launch(
    config: NodeConfig, agent_logs: str, *, spec_path: str | None, join: str | None, log_level: str | None
) -> dict:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=agent_logs),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc_per_node,
        run_id=f"meshtrain-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        results = elastic_launch(launch, run_local_rank)(config.model_dump(mode="json"), spec_path, join, log_level)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        raise LocalRankError(
            f"local rank {rank} of this peer ended ({how}); the peer stopped and left the "
            f"swarm. Start it again to resume from its checkpoint"
        ) from None
    except SignalException as e:  # SIGTERM: the agent passed it on; rank 0 stopped cleanly
        return {"stopped": True, "signal": signal.Signals(e.sigval).name}
    finally:
        signal.signal(signal.SIGINT, previous)
    gateway = results.get(0)
    if gateway is None:  # a SIGTERM sent to rank 0 itself: it stopped cleanly and exited without a result
        return {"stopped": True, "signal": "SIGTERM"}
    if "error" in gateway:
        raise (ConfigError if gateway["config_error"] else MeshtrainError)(gateway["error"])
    gateway["local_ranks_peak_rss_mib"] = [results[r]["peak_rss_mib"] for r in sorted(results)]
    return gateway


def run_local_rank(
    config_data: dict[str, Any], spec_path: str | None, join: str | None, log_level: str | None
) -> dict[str, Any]:
    """One local rank (a process the elastic launcher spawned). Rank 0 runs the node; the others
    follow it. Errors meant for the user come back as values, so the launcher prints one line."""
    configure(log_level)
    release_freed_memory()  # every rank's freed buffers leave its process (allocator.py)
    config = NodeConfig.model_validate(config_data)
    local = LocalRanks.start(config)  # failing here fails the rank: the agent stops the others
    try:
        if local.is_gateway:
            result = _gateway(local, config, spec_path, join)
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            result = {"rank": local.rank, "peak_rss_mib": _rss_mib(), "exit_now": _follow(local, config) == DONE_EXIT}
    finally:
        dist.destroy_process_group()
    if result.pop("exit_now", False):
        # The agent got SIGTERM and passed it on: it waits for the ranks to exit (then kills them,
        # 30 s later) and reads no result, while a rank that returns waits for its result to be
        # read. So a rank stopped this way exits as soon as its work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return result


def _gateway(local: LocalRanks, config: NodeConfig, spec_path: str | None, join: str | None) -> dict[str, Any]:
    from meshtrain.node.daemon import Node
    from meshtrain.node.spec.signed import SignedSpec

    node = None
    try:
        spec = SignedSpec.load(spec_path) if spec_path else None
        node = Node(config, spec=spec, join=join, local=local)
        result = trio.run(node.run)
    except MeshtrainError as e:
        # Stopped by SIGTERM before it trained (while preparing, say): the agent that passed the
        # signal on reads no result, so every rank exits at once, as after a clean stop.
        exit_now = node is not None and node.stop_signal == "SIGTERM"
        _tell_followers_done(local, exit_now)
        return {
            "error": str(e),
            "config_error": isinstance(e, ConfigError),
            "peak_rss_mib": _rss_mib(),
            "exit_now": exit_now,
        }
    failure = node.trainer.local_failure if node.trainer is not None else None
    if failure is not None:
        raise LocalRankError(failure)  # the elastic agent reports the rank that died first
    exit_now = node.stop_signal == "SIGTERM"
    _tell_followers_done(local, exit_now)
    return {
        "stopped": True,
        "exit_now": exit_now,
        "peer_id": result.peer_id,
        "step": result.step,
        "rounds": result.rounds,
        "eval_loss": result.eval_loss,
        "checkpoint": result.checkpoint,
        "local_ranks": local.world_size,
        "sharding": local.sharding,
        "peak_rss_mib": _rss_mib(),
    }


def _tell_followers_done(local: LocalRanks, exit_now: bool = False) -> None:
    try:
        local.finish(exit_now)
    except RuntimeError as e:  # they are gone already
        log.info(kv("could not tell the other local ranks to stop", error=str(e)[:200]))


def _follow(local: LocalRanks, config: NodeConfig) -> str:
    """Ranks 1..N-1: build the trainer from rank 0's first message, then run every run it starts.
    Returns rank 0's last message (`DONE` or `DONE_EXIT`)."""
    import threading

    from meshtrain.node.trainer import Trainer

    if config.threads:
        torch.set_num_threads(config.threads)
    msg = local.receive()
    if not isinstance(msg, dict):
        return str(msg)
    trainer = Trainer(
        parse_spec(msg["spec"], signed=True),  # the swarm's own spec, as rank 0 loaded it
        local.collective(None),
        msg["peer_id"],
        local=local,
        data_dir=Path(config.data_dir).expanduser(),
    )
    never = threading.Event()
    msg = local.receive()

    async def runs() -> None:
        nonlocal msg
        async with trainer.outer:
            while isinstance(msg, dict):
                local.pending = msg
                await trio.to_thread.run_sync(trainer.run, never, 0, lambda _t: None)
                if trainer.local_failure is not None:
                    raise LocalRankError(trainer.local_failure)
                if trainer.outer.in_flight:
                    await trainer.outer.afinish()
                msg = await trio.to_thread.run_sync(local.receive)

    trio.run(runs)
    return str(msg)


def _rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
