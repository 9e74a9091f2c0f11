"""Public swarms on loopback: a swarm is listed in the DHT's swarm index and joined by
name; a stranger without a proof of work, or not on the owner's allowlist, is ignored by every
honest peer (no round, no state, no data plane; its records are not even stored); the owner admits a waiting peer at run time;
forged adverts and a forged allowlist entry change nothing.

Real `Node`s (gpt-tiny) and real hosts in one trio program; the strangers are bare hosts that
write their own membership records into the swarm's CRDTs, as a hostile peer would."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from meshtrain import Node, NodeConfig, SignedSpec, SwarmSpec
from meshtrain.crdt.swarm_view import open_swarm_view
from meshtrain.dht.kademlia import NETWORK, STORE_RPC, Dht
from meshtrain.dht.records import Record
from meshtrain.dht.swarm_index import SWARMS_KEY, advert_subkey, publish_advert
from meshtrain.node.cli import main
from meshtrain.node.spec.listing import find_swarms
from meshtrain.node.state.fetch import fetch_state
from meshtrain.node.state.sync import StateSyncError
from meshtrain.node.status.client import TOKEN_FILE, StatusError, request_allow
from meshtrain.node.trust.admission import NO_PROOF, NOT_ALLOWED, POW_CAP, allow_key, mint_pow, pow_ok
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity
from meshtrain.transport.tensor_streams import TensorStreams

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def config(tmp: Path, name: str, **more: object) -> NodeConfig:
    return NodeConfig(data_dir=tmp / name, listen=LOOPBACK, status_port=0, nat=False, **more)


async def until(check: Callable[[], bool], what: str, timeout: float = 45.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.1)  # sleep: poll interval
    assert check(), what


async def stranger(stack: AsyncExitStack, *peers: Node) -> tuple[Host, TensorStreams]:
    host = await stack.enter_async_context(Host(Identity.generate(), HostConfig(listen=LOOPBACK)))
    streams = await stack.enter_async_context(TensorStreams(host))
    for p in peers:
        assert p.host is not None
        await host.connect(p.host.addrs[0], timeout=10)
    return host, streams


def rounds_with(node: Node, contributors: int) -> int:
    assert node.trainer is not None
    return sum(r.contributors == contributors for r in node.trainer.outer.history)


@pytest.mark.slow
async def test_a_swarm_is_listed_and_joined_by_name(tmp_path, capsys) -> None:
    name = "public-" + secrets.token_hex(3)
    spec = SwarmSpec(model="gpt-tiny", name=name, steps=20, H=10, eval_every=0, pow_bits=8)
    signed = SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))
    a = Node(config(tmp_path, "a", wait_peers=2), spec=signed)
    results: dict[str, object] = {}
    async with trio.open_nursery() as nursery:

        async def run(key: str, node: Node) -> None:
            results[key] = await node.run()

        nursery.start_soon(run, "a", a)
        await until(lambda: a.view is not None, "a is up")
        assert a.host is not None
        entry = a.host.addrs[0]
        listed: list = []
        with trio.fail_after(30):
            while not listed:  # a's first advert goes out as its presence starts
                listed = [s for s in await find_swarms([entry]) if s.name == name]
        assert [s.swarm_id for s in listed] == [signed.swarm_id]
        assert listed[0].peers == 1 and listed[0].addrs[0].endswith(a.host.peer_id)
        # the CLI's table, from another thread (it runs its own trio loop)
        assert await trio.to_thread.run_sync(main, ["swarm", "list", "--bootstrap", entry]) == 0
        table = capsys.readouterr().out
        assert signed.swarm_id in table and name in table and "open/pow8" in table
        b = Node(config(tmp_path, "b", bootstrap=[entry], wait_peers=2), join=name)
        nursery.start_soon(run, "b", b)
    assert b.signed is not None and b.signed.swarm_id == signed.swarm_id
    assert results["a"].step == results["b"].step == 20  # type: ignore[attr-defined]
    assert rounds_with(a, 2) == 2 and rounds_with(b, 2) == 2


@pytest.mark.slow
async def test_an_outsider_without_proof_of_work_is_ignored_by_every_honest_peer(tmp_path) -> None:
    spec = SwarmSpec(model="gpt-tiny", steps=0, H=5, eval_every=0, pow_bits=12)
    signed = SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))
    a = Node(config(tmp_path, "a"), spec=signed)
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        nursery.start_soon(a.run)
        await until(lambda: a.view is not None, "a is up")
        assert a.host is not None
        b = Node(config(tmp_path, "b"), join=a.host.addrs[0])
        nursery.start_soon(b.run)
        await until(lambda: b.presence is not None and len(a.presence.trainers()) == 2, "b trains with a")
        honest = (a, b)
        outsider, outsider_streams = await stranger(stack, a, b)
        friend, _ = await stranger(stack, a, b)  # the control: a valid proof, so admitted
        bad = next(n for n in range(10_000) if not pow_ok(signed.swarm_id, outsider.peer_id, n, 12))
        good = mint_pow(signed.swarm_id, friend.peer_id, 12)
        outsider_view = await stack.enter_async_context(
            open_swarm_view(outsider, signed.swarm_id, signed.owner, role="trainer", capabilities={POW_CAP: bad})
        )
        outsider_view.report_progress(step=10**9, outer_round=10**6)  # written at once (a round change)
        outsider_view.report_metrics({"loss": 0.0})
        await stack.enter_async_context(
            open_swarm_view(friend, signed.swarm_id, signed.owner, role="syncing", capabilities={POW_CAP: good})
        )
        for node in honest:
            await until(lambda node=node: outsider.peer_id in node.presence.ignored(), "the outsider's record arrives")
            await until(lambda node=node: node.view.is_live(friend.peer_id), "the friend's record arrives")
        rounds_before = a.trainer.outer.rounds
        for node in honest:
            p = node.presence
            assert outsider.peer_id not in p.trainers() + p.candidates() + list(p.training_peers(connected=False))
            assert not await node.streams.admits(outsider.peer_id)  # no data-plane session
            assert await node.streams.admits(friend.peer_id)
            assert outsider.peer_id in node.snapshot()["node"]["admission"]["ignored"]
            # ... and its records are not even stored (so not spread): refused, counted
            await until(lambda node=node: node.round_status()["refused"].get("crdt-not-a-member"), "refused")
            assert node.round_status()["refused"].get("crdt-not-admitted")
            for crdt in ("membership", "progress", "metrics"):
                assert node.view.replica.crdt(crdt).entry(outsider.peer_id) is None
            assert node.presence.not_admitted() is None
        assert a.presence.admission.reason(outsider.peer_id, {POW_CAP: bad}) == NO_PROOF
        with pytest.raises(StateSyncError):  # no donor serves it
            await fetch_state(outsider, outsider_streams, [a.host.peer_id, b.host.peer_id], timeout=10)
        # rounds go on between the two honest peers, the outsider never waited for
        await until(lambda: a.trainer.outer.rounds >= rounds_before + 2, "two more rounds")
        assert a.trainer.outer.history[-1].contributors == 2
        a.stop()
        b.stop()


@pytest.mark.slow
async def test_the_owner_admits_a_waiting_peer_at_run_time_and_a_forged_entry_does_nothing(tmp_path, capsys) -> None:
    spec = SwarmSpec(model="gpt-tiny", steps=0, H=5, eval_every=0, admission="allowlist")
    signed = SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))
    a = Node(config(tmp_path, "a"), spec=signed)
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        nursery.start_soon(a.run)
        await until(lambda: a.view is not None and a.status_url is not None, "a is up")
        assert a.host is not None
        b = Node(config(tmp_path, "b"), join=a.host.addrs[0])
        nursery.start_soon(b.run)
        await until(lambda: b.presence is not None and b.presence.not_admitted() == NOT_ALLOWED, "b waits")
        b_id = b.host.peer_id
        await until(lambda: b_id in a.presence.ignored(), "a ignores b")
        await until(lambda: "meshtrain swarm allow" in (b.snapshot()["training"]["waiting"] or ""), "b says why")
        assert b_id not in a.presence.trainers() and not await a.streams.admits(b_id)
        assert await trio.to_thread.run_sync(main, ["node", "status", "--data-dir", str(b.data_dir)]) == 0
        assert "admission allowlist: NOT ADMITTED (not-on-allowlist)" in capsys.readouterr().out
        # A forger writes allow/<itself> and allow/<b> into a config CRDT of its own making: every
        # honest replica refuses entries the owner did not sign.
        forger, _ = await stranger(stack, a, b)
        fview = await stack.enter_async_context(
            open_swarm_view(forger, signed.swarm_id, forger.peer_id, role="trainer", recover_timeout=0.5)
        )
        fview.set_config({allow_key(forger.peer_id): True, allow_key(b_id): True})
        await until(lambda: forger.peer_id in a.presence.ignored(), "the forger's record arrives")
        await trio.sleep(2.0)  # sleep: gossip and an anti-entropy pull have had their chance (below: nothing got in)
        for node in (a, b):
            assert node.view.config_get(allow_key(b_id)) is None
            assert node.view.config_get(allow_key(forger.peer_id)) is None
        assert b.presence.not_admitted() == NOT_ALLOWED and b_id in a.presence.ignored()
        # Only the owner's node may allow: b's own node refuses (it is not the owner).
        b_token = (b.data_dir / TOKEN_FILE).read_text().strip()
        with pytest.raises(StatusError, match="403"):
            await trio.to_thread.run_sync(lambda: request_allow(b.status_url, b_token, b_id))
        # The owner runs `meshtrain swarm allow <b's peer id>`: the CLI finds its node's status
        # endpoint and control token through the data dir.
        allow = ["swarm", "allow", b_id, "--data-dir", str(a.data_dir)]
        assert await trio.to_thread.run_sync(main, allow) == 0
        await until(lambda: b.state == "training", "b is admitted and trains", 60)
        assert b_id in a.presence.trainers() and b_id not in a.presence.ignored()
        # b joined with the swarm's state: it sits out its first JOIN_WARMUP_STEPS (optim/outer.py)
        # at weight 0, then contributes
        await until(lambda: a.trainer.outer.history[-1].contributors == 2, "a round b contributes to", 60)
        assert forger.peer_id in a.presence.ignored()
        a.stop()
        b.stop()


async def test_forged_swarm_adverts_change_nothing(tmp_path) -> None:
    owner = Identity.generate()
    signed = SignedSpec.create(SwarmSpec(model="gpt-tiny", name="real", pow_bits=8), owner)
    sid = signed.swarm_id
    async with AsyncExitStack() as stack:
        owner_host = await stack.enter_async_context(Host(owner, HostConfig(listen=LOOPBACK)))
        owner_dht = await stack.enter_async_context(Dht(owner_host))
        liar = await stack.enter_async_context(Host(Identity.generate(), HostConfig(listen=LOOPBACK)))
        liar_dht = await stack.enter_async_context(Dht(liar))
        await liar_dht.bootstrap([owner_host.addrs[0]])
        await publish_advert(owner_dht, swarm_id=sid, spec=signed.to_wire(), peers=3, step=40)

        async def forge(spec_doc: dict, *, swarm: str = sid, proof: str = "none") -> None:
            """One advert signed by a fresh identity (one advert per advertiser and swarm), with
            no proof of work, a bad one, or a valid one ("mint"); its numbers are lies."""
            ident = Identity.generate()
            me = ident.peer_id_str
            nonce = {
                "none": None,
                "bad": next(n for n in range(10_000) if not pow_ok(sid, me, n, 8)),
                "mint": mint_pow(sid, me, 8),
            }[proof]
            value = {"swarm": swarm, "spec": spec_doc, "peers": 10**6, "step": 10**9, "addrs": [], "proof": nonce}
            await liar_dht.store_record(
                Record.create(ident, NETWORK, SWARMS_KEY, value, _soon(), advert_subkey(me, swarm))
            )

        tampered = signed.to_wire()
        tampered["spec"] = {**tampered["spec"], "name": "real-but-better"}
        await forge(tampered)  # the spec changed after the owner signed it
        impostor = SignedSpec.create(SwarmSpec(model="gpt-tiny", name="real", pow_bits=8), liar.identity)
        await forge(impostor.to_wire())  # another owner's spec under the real swarm's id
        await forge(signed.to_wire())  # no proof of work
        await forge(signed.to_wire(), proof="bad")  # a proof that does not prove
        await forge(signed.to_wire(), proof="mint")  # admitted, but its numbers are lies
        # records the DHT itself refuses: one claiming the owner's subkey, one with a broken signature
        value = {"swarm": sid, "spec": signed.to_wire(), "peers": 1, "step": 1, "addrs": [], "proof": None}
        stolen = Record.create(
            liar.identity, NETWORK, SWARMS_KEY, value, _soon(), advert_subkey(owner.peer_id_str, sid)
        )
        broken = dataclasses.replace(
            Record.create(liar.identity, NETWORK, SWARMS_KEY, value, _soon(), advert_subkey(liar.peer_id, sid)),
            signature=bytes(64),
        )
        reply = await liar.rpc.call(
            owner_host.peer_id,
            STORE_RPC,
            {"swarm": NETWORK, "key": SWARMS_KEY, "records": [stolen.to_wire(), broken.to_wire()]},
            timeout=5,
        )
        assert reply["results"] == ["not_owner", "forged"]
        listed = await find_swarms([owner_host.addrs[0]])
        assert [(s.swarm_id, s.name, s.peers, s.step) for s in listed] == [(sid, "real", 3, 40)]
        assert listed[0].advertisers == 2  # the owner, and the admitted liar whose numbers are not used
        assert listed[0].addrs[0].endswith(owner.peer_id_str)


def _soon() -> float:
    return time.time() + 60
