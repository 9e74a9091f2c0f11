"""Which swarm a starting node runs: the spec it was given, the one a peer it joins through
serves, or the one its data dir holds — checked against this machine and kept in the data dir.

The problem. `node start` may be handed a signed spec (`--swarm`, `swarm create`), an address to
join (`<multiaddr>`, `<swarm id>@<multiaddr>`), a swarm id or name to look up, or nothing (run
the data dir's `swarm.json` again). Whatever the source, the node must end up with one verified
`SignedSpec` before it builds anything that depends on it, and must not overwrite a data dir that
holds another swarm's checkpoints.

Design. `SpecResolver.resolve(host)`, once, early in start-up:
- a spec given: taken as is;
- a join target: a swarm id or name is first looked up in the DHT's swarm index through
  `config.bootstrap` (node/spec/listing.py); then the spec is fetched over `SPEC_RPC` from the
  entry addresses, tried in turn, and checked against a pinned swarm id (`SignedSpec.from_wire`);
- neither: `data_dir/swarm.json`.
Then: a private swarm needs its key; the local copies of the model and tokenizer files and a `py:`
outer optimizer must be the swarm's (their digests are in the spec); a data dir of another swarm
with checkpoints is refused (node/spec/data_dir.py); the spec is saved as `swarm.json`. `serve` answers other peers'
`SPEC_RPC` with it from then on.

Failures. An entry peer that cannot be reached, or whose spec RPC is not up yet (starting,
restarting, a loaded machine), is a transient: asked again with a backoff, saying so (the node's
`startup_waiting`), until a stop. One that does not connect at all may also be a private swarm's
peer dropping our handshake (no key, or another): the waiting line and the error at a stop say so
(`unreached_hint`). A peer that answers with anything but a valid spec, or still
serves none after `SPEC_ATTEMPTS` tries once connected, is not a meshtrain node of that swarm:
`NodeError`. Bad input (a private swarm's spec without its key, a foreign data dir) is a
`ConfigError` naming the fix.

Not here: verifying the spec's signature and swarm id (node/spec/signed.py), building anything
from it (node/daemon.py composes the services).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from meshtrain.backoff import Backoff
from meshtrain.dht.records import DhtError
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.models.sources import check_local_copy
from meshtrain.node.phase import NodeError
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.spec.data_dir import SPEC_FILE, claim_data_dir
from meshtrain.node.spec.outer import check_copy as check_outer_copy
from meshtrain.node.spec.signed import SPEC_RPC, JoinTarget, SignedSpec, SpecError, parse_join_address
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcProtocolError, RpcUnavailable

log = get_logger(__name__)

SPEC_ATTEMPTS = 5  # a connected peer that serves no spec this many times over is not a meshtrain node
SPEC_TRY_TIMEOUT = 15.0  # seconds for one try's connect, and for its spec RPC


class Stop(Protocol):
    """What the resolver needs of the node's stop request: wait for it, or see it was made."""

    def is_set(self) -> bool: ...

    async def sleep(self, seconds: float) -> None: ...


