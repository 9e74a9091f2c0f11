"""The `meshtrain` command line.

    meshtrain node start   [--config node.toml] [flags]    run a node in the foreground
    meshtrain node status  [--data-dir D] [--json]          ask the running node how it is doing
    meshtrain node stop    [--data-dir D] [--wait]          stop it cleanly (checkpoint, leave)
    meshtrain swarm create [--out swarm.json] [spec flags]  write a signed swarm spec (--private: with a new swarm key)
    meshtrain swarm list   [--bootstrap ADDR] [--json]      the swarms the DHT's swarm index lists
    meshtrain swarm join   <multiaddr | id@multiaddr | swarm id | name>   fetch the spec, sync, train
    meshtrain swarm allow  <peer id> [--revoke]             the owner's node admits a peer (allowlist swarms)
    meshtrain demo         [--nodes 4] [--optimizer ...]    a local 4-node swarm, live table, plot
                           [--pipeline [--stages 3]]        ... or a 6-node SkipPipe pipeline swarm
    meshtrain export       --out DIR [--data-dir D]         φ of the latest checkpoint as a standalone model
                                                            (a pipeline peer: the whole model, every stage
                                                            fetched by its running node; node/stages/export.py)
    meshtrain sample       --prompt TEXT [--data-dir D]     what φ continues the prompt with (a pipeline
                                                            peer: the whole model, as export assembles it)

User mistakes end in one line on stderr and exit code 2, never a traceback: every error we raise
on purpose is a `MeshtrainError`, and `main` turns those into messages (config errors: 2,
runtime failures: 1).

`node status` and `node stop` must answer in well under a second on a machine whose cores are
busy training, so their path imports only the standard library and the small `meshtrain.errors`,
`meshtrain.log` and `meshtrain.node.status.client` modules, their error paths too (no node running):
everything else (the config model, torch, libp2p, trio) is imported inside the command that needs
it (`tests/test_node_cli.py` checks both paths).
A foreground `node start` shows what the node does (`meshtrain.node.status.console`) unless `--quiet`.

Not here: the parser and the flags (meshtrain/node/cli_parser.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError, MeshtrainError, meshtrain_error_in
from meshtrain.log import configure
from meshtrain.node.cli_parser import STOP_WAIT_TIMEOUT, build_parser, node_config_of

__all__ = ["build_parser", "data_dir_of", "main", "node_config_of"]


def _run_node(args: argparse.Namespace, *, join: str | None, spec_path: str | None) -> int:
    config = node_config_of(args)  # first: a mistake in it is said before torch and libp2p load
    import trio

    from meshtrain.node.daemon import Node
    from meshtrain.node.spec.signed import SignedSpec

    if args.log_level is None:
        configure(config.log_level)
    if config.nproc_per_node > 1:  # one peer, N local ranks: torch's elastic launcher runs them
        from meshtrain.node.local_ranks import launch_peer

        print(
            json.dumps(
                launch_peer(config, spec_path=spec_path, join=join, log_level=args.log_level or config.log_level)
            ),
            flush=True,
        )
        return 0
    spec = SignedSpec.load(spec_path) if spec_path else None
    node = Node(config, spec=spec, join=join)

    async def run() -> Any:
        if args.quiet:
            return await node.run()
        from meshtrain.node.status.console import LiveStatus

        try:
            async with LiveStatus(node.snapshot):
                return await node.run()
        except BaseExceptionGroup as eg:
            # The status line's nursery wraps whatever ended the node: hand that on as it came.
            if len(eg.exceptions) == 1:
                raise eg.exceptions[0] from None
            raise

    result = trio.run(run)
    _print_result(
        {
            "stopped": True,
            "peer_id": result.peer_id,
            "step": result.step,
            "rounds": result.rounds,
            "skipped_steps": result.skipped_steps,
            "eval_loss": result.eval_loss,
            "checkpoint": result.checkpoint,
        }
    )
    if args.exit_at_once:
        # Everything the node owes its data dir is on disk (checkpoint fsynced, daemon.json gone):
        # skip the interpreter's teardown of torch and libp2p, which took 1-5 s on a busy machine
        # and kept `node stop --wait`, systemd and scripts waiting for nothing.
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _print_result(result: dict[str, Any]) -> None:
    """The node's last line, on stdout — unless its terminal was closed (SIGHUP under nohup, or a
    stop after the hang-up): the run ended well and its checkpoint is on disk, so that is not an
    error; stdout then goes to /dev/null, or the interpreter's own flush at exit would fail."""
    try:
        print(json.dumps(result), flush=True)
    except OSError:  # EIO from a hung-up terminal, EPIPE from a closed pipe
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def data_dir_of(args: argparse.Namespace) -> Path:
    """The data dir `node status/stop` look in: --data-dir, else $MESHTRAIN_DATA_DIR, else the
    default. The same precedence as `NodeConfig` (node/spec/config.py), whose pydantic model — and the
    optimizer package its validators import — would cost seconds to load on a busy machine."""
    if args.data_dir:
        return Path(args.data_dir).expanduser()
    if os.environ.get("MESHTRAIN_DATA_DIR"):
        return Path(os.environ["MESHTRAIN_DATA_DIR"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "meshtrain"


def _running_node(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The status URL of the node to talk to and what its daemon.json says ({} with --url)."""
    from meshtrain.node.status.client import read_daemon_file

    if args.url:
        return args.url.rstrip("/"), {}
    info = read_daemon_file(data_dir_of(args))
    if not info.get("status_url"):
        raise MeshtrainError("the running node has no status endpoint")
    return info["status_url"].rstrip("/"), info


def _control_token(info: dict[str, Any], command: str) -> str:
    """The bearer token the running node wrote (its daemon.json names the file)."""
    token_file = info.get("token_file")
    if token_file is None:
        raise ConfigError(f"{command} needs --data-dir (the token that proves you own the node is there)")
    try:
        return Path(token_file).read_text().strip()
    except OSError as e:
        raise MeshtrainError(f"cannot read the node's control token {token_file}: {e}") from None


def _node_status(args: argparse.Namespace) -> int:
    import time

    from meshtrain.node.status.client import fetch_status

    url, _ = _running_node(args)
    st = fetch_status(url, timeout=5)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    n, t = st["node"], st["training"]
    loss = "-" if t["loss"] is None else f"{t['loss']:.3f}"
    age = time.time() - (n["started"] + n["uptime_s"])
    stale = f"  (as of {age:.0f} s ago: the node is busy)" if age > 2 else ""
    print(f"node {n['peer_id']}  swarm {n['swarm']}  {n['state']}  up {n['uptime_s']:.0f}s{stale}")
    print(
        f"step {t['step']}  round {t['round']}  loss {loss}  {t['optimizer']}  "
        f"sent {t['bytes_sent'] / 2**20:.1f} MiB  received {t['bytes_received'] / 2**20:.1f} MiB"
    )
    if t.get("phi_digest"):
        parity = t.get("parity") or {}
        print(
            f"phi round {t.get('phi_round')}  digest {str(t['phi_digest'])[:16]}  "
            f"parity {parity.get('status', 'unchecked')}"
        )
    if t.get("skipped_steps"):  # the spec's pace "swarm": steps skipped to keep up with the swarm
        print(
            f"skipped {t['skipped_steps']} steps to keep the swarm's pace  waited {t['round_wait_s']:.0f} s on rounds"
        )
    if t.get("waiting"):
        print(f"waiting: {t['waiting']}")
    admission = n.get("admission") or {}
    if admission.get("rule"):
        standing = f"NOT ADMITTED ({admission['not_admitted']})" if admission.get("not_admitted") else "admitted"
        ignored = len(admission.get("ignored") or [])
        print(
            f"admission {admission['rule']}: {standing}"
            + (f"; ignoring {ignored} peer(s) that fail it" if ignored else "")
        )
        for peer, s in sorted((admission.get("standing") or {}).items()):
            by = [f"{s[k]} by {k[3:]}" for k in ("by_loss", "by_spot", "by_echo") if s.get(k)]
            by_loss = f" ({', '.join(by)})" if by else ""
            print(
                f"  strikes  {peer[-12:]}  {s['strikes']} round(s){by_loss}" + ("  EXCLUDED" if s["excluded"] else "")
            )
        other = admission.get("other_phi") or {}
        if other.get("passed") or other.get("filed"):
            print(
                f"  loss/spot verdicts on peers holding another φ: {other['passed']} passed over, "
                f"{other['filed']} filed past the passes"
            )
    conns = n.get("connections") or {}
    over = conns.get("connections", 0) - conns.get("max_peers", 0)
    held = f", {conns.get('unwanted', 0)} kept past the plan" if over > 0 else ""
    held += f", {conns['closed']} closed over it so far" if conns.get("closed") else ""
    bound = f", connected to {conns.get('connections', 0)} (bound {conns.get('max_peers')}{held})" if conns else ""
    print(f"{len(st['peers'])} live peers{bound}:")
    for p in st["peers"]:
        struck = f"  strikes {p['strikes']}" if p.get("strikes") else ""
        offset = p.get("clock_offset_s")
        clock = f"  clock {offset:+.1f} s" if offset is not None else ""
        # tensors over libp2p: its data port did not answer (a firewall, a NAT): say so
        slow = "  tensors over libp2p" if p.get("data_path") == "libp2p" else ""
        print(f"  {p['peer_id'][-12:]}  step {p['step']:>6}  {p['connection']:<8} {p['addr']}{struck}{clock}{slow}")
    return 0


def _node_stop(args: argparse.Namespace) -> int:
    from meshtrain.node.status.client import request_stop, wait_for_exit

    url, info = _running_node(args)
    request_stop(url, _control_token(info, "node stop"), timeout=5)
    if not args.wait:
        print(
            "stop accepted; the node is leaving the swarm and saving a checkpoint in the background "
            "(`node stop --wait` waits for it)"
        )
        return 0
    pid = info.get("pid")
    print(f"stop accepted; waiting for the node (pid {pid}) to leave the swarm, checkpoint and exit ...", flush=True)
    waited = wait_for_exit(int(pid) if isinstance(pid, int) else None, url, timeout=STOP_WAIT_TIMEOUT)
    print(f"the node has exited ({waited:.1f} s after the stop was accepted)")
    return 0


def _swarm_create(args: argparse.Namespace) -> int:
    from meshtrain.node.spec.config import load_node_config
    from meshtrain.node.spec.data_dir import SPEC_FILE, claim_data_dir, make_data_dir
    from meshtrain.node.spec.signed import SignedSpec
    from meshtrain.node.spec.swarm import parse_spec
    from meshtrain.transport.identity import Identity

    config = load_node_config(None, overrides={"data_dir": args.data_dir})
    values = {k[5:]: v for k, v in vars(args).items() if k.startswith("spec_") and v is not None}
    if args.private:
        if values.get("admission", "private") != "private":
            raise ConfigError(f"--private and --admission {values['admission']} contradict each other")
        values["admission"] = "private"
    spec = parse_spec(values, form="flat")
    if spec.data.dataset != "builtin" and not spec.data.dataset_digest:  # pin the files' content, not their path
        from meshtrain.data import dataset_digest

        digest = dataset_digest(spec.data.dataset, spec.data.eval_dataset)
        spec = parse_spec({**values, "dataset_digest": digest}, form="flat")
    identity = Identity.load_or_create(make_data_dir(config.data_dir))
    signed = SignedSpec.create(spec, identity)
    if args.out is None:  # the spec goes into the data dir, which `node start` then runs
        claim_data_dir(config.data_dir, signed.swarm_id)
    out = Path(args.out).expanduser() if args.out else Path(config.data_dir).expanduser() / SPEC_FILE
    if out.is_dir():  # `--out somewhere/`: the spec goes in it, under the name a data dir gives it
        out /= SPEC_FILE
    try:
        signed.save(out)
    except OSError as e:
        raise ConfigError(f"cannot write the swarm spec to {out}: {e.strerror or e}") from None
    if not spec.model.context and signed.spec.model.context:
        from meshtrain.models.sources import capped_context

        _, limit = capped_context(spec.model.source) or (0, 0)
        print(
            f"context {signed.spec.model.context} tokens per sequence: {spec.model.source} allows {limit}, "
            f"whose batches would not fit a GPU (--context N to choose)",
            file=sys.stderr,
        )
    summary = {"swarm_id": signed.swarm_id, "owner": signed.owner, "spec": str(out), "admission": spec.admission.mode}
    start = f"meshtrain node start --swarm {out}" + (f" --data-dir {args.data_dir}" if args.data_dir else "")
    if spec.admission.mode == "private":
        key_file = _write_swarm_key(Path(config.data_dir).expanduser())
        summary["swarm_key_file"] = str(key_file)
        print(json.dumps(summary))
        print(
            f"created private swarm {signed.swarm_id} ({spec.model.source}, {spec.outer.optimizer}, H={spec.outer.H}).\n"
            f"Its key is in {key_file} (mode 0600): every peer needs it, so hand it over as you would a "
            f"password. Start the swarm with:\n"
            f"  MESHTRAIN_SWARM_KEY=$(cat {key_file}) {start}\n"
            f"and peers join with (or --swarm-key KEY):\n"
            f"  MESHTRAIN_SWARM_KEY=<the key> meshtrain swarm join <multiaddr of a peer>",
            file=sys.stderr,
        )
        return 0
    print(json.dumps(summary))
    how = {
        "open": f"anyone with a proof of work of {spec.admission.pow_bits} bits on its peer id (nodes mint it themselves)",
        "allowlist": "the peers you allow (`meshtrain swarm allow <peer id>` on your running node)",
    }[spec.admission.mode]
    print(
        f"created swarm {signed.swarm_id} ({spec.model.source}, {spec.outer.optimizer}, H={spec.outer.H}); it admits {how}. "
        f"Start it with:\n  {start}",
        file=sys.stderr,
    )
    return 0


SWARM_KEY_FILE = "swarm.key"


def _write_swarm_key(data_dir: Path) -> Path:
    """A new random swarm key (libp2p pnet PSK, 32 bytes as hex) in `data_dir/swarm.key`, 0600."""
    import secrets

    from meshtrain.durable import write_atomic

    path = data_dir / SWARM_KEY_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (secrets.token_hex(32) + "\n").encode(), mode=0o600)
    return path


def _swarm_list(args: argparse.Namespace) -> int:
    import trio

    from meshtrain.node.spec.config import load_node_config
    from meshtrain.node.spec.listing import find_swarms, format_table

    config = load_node_config(args.config, overrides={"bootstrap": args.bootstrap})
    listed = trio.run(find_swarms, config.bootstrap)
    if args.json:
        for s in listed:
            spec = s.signed.spec
            row = {
                "swarm_id": s.swarm_id,
                "name": s.name,
                "owner": s.signed.owner,
                "model": spec.model.source,
                "optimizer": spec.outer.optimizer,
                "admission": spec.admission.mode,
                "pow_bits": spec.admission.pow_bits,
                "peers": s.peers,
                "step": s.step,
                "steps": spec.steps,
                "addrs": list(s.addrs),
            }
            print(json.dumps(row))
        return 0
    print(format_table(listed))
    return 0


def _swarm_allow(args: argparse.Namespace) -> int:
    from meshtrain.node.status.client import request_allow

    url, info = _running_node(args)
    request_allow(url, _control_token(info, "swarm allow"), args.peer, revoke=args.revoke)
    print(
        f"{'revoked' if args.revoke else 'allowed'} {args.peer}; every peer applies it as the owner's config reaches it"
    )
    return 0


def _export_or_sample(args: argparse.Namespace) -> int:
    from meshtrain.node.export import export_model, generate, load_spec, load_trained

    pipeline = load_spec(data_dir_of(args)).spec.pipeline.kind != "none"
    if args.command == "export":
        if pipeline:
            from meshtrain.node.stages.export import export_pipeline

            print(json.dumps(export_pipeline(data_dir_of(args), args.out, progress=_ExportProgress())))
        else:
            print(json.dumps(export_model(data_dir_of(args), args.out)))
        return 0
    if pipeline:
        from meshtrain.node.stages.export import load_assembled

        trained = load_assembled(data_dir_of(args), progress=_ExportProgress())
    else:
        trained = load_trained(data_dir_of(args))
    text = generate(trained, args.prompt, max_new_tokens=args.max_new_tokens, top_k=args.top_k, seed=args.seed)
    print(args.prompt + text)
    return 0


class _ExportProgress:
    """Prints one line on stderr whenever a pipeline export's progress (`pipeline.export`) changes."""

    def __init__(self) -> None:
        self.last = ""

    def __call__(self, state: dict[str, Any]) -> None:
        bars = state.get("stages") or {}
        fetched = ", ".join(
            f"stage {s} {b.get('done', 0) / 2**20:.1f}/{b.get('total', 0) / 2**20:.1f} MiB"
            for s, b in sorted(bars.items())
        )
        line = f"export: {state.get('phase')}" + (f" [{fetched}]" if fetched else "")
        if line != self.last:
            self.last = line
            print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """The program (`argv` None: `sys.argv`, and a node that stopped cleanly ends the process at
    once, skipping the interpreter's teardown), or a call from Python with `argv` (returns)."""
    try:
        return _main(argv, exit_at_once=argv is None)
    except BaseExceptionGroup as eg:
        err = meshtrain_error_in(eg)
        if err is None:
            if eg.subgroup(KeyboardInterrupt) is not None:
                print("meshtrain: interrupted", file=sys.stderr)
                return 130
            import traceback

            # A failure inside libp2p arrives a dozen nurseries deep, past the depth (10) Python
            # prints by default, which would hide the one line that says what went wrong.
            print(
                "".join(traceback.TracebackException.from_exception(eg, max_group_depth=1000).format()),
                end="",
                file=sys.stderr,
            )
            return 1
        # The message says what went wrong; where it came from is for whoever debugs: at DEBUG,
        # and at ERROR for a transport failure, never a user's mistake (a 30-minute soak's
        # daemon ended "stream closed while writing" and nothing said from where).
        logging.getLogger("meshtrain.node.cli").log(
            logging.ERROR if _is_transport_failure(err) else logging.DEBUG, "the error that ended the run", exc_info=eg
        )
        print(f"meshtrain: {'error: ' if isinstance(err, ConfigError) else ''}{err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else _exit_code(err)


def _is_transport_failure(err: MeshtrainError) -> bool:
    """A broken stream or transfer (transport/framing.py `WireError`, data_channel.py
    `TransferError`): looked up, not imported, as in `_exit_code`."""
    kinds = [
        getattr(sys.modules.get(module), name, None)
        for module, name in (
            ("meshtrain.transport.framing", "WireError"),
            ("meshtrain.transport.data_channel", "TransferError"),
        )
    ]
    return any(isinstance(kind, type) and isinstance(err, kind) for kind in kinds)


def _exit_code(err: MeshtrainError) -> int:
    """1 for an error; 130, as for any interrupt, for a node stopped before it trained."""
    # Only a node that started can have been stopped while starting, and it imported the phase
    # module: looked up, not imported, so `node stop` / `status` with no node running stay light
    # (importing it would load trio for an error that cannot be one of its own).
    phase = sys.modules.get("meshtrain.node.phase")
    return 130 if phase is not None and isinstance(err, phase.StoppedWhileStarting) else 1


def _main(argv: list[str] | None, *, exit_at_once: bool = False) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.exit_at_once = exit_at_once
        configure(args.log_level)
        if args.command is None:
            parser.print_help()
            return 0
        if args.command == "node":
            if args.action == "start":
                return _run_node(args, join=args.join, spec_path=args.swarm)
            if args.action == "status":
                return _node_status(args)
            if args.action == "stop":
                return _node_stop(args)
            raise ConfigError("meshtrain node: say start, status or stop")
        if args.command == "swarm":
            if args.action == "create":
                return _swarm_create(args)
            if args.action == "join":
                return _run_node(args, join=args.address, spec_path=None)
            if args.action == "list":
                return _swarm_list(args)
            if args.action == "allow":
                return _swarm_allow(args)
            raise ConfigError("meshtrain swarm: say create, list, join or allow")
        if args.command in ("export", "sample"):
            return _export_or_sample(args)
        if args.command == "demo":
            from meshtrain.node.demo import run_demo

            return run_demo(args)
        raise ConfigError(f"unknown command {args.command}")
    except ConfigError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    except MeshtrainError as e:
        print(f"meshtrain: {e}", file=sys.stderr)
        code = _exit_code(e)
        if exit_at_once and code == 130:
            # Stopped before it trained: nothing is owed to the data dir, and the interpreter's
            # teardown would wait on a worker thread still preparing data (node/daemon.py).
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return code
    except KeyboardInterrupt:
        print("meshtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
