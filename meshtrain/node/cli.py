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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain import __version__
from meshtrain.errors import ConfigError, MeshtrainError, meshtrain_error_in
from meshtrain.log import configure

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from meshtrain.node.spec.config import NodeConfig

STOP_WAIT_TIMEOUT = 120.0  # seconds `node stop --wait` waits for the node to exit


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is our one-line ConfigError (exit 2) like every other.

    `more_args(parser)` adds arguments the first time this parser parses: `swarm create` takes
    its flags from the pydantic spec model, `node start` and `swarm join` theirs from `NodeConfig`,
    models which other commands (`node status`, `node stop`) must not pay to import.
    """

    def __init__(
        self, *args: Any, more_args: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._more_args = more_args

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        if self._more_args is not None:
            more, self._more_args = self._more_args, None
            more(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def _node_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `node start` and `swarm join`: `--config`, one flag per `NodeConfig` field
    (`_config_flag`; a field whose `json_schema_extra` says `flag: False` has none), `--quiet`.
    Every generated flag defaults to None, so a flag not given overrides no lower layer."""
    p.add_argument("--config", help="TOML file with node settings (see docs/configuration.md)")
    for name, info in _flagged_fields().items():
        _config_flag(p, name, info)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no live status line (on a terminal) or per-round lines (elsewhere) on stdout",
    )


def _spec_flags(p: argparse.ArgumentParser) -> None:
    from meshtrain.node.spec.swarm import FLAT_KEYS, default_of, field_of

    for name in FLAT_KEYS:  # the flat names: a flag per field of every section
        info = field_of(name)
        if name.endswith("_digest"):  # pinned by `swarm create` from the files, not typed
            continue
        if name == "allowlist":
            p.add_argument(
                "--allow",
                dest="spec_allowlist",
                action="append",
                default=None,
                help="allowlist admission: a peer id admitted from the start (repeatable; more at run "
                "time with `meshtrain swarm allow`)",
            )
            continue
        kind = {int: int, float: float}.get(info.annotation, str)  # type: ignore[arg-type]
        p.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"spec_{name}",
            type=kind,
            default=None,
            help=f"{info.description or name} (default {default_of(name)})",  # of a spec given no keys
        )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshtrain", description="Train one PyTorch model together with strangers' machines, peer to peer."
    )
    p.add_argument("--version", action="version", version=f"meshtrain {__version__}")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default; or MESHTRAIN_LOG)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    node = sub.add_parser("node", help="run and control a node")
    nsub = node.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    nsub.add_parser("start", help="run a node in the foreground (Ctrl-C stops it cleanly)", more_args=_node_start_flags)
    for name, help_ in (
        ("status", "show the running node's status"),
        ("stop", "ask the running node to stop cleanly (returns once it accepted)"),
    ):
        q = nsub.add_parser(name, help=help_)
        q.add_argument(
            "--data-dir", help="the node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
        )
        q.add_argument("--url", help="the node's status URL instead of looking it up in the data dir")
        if name == "status":
            q.add_argument("--json", action="store_true", help="print the raw status document")
        else:
            q.add_argument(
                "--wait",
                action="store_true",
                help=f"wait until the node has left the swarm, checkpointed and exited "
                f"(at most {STOP_WAIT_TIMEOUT:.0f} s)",
            )

    swarm = sub.add_parser("swarm", help="create or join a swarm")
    ssub = swarm.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    create = ssub.add_parser("create", help="write a swarm spec signed by this node's key", more_args=_spec_flags)
    create.add_argument("--data-dir", help="whose key signs (default ~/.local/share/meshtrain)")
    create.add_argument("--out", help="where to write the spec (default: <data dir>/swarm.json)")
    create.add_argument(
        "--private",
        action="store_true",
        help="a private swarm: admission private, and a new swarm key (written to <data dir>/swarm.key) "
        "that every peer must pass",
    )
    listing = ssub.add_parser("list", help="list the swarms the DHT's swarm index knows, as a table")
    listing.add_argument("--bootstrap", action="append", help="multiaddr of any meshtrain node (repeatable)")
    listing.add_argument("--config", help="TOML node config whose bootstrap list to use")
    listing.add_argument("--json", action="store_true", help="one JSON object per swarm instead of a table")
    join = ssub.add_parser(
        "join", help="join a swarm (by a peer's address, or by id or name via the DHT) and train", more_args=_node_flags
    )
    join.add_argument(
        "address",
        help="a peer's multiaddr, <swarm id>@<multiaddr>, or a swarm id or name from `meshtrain swarm list` "
        "(needs a bootstrap address)",
    )
    allow = ssub.add_parser("allow", help="on the owner's running node: admit a peer to an allowlist swarm")
    allow.add_argument("peer", help="the peer id to admit (a waiting node prints its own)")
    allow.add_argument("--revoke", action="store_true", help="take the peer's admission back")
    allow.add_argument(
        "--data-dir", help="the owner node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
    )
    allow.add_argument("--url", help="the owner node's status URL instead of looking it up in the data dir")

    sub.add_parser("demo", help="run a local swarm on this machine and show it training", more_args=_demo_flags)

    export = sub.add_parser(
        "export",
        help="write the swarm's outer parameters φ (latest checkpoint; a pipeline peer: every stage) as a model",
    )
    export.add_argument(
        "--data-dir", help="the node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
    )
    export.add_argument("--out", required=True, help="a new directory (HF save_pretrained layout for hf: models)")
    sample = sub.add_parser("sample", help="continue a prompt with the swarm's outer parameters φ")
    sample.add_argument(
        "--data-dir", help="the node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
    )
    sample.add_argument("--prompt", required=True, help="text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add (default 100)")
    sample.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: greedy)")
    sample.add_argument("--seed", type=int, default=0, help="seed of the top-k sampler (default 0)")
    return p


