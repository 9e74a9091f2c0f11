"""Admission rules as pure functions: the proof of work on a peer id, the three rules a
spec can name, the join forms, the swarm index's verification of adverts, and the CLI's
`swarm create --private`."""

from __future__ import annotations

import dataclasses
import json
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.crdt.swarm_view import PeerInfo
from meshtrain.dht.kademlia import NETWORK
from meshtrain.dht.records import Record
from meshtrain.dht.swarm_index import SWARMS_KEY, SwarmAdvert, advert_subkey
from meshtrain.errors import ConfigError
from meshtrain.node.cli import main
from meshtrain.node.spec.config import DEFAULT_CONFIG_FILE, NodeConfig, load_node_config
from meshtrain.node.spec.listing import format_table, pick_swarm, verify_adverts
from meshtrain.node.spec.signed import SignedSpec, parse_join_address
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec
from meshtrain.node.trust.admission import (
    NO_PROOF,
    NOT_ALLOWED,
    POW_CAP,
    POW_FILE,
    Admission,
    allow_key,
    load_or_mint_pow,
    mint_pow,
    pow_ok,
)
from meshtrain.transport.identity import Identity

OWNER = Identity.from_seed(bytes(32))  # fixed identities: the proofs below are deterministic
PEERS = [Identity.from_seed(bytes([i]) * 32).peer_id_str for i in range(1, 5)]


def member(peer_id: str, **caps: object) -> PeerInfo:
    return PeerInfo(peer_id, (), "trainer", dict(caps), "direct", 0, 10_000, False, 1)


def signed(**spec: object) -> SignedSpec:
    return SignedSpec.create(parse_spec({"model": "gpt-tiny", **spec}), OWNER)


# --- proof of work ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(bits=st.integers(0, 8), peer=st.sampled_from(PEERS), swarm=st.text(min_size=1, max_size=30))
def test_a_minted_proof_verifies_and_is_the_first_nonce_that_does(bits: int, peer: str, swarm: str) -> None:
    nonce = mint_pow(swarm, peer, bits)
    assert pow_ok(swarm, peer, nonce, bits)
    assert not any(pow_ok(swarm, peer, n, bits) for n in range(nonce)) or bits == 0


def test_a_proof_is_bound_to_its_peer_and_swarm_and_rejects_junk() -> None:
    bits = 12
    nonce = mint_pow("ms-a", PEERS[0], bits)
    assert not pow_ok("ms-a", PEERS[1], nonce, bits)  # another identity must find its own
    assert not pow_ok("ms-b", PEERS[0], nonce, bits)  # and so must the same identity in another swarm
    for junk in (None, -1, 1 << 64, "7", 3.0, True, [nonce]):
        assert not pow_ok("ms-a", PEERS[0], junk, bits)
    assert pow_ok("ms-a", PEERS[0], None, 0)  # no difficulty: no proof needed


def test_a_nodes_proof_is_minted_once_and_kept(tmp_path) -> None:
    first = load_or_mint_pow(tmp_path, "ms-x", PEERS[0], 10)
    kept = json.loads((tmp_path / POW_FILE).read_text())
    assert kept == {"ms-x": {PEERS[0]: first}} and pow_ok("ms-x", PEERS[0], first, 10)
    assert load_or_mint_pow(tmp_path, "ms-x", PEERS[0], 10) == first
    bad = next(n for n in range(5000) if not pow_ok("ms-x", PEERS[0], n, 10))
    (tmp_path / POW_FILE).write_text(json.dumps({"ms-x": {PEERS[0]: bad}}))  # a proof that does not prove
    again = load_or_mint_pow(tmp_path, "ms-x", PEERS[0], 10)
    assert pow_ok("ms-x", PEERS[0], again, 10)


# --- the three rules ---------------------------------------------------------------------------


