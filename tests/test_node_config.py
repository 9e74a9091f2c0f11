"""The node's flags (`meshtrain node start`, `meshtrain swarm join`), generated from `NodeConfig`
(node/cli.py `_node_flags`): every flag users have had keeps its name and meaning, every field is a
flag or deliberately is not, a bad value is one line, and the layers keep their precedence
(defaults < TOML file < environment < flags; an absent flag leaves the lower layers alone).
Parses and validates only; no node, no network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshtrain.errors import ConfigError
from meshtrain.node.cli import build_parser, main, node_config_of
from meshtrain.node.spec.config import ENV_PREFIX, NodeConfig

# Every node flag as it was before the flags were generated from NodeConfig: the flag, the
# arguments that follow it, and the attribute and value the command reads.
TODAYS_NODE_FLAGS: list[tuple[list[str], str, object]] = [
    (["--config", "n.toml"], "config", "n.toml"),
    (["--data-dir", "/tmp/d"], "data_dir", "/tmp/d"),
    (["--name", "lab-1"], "name", "lab-1"),
    (
        ["--listen", "/ip4/127.0.0.1/tcp/1", "--listen", "/ip4/127.0.0.1/tcp/2"],
        "listen",
        ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"],
    ),
    (["--announce", "/ip4/1.2.3.4/tcp/4001"], "announce", ["/ip4/1.2.3.4/tcp/4001"]),
    (["--bootstrap", "/ip4/1.2.3.4/tcp/4001"], "bootstrap", ["/ip4/1.2.3.4/tcp/4001"]),
    (["--swarm-key", "ab" * 32], "swarm_key", "ab" * 32),
    (["--status-port", "7071"], "status_port", 7071),
    (["--status-host", "0.0.0.0"], "status_host", "0.0.0.0"),
    (["--checkpoint-every", "2.5"], "checkpoint_every", 2.5),
    (["--threads", "3"], "threads", 3),
    (["--max-steps", "40"], "max_steps", 40),
    (["--join-timeout", "7.5"], "join_timeout", 7.5),
    (["--wait-peers", "4"], "wait_peers", 4),
    (["--max-donors", "2"], "max_donors", 2),
    (["--donor-upload-mib", "1.5"], "donor_upload_mib", 1.5),
    (["--uplink-mbit", "100"], "uplink_mbit", 100.0),
    (["--no-nat"], "nat", False),
    (["--no-relay"], "relay", False),
    (["--mdns"], "mdns", True),
    (["--no-upnp"], "upnp", False),
    (["--quiet"], "quiet", True),
    (["--device", "cpu"], "device", "cpu"),
    (["--nproc-per-node", "2"], "nproc_per_node", 2),
    (["--sharding", "fsdp"], "sharding", "fsdp"),
]
START_ONLY_FLAGS: list[tuple[list[str], str, object]] = [
    (["--swarm", "s.json"], "swarm", "s.json"),
    (["--join", "/ip4/1.2.3.4/tcp/4001"], "join", "/ip4/1.2.3.4/tcp/4001"),
]
COMMANDS = {"node start": ["node", "start"], "swarm join": ["swarm", "join", "/ip4/1.2.3.4/tcp/4001"]}


def _plain(value: object) -> object:
    return str(value) if isinstance(value, Path) else value


@pytest.mark.parametrize("command", COMMANDS)
def test_every_node_flag_users_have_keeps_its_name_and_meaning(command):
    flags = TODAYS_NODE_FLAGS + (START_ONLY_FLAGS if command == "node start" else [])
    args = build_parser().parse_args(COMMANDS[command] + [a for argv, _, _ in flags for a in argv])
    assert {dest: _plain(getattr(args, dest)) for _, dest, _ in flags} == {dest: v for _, dest, v in flags}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_absent_node_flag_leaves_the_lower_layers_alone(command):
    args = build_parser().parse_args(COMMANDS[command])
    unset = {dest: getattr(args, dest) for _, dest, _ in TODAYS_NODE_FLAGS if dest != "quiet"}
    assert unset == dict.fromkeys(unset)
    assert args.quiet is False


# A value other than the default for every NodeConfig field that is a flag, and the fields that
# deliberately are not (config.py's docstring says why).
FLAG_VALUES: dict[str, object] = {
    "data_dir": Path("/tmp/meshtrain-flags"),
    "name": "lab-1",
    "listen": ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"],
    "announce": ["/ip4/1.2.3.4/tcp/4001"],
    "data_port": 4002,
    "tensorboard": Path("/tmp/tb"),
    "bootstrap": ["/ip4/1.2.3.4/tcp/4002"],
    "swarm_key": "ab" * 32,
    "status_host": "0.0.0.0",
    "status_port": 7071,
    "checkpoint_every": 2.5,
    "keep_checkpoints": 5,
    "threads": 3,
    "join_timeout": 7.5,
    "part_timeout": 9.0,
    "wait_peers": 4,
    "wait_peers_timeout": 60.0,
    "max_donors": 2,
    "donor_upload_mib": 1.5,
    "uplink_mbit": 100.0,
    "max_steps": 40,
    "max_peers": 8,
    "nat": False,
    "relay": False,
    "relay_reservations": 4,
    "relay_circuit_mib": 64,
    "mdns": True,
    "upnp": False,
    "device": "cpu",
    "nproc_per_node": 2,
    "sharding": "fsdp",
}
FLAGLESS = {"log_level", "pipeline_lab"}


def _argv(name: str, value: object) -> list[str]:
    """The flags that give field `name` this value: `--no-<name>` for a boolean that defaults to
    true, a plain switch for one that defaults to false, a list as the flag repeated."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + flag[2:]]
    if isinstance(value, list):
        return [a for v in value for a in (flag, v)]
    return [flag, str(value)]