class SpecResolver:
    """Resolves the node's `SignedSpec` once (`resolve`), then serves it (`serve`). `join`: the
    `swarm join` argument, or None; `on_waiting(what)` hears what start-up waits for (None: nothing)."""

    def __init__(
        self,
        config: NodeConfig,
        data_dir: Path,
        *,
        spec: SignedSpec | None,
        join: str | None,
        stop: Stop,
        on_waiting: Callable[[str | None], None],
    ) -> None:
        self.config = config
        self.data_dir = data_dir
        self.given = spec
        self.join_address: JoinTarget | None = parse_join_address(join) if join else None
        self.entry_addrs = [self.join_address.addr] if self.join_address and self.join_address.addr else []
        self.stop = stop
        self.on_waiting = on_waiting
        self.signed: SignedSpec | None = None
        self.try_timeout = SPEC_TRY_TIMEOUT

    async def resolve(self, host: Host) -> SignedSpec:
        """The swarm's spec, checked against this machine and saved in the data dir (module docstring)."""
        if self.given is not None:
            signed = self.given
        elif self.join_address is not None:
            if self.join_address.addr is None:
                self.join_address = await self.find_swarm(self.join_address)
            signed = await self.fetch(host, self.join_address.swarm_id, self.entry_addrs)
        else:
            path = self.data_dir / SPEC_FILE
            if not path.exists():
                raise NodeError(
                    f"no swarm to run: {path} does not exist. Create a swarm (`meshtrain swarm "
                    f"create`) or join one (`meshtrain swarm join <multiaddr>`)"
                )
            signed = SignedSpec.load(path)
        spec = signed.spec
        if spec.admission.mode == "private" and self.config.swarm_key is None:
            raise ConfigError(
                f"swarm {signed.swarm_id} is private: pass its key (--swarm-key, or MESHTRAIN_SWARM_KEY; "
                f"`swarm create --private` wrote it to the creator's data dir)"
            )

        # Our copy of the model, tokenizer and py: optimizer files must be the swarm's: hashed in a
        # worker thread (a model of many GB takes seconds) while the node stays live.
        def check_copies() -> None:
            check_local_copy(
                spec.model.source,
                spec.model.tokenizer,
                model_pin=spec.model.digest,
                tokenizer_pin=spec.model.tokenizer_digest,
            )
            check_outer_copy(spec)

        await trio.to_thread.run_sync(check_copies)
        claim_data_dir(self.data_dir, signed.swarm_id)
        signed.save(self.data_dir / SPEC_FILE)
        self.signed = signed
        return signed

    async def serve(self, peer: str, req: Any) -> dict:
        """`SPEC_RPC`: our spec, to a peer that joins through us (served only once resolved)."""
        assert self.signed is not None
        return self.signed.to_wire()

    async def fetch(self, host: Host, want: str | None, addrs: list[str]) -> SignedSpec:
        """The signed spec from a peer we join through (`addrs`: the entry addresses, tried in
        turn; one from `join`, or those the swarm index lists). Transients are retried with a
        backoff; a peer that is not a meshtrain node of the swarm is a `NodeError` (module docstring)."""
        backoff = Backoff(initial=2.0, cap=30.0)
        unavailable = attempt = 0
        error: MeshtrainError
        unreached = False  # the last try did not connect at all (not a peer that serves no spec yet)
        try:
            while True:
                addr = addrs[attempt % len(addrs)]
                attempt += 1
                try:
                    peer = await host.connect(addr, timeout=self.try_timeout)
                    reply = await host.rpc.call(peer, SPEC_RPC, {}, timeout=self.try_timeout)
                    return SignedSpec.from_wire(reply, expect_id=want)
                except (RemoteError, RpcProtocolError) as e:
                    raise NodeError(f"{addr} did not send a swarm spec ({e}); is it a meshtrain node?") from None
                except SpecError as e:
                    raise NodeError(f"{addr}: {e}") from None
                except RpcUnavailable as e:
                    unavailable += 1
                    if unavailable >= SPEC_ATTEMPTS:
                        raise NodeError(f"{addr} serves no swarm spec ({e}); is it a meshtrain node?") from None
                    error, unreached = e, False
                except MeshtrainError as e:  # cannot connect, a timeout: the peer may come back
                    error, unreached = e, True
                delay = backoff.next()
                log.warning(
                    kv(
                        "cannot get the swarm spec from the peer to join through; retrying (Ctrl-C to give up)",
                        addr=addr,
                        error=str(error)[:200],
                        retry_in_s=round(delay, 1),
                    )
                )
                why = f" ({self.unreached_hint()})" if unreached else ""
                self.on_waiting(f"joining: waiting for {addr} to answer{why}")
                await self.stop.sleep(delay)
                if self.stop.is_set():
                    raise NodeError(f"stopped before {addr} answered{why}")
        finally:
            self.on_waiting(None)

    def unreached_hint(self) -> str:
        """Why a peer to join through may not connect: with libp2p's private networks a wrong or
        missing swarm key looks to the dialler like a peer that is not there (the other end
        drops the handshake), so the hint names both."""
        if self.config.swarm_key is None:
            return (
                "is it running and reachable from here? A private swarm's peers also refuse a node "
                "without the swarm's key: --swarm-key or MESHTRAIN_SWARM_KEY"
            )
        return "is it running and reachable from here, and is our --swarm-key that swarm's key?"

    async def find_swarm(self, target: JoinTarget) -> JoinTarget:
        """Look a swarm id or name up in the DHT's swarm index (through `config.bootstrap`)."""
        from meshtrain.node.spec.listing import find_swarms, pick_swarm

        self.on_waiting(f"looking up swarm {target.wanted!r} in the DHT's swarm index")
        try:
            found = pick_swarm(await find_swarms(self.config.bootstrap), target.wanted)
        except DhtError as e:
            raise NodeError(f"cannot look up swarm {target.wanted!r}: {e}") from None
        if not found.addrs:
            raise NodeError(f"swarm {found.swarm_id} is listed without an address to join through")
        self.on_waiting(None)
        log.warning(kv("found the swarm", swarm=found.swarm_id, name=found.name, entry=found.addrs[0]))
        self.entry_addrs = list(found.addrs)
        return JoinTarget(found.swarm_id, found.addrs[0])