def test_open_admission_needs_a_valid_proof_except_from_the_owner() -> None:
    s = signed(pow_bits=10)
    rule = Admission(s)
    good = mint_pow(s.swarm_id, PEERS[0], 10)
    assert rule.admits(member(PEERS[0], **{POW_CAP: good}))
    assert rule.reason(PEERS[1], {POW_CAP: good}) == NO_PROOF  # someone else's proof
    assert rule.reason(PEERS[1], {}) == NO_PROOF
    assert rule.reason(OWNER.peer_id_str, {}) is None


def test_allowlist_admission_takes_the_signed_list_and_the_owner() -> None:
    s = signed(admission="allowlist", allowlist=(PEERS[0], PEERS[0]))
    assert s.spec.admission.allowlist == (PEERS[0],)  # duplicates dropped
    rule = Admission(s)
    assert rule.reason(PEERS[0], {}) is None and rule.reason(OWNER.peer_id_str, {}) is None
    assert rule.reason(PEERS[1], {POW_CAP: 0}) == NOT_ALLOWED  # a proof of work buys nothing here


def test_private_admission_admits_whoever_could_connect() -> None:
    assert Admission(signed(admission="private")).reason(PEERS[2], {}) is None


def test_spec_admission_fields_are_signed_and_checked(tmp_path) -> None:
    s = signed(admission="allowlist", allowlist=(PEERS[0],), pow_bits=0)
    back = SignedSpec.load(s.save(tmp_path / "swarm.json"))
    assert back.spec == s.spec and back.swarm_id == s.swarm_id
    other = signed(admission="allowlist", allowlist=(PEERS[1],), pow_bits=0)
    assert other.swarm_id != s.swarm_id  # the allowlist is part of what the id names
    with pytest.raises(ConfigError, match="is not a peer id"):
        signed(admission="allowlist", allowlist=("not-a-peer",))
    with pytest.raises(ConfigError, match="pow_bits"):
        signed(pow_bits=33)
    with pytest.raises(ConfigError, match="admission"):
        signed(admission="everyone")
    with pytest.raises(ConfigError, match="is not a peer id"):
        allow_key("12D3Koo-nope")


# --- joining forms and the default bootstrap list ------------------------------------------------


def test_join_takes_a_multiaddr_a_pinned_multiaddr_an_id_or_a_name() -> None:
    addr = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEERS[0]}"
    sid = "ms" + "0123456789abcdef0123"
    assert parse_join_address(addr).addr == addr and parse_join_address(addr).swarm_id is None
    assert parse_join_address(f"{sid}@{addr}").swarm_id == sid
    by_id = parse_join_address(sid)
    assert by_id.addr is None and by_id.wanted == sid
    by_name = parse_join_address("llama-public")
    assert by_name.addr is None and by_name.name == "llama-public" and by_name.wanted == "llama-public"
    for bad in ("", "x" * 65, "a@b", "/ip4/1.2.3.4/tcp/1", "ms12@" + addr):
        with pytest.raises(ConfigError):
            parse_join_address(bad)


def test_swarm_list_without_a_bootstrap_address_says_where_to_put_one(capsys, monkeypatch) -> None:
    monkeypatch.delenv("MESHTRAIN_BOOTSTRAP", raising=False)
    assert main(["swarm", "list"]) == 2
    assert "pass --bootstrap" in capsys.readouterr().err


def test_the_shipped_bootstrap_list_is_empty_and_says_how_to_fill_it() -> None:
    text = DEFAULT_CONFIG_FILE.read_text()
    assert "bootstrap = []" in text and "/p2p/12D3KooW..." in text  # an example, commented out
    assert all(line.lstrip().startswith("#") for line in text.splitlines() if "/p2p/" in line)
    assert load_node_config(environ={}).bootstrap == []
    assert load_node_config(environ={"MESHTRAIN_BOOTSTRAP": f"/ip4/127.0.0.1/tcp/1/p2p/{PEERS[0]}"}).bootstrap


# --- verifying the swarm index ------------------------------------------------------------------