@pytest.fixture
def clean_environ(monkeypatch):
    """No MESHTRAIN_* settings from the shell that runs the tests."""
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)


def test_every_node_config_field_is_a_flag_or_deliberately_flagless(clean_environ):
    assert set(FLAG_VALUES) | FLAGLESS == set(NodeConfig.model_fields) and not set(FLAG_VALUES) & FLAGLESS
    assert all(FLAG_VALUES[k] != v for k, v in NodeConfig().model_dump().items() if k in FLAG_VALUES)
    for command in COMMANDS.values():
        argv = command + [a for name, value in FLAG_VALUES.items() for a in _argv(name, value)]
        config = node_config_of(build_parser().parse_args(argv))
        assert {name: getattr(config, name) for name in FLAG_VALUES} == FLAG_VALUES
    for name in FLAGLESS:
        with pytest.raises(ConfigError, match="unrecognized arguments"):
            build_parser().parse_args([*COMMANDS["node start"], "--" + name.replace("_", "-"), "x"])


def test_node_start_help_shows_each_flag_with_its_fields_description(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["node", "start", "--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, value in FLAG_VALUES.items():
        description = " ".join((NodeConfig.model_fields[name].description or "").split())
        assert f"{_argv(name, value)[0]} " in shown and description in shown, name
    assert "--no-nat do not traverse NATs" in shown and "(repeatable; default /ip4/0.0.0.0/tcp/4001)" in shown


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--threads", "many"], "--threads: invalid int value: 'many'"),
        (["--sharding", "zero"], "--sharding: invalid choice: 'zero'"),
        (["--checkpoint-every", "soon"], "--checkpoint-every: invalid float value"),
        (["--keep-checkpoints", "0"], "keep_checkpoints: Input should be greater than or equal to 1"),
        (["--listen", "not-an-addr"], "listen"),
    ],
)
def test_a_bad_node_flag_value_is_one_line_and_exit_code_2(tmp_path, capsys, clean_environ, flags, needle):
    assert main(["node", "start", "--data-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_flags_over_environment_over_toml_file_over_defaults(tmp_path, monkeypatch, clean_environ):
    toml = tmp_path / "node.toml"
    toml.write_text(
        "[node]\nname = 'from-toml'\nthreads = 2\njoin_timeout = 5.0\nwait_peers = 3\nnat = false\n"
        "listen = ['/ip4/127.0.0.1/tcp/10']\n"
    )
    monkeypatch.setenv("MESHTRAIN_JOIN_TIMEOUT", "6")
    monkeypatch.setenv("MESHTRAIN_WAIT_PEERS", "4")
    monkeypatch.setenv("MESHTRAIN_UPNP", "false")
    monkeypatch.setenv("MESHTRAIN_LISTEN", "/ip4/127.0.0.1/tcp/11,/ip4/127.0.0.1/tcp/12")
    args = ["node", "start", "--config", str(toml), "--wait-peers", "5", "--listen", "/ip4/127.0.0.1/tcp/13"]
    config = node_config_of(build_parser().parse_args(args))
    assert (config.status_port, config.relay, config.mdns) == (7070, True, False)  # defaults
    assert (config.name, config.threads, config.nat) == ("from-toml", 2, False)  # the file; no flag undoes it
    assert (config.join_timeout, config.upnp) == (6.0, False)  # the environment over the file
    assert (config.wait_peers, config.listen) == (5, ["/ip4/127.0.0.1/tcp/13"])  # flags over all
    assert node_config_of(build_parser().parse_args(["node", "start", "--no-upnp", "--mdns"])).mdns is True


def test_the_relay_quota_flags_reach_the_relay_and_default_to_its_own_limits(clean_environ):
    """`--relay-reservations` and `--relay-circuit-mib` cap what a public node relays for others
    (issue 32: any public node relayed 128 reservations and 16 GiB a circuit, with no say)."""
    from meshtrain.transport.relay import RelayConfig

    args = build_parser().parse_args(["node", "start", "--relay-reservations", "4", "--relay-circuit-mib", "64"])
    limits = RelayConfig(**node_config_of(args).relay_limits())  # as the daemon builds it
    assert (limits.max_reservations, limits.circuit_bytes) == (4, 64 << 20)
    assert limits.limits().max_reservations == 4 and limits.limits().data == 64 << 20  # what libp2p's relay enforces
    default = RelayConfig(**NodeConfig().relay_limits())
    assert (default.max_reservations, default.circuit_bytes) == (
        RelayConfig().max_reservations,
        RelayConfig().circuit_bytes,
    )
