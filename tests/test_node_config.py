"""The node's flags (`meshtrain node start`, `meshtrain swarm join`): every flag users have had
keeps its name and meaning, and an absent flag leaves the lower layers (defaults, node.toml, the
TOML file, the environment) alone. Parses only; no node, no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.node.cli import build_parser

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