def advert(s: SignedSpec, advertiser: str, *, peers: int = 2, step: int = 10, proof: object = None, **over):
    spec = s.to_wire() | over.pop("doc", {})
    addr = f"/ip4/127.0.0.1/tcp/4001/p2p/{advertiser}"
    return SwarmAdvert(over.pop("swarm_id", s.swarm_id), spec, peers, step, (addr,), proof, advertiser, 1e12)


def test_only_adverts_the_owner_signed_and_admitted_peers_made_are_listed() -> None:
    real = signed(name="real", pow_bits=8)
    owner = OWNER.peer_id_str
    tampered = real.to_wire()
    tampered["spec"] = {**tampered["spec"], "name": "real-but-bigger"}
    impostor = SignedSpec.create(SwarmSpec(model="gpt-tiny", name="real"), Identity.generate())
    proof = mint_pow(real.swarm_id, PEERS[1], 8)
    bad_proof = next(n for n in range(1000) if not pow_ok(real.swarm_id, PEERS[2], n, 8))
    listed = verify_adverts(
        [
            advert(real, owner, peers=3, step=40),
            advert(real, PEERS[0], doc=tampered),  # spec changed after signing
            advert(impostor, PEERS[0], swarm_id=real.swarm_id),  # another spec under the real id
            advert(real, PEERS[2], peers=10**6, proof=bad_proof),  # no valid proof of work
            advert(real, PEERS[1], peers=10**6, step=10**9, proof=proof),  # admitted, but lies
            advert(signed(name="closed", admission="private"), owner),  # private: never listed
        ]
    )
    assert [s.swarm_id for s in listed] == [real.swarm_id]
    (s,) = listed
    assert (s.name, s.peers, s.step, s.advertisers) == ("real", 3, 40, 2)  # the owner's numbers
    assert s.addrs[0].endswith(owner)
    assert pick_swarm(listed, "real") is s and pick_swarm(listed, real.swarm_id) is s
    table = format_table(listed)
    assert real.swarm_id in table and "open/pow8" in table and "40/2000" in table


def test_without_the_owner_the_median_report_counts_and_names_must_be_unique() -> None:
    real = signed(name="twin", pow_bits=0)
    listed = verify_adverts([advert(real, p, peers=n, step=n) for p, n in zip(PEERS[:3], (4, 5, 10**6), strict=True)])
    assert (listed[0].peers, listed[0].step) == (5, 5)
    twin = SignedSpec.create(SwarmSpec(model="gpt-tiny", name="twin", pow_bits=0), Identity.generate())
    both = verify_adverts([advert(real, PEERS[0]), advert(twin, PEERS[1])])
    with pytest.raises(ConfigError, match="2 swarms are named 'twin'"):
        pick_swarm(both, "twin")
    with pytest.raises(ConfigError, match="no swarm 'nope'"):
        pick_swarm(both, "nope")
    assert format_table([]) == "no swarms found"


def test_the_list_shows_how_many_peers_a_swarm_excludes_by_the_advertisers_median() -> None:
    real = signed(name="struck", pow_bits=0)
    reports = [dataclasses.replace(advert(real, p), excluded=n) for p, n in zip(PEERS[:3], (1, 2, 10**6), strict=True)]
    (s,) = verify_adverts(reports)
    assert s.excluded == 2  # one advertiser's inflated count moves nothing
    header, row = format_table([s]).splitlines()
    assert header.split()[7] == "EXCLUDED" and row.split()[6] == "2"  # "SWARM ID" is two words


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=30) | st.binary(max_size=30),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=12,
)
ADVERT_LIKE = st.fixed_dictionaries(
    {},
    optional={
        "swarm": st.sampled_from(["ms0123456789abcdef0123", ""]) | JUNK,
        "spec": st.just(signed(name="real").to_wire()) | st.dictionaries(st.text(max_size=12), JUNK, max_size=5),
        "peers": JUNK,
        "step": JUNK,
        "addrs": st.lists(st.sampled_from([f"/ip4/127.0.0.1/tcp/1/p2p/{p}" for p in PEERS]) | JUNK, max_size=3),
        "proof": JUNK,
    },
)