def _node_start_flags(p: argparse.ArgumentParser) -> None:
    """`node start`'s flags: the node's (`_node_flags`), and where its swarm spec comes from."""
    _node_flags(p)
    p.add_argument("--swarm", help="signed swarm spec file (default: the data dir's swarm.json)")
    p.add_argument("--join", help="peer multiaddr (or swarm-id@multiaddr) to fetch the swarm from")


def _flagged_fields() -> dict[str, FieldInfo]:
    """The `NodeConfig` fields that are flags, by name."""
    from meshtrain.node.spec.config import NodeConfig

    return {
        name: info
        for name, info in NodeConfig.model_fields.items()
        if not (isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("flag") is False)
    }


def _config_flag(p: argparse.ArgumentParser, name: str, info: FieldInfo) -> None:
    """`--<field-name>` for one `NodeConfig` field; its help is the field's description.

    A boolean that defaults to true is `--no-<name>` ("do not <description>": such a field is
    described by what it does), one that defaults to false a plain switch; a list is repeatable
    (`append`); a `Literal` gives the choices; int, float and Path are parsed as such, so a bad
    value is argparse's one-line error before any config is read."""
    flag = name.replace("_", "-")
    text = (info.description or name).replace("%", "%%")  # argparse formats help with %
    kind = info.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None`: None is the default
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is bool:
        if info.default is True:
            p.add_argument(f"--no-{flag}", dest=name, action="store_false", default=None, help=f"do not {text}")
        else:
            p.add_argument(f"--{flag}", dest=name, action="store_true", default=None, help=text)
        return
    default = info.get_default(call_default_factory=True)
    notes = []
    options: dict[str, Any] = {}
    if typing.get_origin(kind) is list:
        options["action"] = "append"
        kind = typing.get_args(kind)[0]
        notes.append("repeatable")
        default = ", ".join(default)
    if typing.get_origin(kind) is typing.Literal:
        options["choices"] = typing.get_args(kind)
    elif kind in (int, float, Path):
        options["type"] = kind
    elif kind is not str:
        raise TypeError(f"NodeConfig.{name}: no flag for a {kind} (mark the field flag: False, or parse it here)")
    if default not in (None, "") and not isinstance(default, Path):  # a path's default depends on the user
        notes.append(f"default {default:g}" if isinstance(default, float) else f"default {default}")
    more = f" ({'; '.join(notes)})" if notes else ""
    p.add_argument(f"--{flag}", dest=name, default=None, help=f"{text}{more}", **options)


def node_config_of(args: argparse.Namespace) -> NodeConfig:
    """The `NodeConfig` of `node start` / `swarm join`: `load_node_config`'s layers (defaults,
    node.toml, `--config`, the environment) under the flags given (`_node_flags`)."""
    from meshtrain.node.spec.config import load_node_config

    return load_node_config(args.config, overrides={name: getattr(args, name) for name in _flagged_fields()})


def _demo_flags(p: argparse.ArgumentParser) -> None:
    """`demo`'s flags; `--optimizer` and `--replica-sync` offer what the optimizer map and the spec
    model allow (node/demo.py `DEMO_OPTIMIZERS`), whose imports (torch, pydantic) only `demo` pays."""
    from meshtrain.node.demo import DEMO_OPTIMIZERS
    from meshtrain.pipeline.spec_section import PipelineSection

    p.add_argument("--nodes", type=int, default=None, help="number of node processes (default 4; --pipeline 6)")
    p.add_argument(
        "--optimizer", choices=DEMO_OPTIMIZERS, default="diloco", help="the outer optimizer (default diloco)"
    )
    p.add_argument("--steps", type=int, default=None, help="inner steps (default 600; --quick 60)")
    p.add_argument("--H", type=int, default=None, help="inner steps per round (default 50; --quick 20)")
    p.add_argument("--quick", action="store_true", help="a short run (CI)")
    p.add_argument("--out", default="runs/demo", help="where the plot and summary go (default runs/demo)")
    p.add_argument("--plain", action="store_true", help="plain progress lines instead of a live table")
    p.add_argument("--pipeline", action="store_true", help="a pipeline swarm: SkipPipe over --stages stages")
    p.add_argument("--stages", type=int, default=3, help="--pipeline: stages (default 3)")
    p.add_argument("--skip-ratio", type=float, default=0.0, help="--pipeline: SkipPipe's skip ratio (default 0)")
    p.add_argument(
        "--replica-sync",
        choices=typing.get_args(PipelineSection.model_fields["replica_sync"].annotation),
        default="every-step",
        help="--pipeline: how a stage's replicas agree (default every-step)",
    )


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
    print(
        json.dumps(
            {
                "stopped": True,
                "peer_id": result.peer_id,
                "step": result.step,
                "rounds": result.rounds,
                "eval_loss": result.eval_loss,
                "checkpoint": result.checkpoint,
            }
        ),
        flush=True,
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
    print(f"{len(st['peers'])} live peers:")
    for p in st["peers"]:
        struck = f"  strikes {p['strikes']}" if p.get("strikes") else ""
        offset = p.get("clock_offset_s")
        clock = f"  clock {offset:+.1f} s" if offset is not None else ""
        print(f"  {p['peer_id'][-12:]}  step {p['step']:>6}  {p['connection']:<8} {p['addr']}{struck}{clock}")
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
    identity = Identity.load_or_create(config.data_dir)
    signed = SignedSpec.create(spec, identity)
    out = signed.save(args.out or Path(config.data_dir).expanduser() / "swarm.json")
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
        print(f"meshtrain: {'error: ' if isinstance(err, ConfigError) else ''}{err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else _exit_code(err)


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