@settings(max_examples=60, deadline=None)
@given(value=ADVERT_LIKE | JUNK, subkey_swarm=st.sampled_from(["ms0123456789abcdef0123", "x"]))
def test_any_advert_record_is_parsed_or_dropped_never_raised(value: object, subkey_swarm: str) -> None:
    ident = Identity.from_seed(bytes([9]) * 32)
    rec = Record.create(ident, NETWORK, SWARMS_KEY, value, 1e12, advert_subkey(ident.peer_id_str, subkey_swarm))
    advert = SwarmAdvert.from_record(rec)
    listed = verify_adverts([advert] if advert is not None else [])
    assert all(s.swarm_id == advert.swarm_id for s in listed)  # only ever the swarm it names


# --- swarm create --private ---------------------------------------------------------------------


def test_swarm_create_private_writes_a_secret_key_and_a_private_spec(tmp_path, capsys) -> None:
    data = tmp_path / "owner"
    assert main(["swarm", "create", "--data-dir", str(data), "--model", "gpt-tiny", "--private"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    key_file = data / "swarm.key"
    assert out["admission"] == "private" and out["swarm_key_file"] == str(key_file)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_text().strip()) == 64
    assert SignedSpec.load(out["spec"]).spec.admission.mode == "private"
    assert main(["swarm", "create", "--data-dir", str(data), "--private", "--admission", "open"]) == 2
    assert "contradict" in capsys.readouterr().err


async def test_a_private_swarm_needs_its_key_and_the_flag_is_checked(tmp_path, capsys) -> None:
    from meshtrain import Node, NodeConfig

    private = signed(admission="private")
    config = NodeConfig(data_dir=tmp_path / "n", listen=["/ip4/127.0.0.1/tcp/0"], status_port=0, nat=False)
    with pytest.raises(ConfigError, match="is private: pass its key"):
        await Node(config, spec=private).run()
    assert main(["node", "start", "--data-dir", str(tmp_path / "n"), "--swarm-key", "not-hex"]) == 2
    assert "swarm_key: must be 64 hexadecimal characters" in capsys.readouterr().err


async def test_a_joiner_that_cannot_reach_a_private_swarm_is_told_the_key_may_be_why(tmp_path) -> None:
    """libp2p's private networks drop a handshake without the key, so to the joiner a private
    peer looks absent: what start-up says while it waits, and on giving up, names the key."""
    import os

    import trio

    from meshtrain.node.phase import NodeError
    from meshtrain.node.spec.resolve import SpecResolver
    from meshtrain.transport.host import Host, HostConfig

    said: list[str | None] = []

    class StopAfterTwoTries:
        tries = 0

        def is_set(self) -> bool:
            return self.tries >= 2

        async def sleep(self, seconds: float) -> None:  # sleep: the backoff, counted and not slept
            self.tries += 1

    key = os.urandom(32).hex()
    async with Host(Identity.generate(), HostConfig(swarm_key=key)) as private:
        for ours, hint in (
            (None, "without the swarm's key: --swarm-key"),
            (os.urandom(32).hex(), "is our --swarm-key"),
        ):
            config = NodeConfig(data_dir=tmp_path / "j", listen=["/ip4/127.0.0.1/tcp/0"], swarm_key=ours)
            resolver = SpecResolver(
                config,
                tmp_path / "j",
                spec=None,
                join=private.addrs[0],
                stop=StopAfterTwoTries(),
                on_waiting=said.append,
            )
            resolver.try_timeout = 2.0  # the dial may hang rather than fail: the other end ignores us
            async with Host(Identity.generate(), HostConfig(swarm_key=ours)) as joiner:
                with trio.fail_after(60), pytest.raises(NodeError, match=f"stopped before .* answered .*{hint}"):
                    await resolver.fetch(joiner, None, [private.addrs[0]])
            assert any(s is not None and hint in s for s in said), said
