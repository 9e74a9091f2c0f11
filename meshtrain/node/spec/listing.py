"""Finding runs: the swarms the DHT's swarm index lists, verified, and picking one to join.

Problem. `meshtrain swarm list` and `meshtrain swarm join <swarm id | name>` start from nothing
but bootstrap addresses (the config's `bootstrap` list, or `--bootstrap`). The index
(`dht/swarm_index.py`) holds adverts that anyone may write; a reader must show only what the
swarms' owners signed.

Design. `find_swarms` starts a throwaway host (a fresh identity, loopback listener) and DHT,
bootstraps, reads the index and hands the adverts to `verify_adverts`, which keeps an advert
only if
- its spec document verifies (`SignedSpec.from_wire`: the owner's signature) and is the swarm
  the advert names (the swarm id is the digest of spec and owner);
- the swarm is not private (a private swarm's peers cannot be reached without its key);
- its advertiser is admitted by the spec's own rule, as far as a stranger can tell: the owner;
  for open swarms a valid proof of work; for allowlist swarms a peer in the signed allowlist
  (peers the owner allowed at run time are not known to a stranger, so their adverts are not
  counted).
The adverts of one swarm merge into one `ListedSwarm`: its peer count and step are the owner's
if the owner advertises, else the median of the advertisers' (a liar among them moves it
little) — so is the number of peers the swarm's strikes exclude (node/trust/strikes.py) — and its
entry addresses are every advertiser's, the owner's first.

`pick_swarm` resolves what the user typed: a swarm id, else a name; a name that several swarms
carry is an error that lists their ids (names are not unique: anyone can create a swarm with any
name, so joining by id is the unambiguous form).

Not here: the index record and its shape (`dht/swarm_index.py`), who advertises and when
(`node/presence.py`), admission inside a swarm (`node/trust/admission.py`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import trio

from meshtrain.dht.kademlia import Dht
from meshtrain.dht.records import DhtError
from meshtrain.dht.swarm_index import SwarmAdvert, read_adverts
from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv
from meshtrain.node.spec.signed import SignedSpec, SpecError
from meshtrain.node.trust.admission import POW_CAP, Admission
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity

log = get_logger(__name__)

LIST_TIMEOUT = 20.0  # seconds `find_swarms` may take (bootstrap + one lookup)
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"  # the throwaway host dials out; nobody needs to reach it


@dataclass(frozen=True)
class ListedSwarm:
    """One swarm as the index lists it, its spec verified."""

    signed: SignedSpec
    peers: int
    step: int
    addrs: tuple[str, ...]  # entry points: the advertisers' addresses, the owner's first
    advertisers: int
    excluded: int = 0  # peers the swarm's strikes exclude (node/trust/strikes.py)

    @property
    def swarm_id(self) -> str:
        return self.signed.swarm_id

    @property
    def name(self) -> str:
        return self.signed.spec.name


def verify_adverts(adverts: Sequence[SwarmAdvert]) -> list[ListedSwarm]:
    """The swarms whose adverts check out (module docstring), sorted by name then id."""
    good: dict[str, tuple[SignedSpec, list[SwarmAdvert]]] = {}
    for advert in adverts:
        try:
            signed = SignedSpec.from_wire(advert.spec, expect_id=advert.swarm_id)
        except SpecError as e:
            log.info(kv("ignoring a swarm advert", advertiser=advert.advertiser[-12:], error=str(e)))
            continue
        if signed.spec.admission.mode == "private":
            continue
        reason = Admission(signed).reason(advert.advertiser, {POW_CAP: advert.proof})
        if reason is not None:
            log.info(kv("ignoring a swarm advert", advertiser=advert.advertiser[-12:], reason=reason))
            continue
        good.setdefault(signed.swarm_id, (signed, []))[1].append(advert)
    out = []
    for signed, ads in good.values():
        ads.sort(key=lambda a: (a.advertiser != signed.owner, a.advertiser))
        counted = ads[:1] if ads[0].advertiser == signed.owner else ads
        peers = int(statistics.median_low([a.peers for a in counted]))
        step = int(statistics.median_low([a.step for a in counted]))
        excluded = int(statistics.median_low([a.excluded for a in counted]))
        addrs = tuple(dict.fromkeys(a for ad in ads for a in ad.addrs))
        out.append(ListedSwarm(signed, peers, step, addrs, len(ads), excluded))
    return sorted(out, key=lambda s: (s.name, s.swarm_id))


async def find_swarms(bootstrap: Sequence[str], *, timeout: float = LIST_TIMEOUT) -> list[ListedSwarm]:
    """The swarms the DHT reached through `bootstrap` lists. `ConfigError` without bootstrap
    addresses; `DhtError` if none answers."""
    if not bootstrap:
        raise ConfigError(
            "no bootstrap peer to ask: pass --bootstrap <multiaddr of any meshtrain node>, or put "
            "addresses in the `bootstrap` list of your node config (meshtrain ships none)"
        )
    async with AsyncExitStack() as stack:
        host = await stack.enter_async_context(Host(Identity.generate(), HostConfig(listen=[LOOPBACK_LISTEN])))
        dht = await stack.enter_async_context(Dht(host))
        with trio.move_on_after(timeout):
            await dht.bootstrap(bootstrap)
            return verify_adverts(await read_adverts(dht))
    raise DhtError(f"the DHT did not answer within {timeout:.0f} s (bootstrap {', '.join(bootstrap)[:200]})")


def pick_swarm(listed: Sequence[ListedSwarm], wanted: str) -> ListedSwarm:
    """The listed swarm whose id, else name, is `wanted`; `ConfigError` if none or several."""
    by_id = [s for s in listed if s.swarm_id == wanted]
    if by_id:
        return by_id[0]
    by_name = [s for s in listed if s.name == wanted]
    if len(by_name) == 1:
        return by_name[0]
    if by_name:
        ids = ", ".join(s.swarm_id for s in by_name)
        raise ConfigError(f"{len(by_name)} swarms are named {wanted!r} ({ids}): join one by its id")
    raise ConfigError(
        f"no swarm {wanted!r} in the swarm index ({len(listed)} listed; `meshtrain swarm list` shows them)"
    )


def format_table(listed: Sequence[ListedSwarm]) -> str:
    """The table `meshtrain swarm list` prints."""
    if not listed:
        return "no swarms found"
    rows = [("SWARM ID", "NAME", "MODEL", "OPTIMIZER", "ADMISSION", "PEERS", "EXCLUDED", "STEP", "OWNER")]
    for s in listed:
        spec = s.signed.spec
        admission = f"open/pow{spec.admission.pow_bits}" if spec.admission.mode == "open" else spec.admission.mode
        rows.append(
            (
                s.swarm_id,
                s.name,
                spec.model.source,
                spec.outer.optimizer,
                admission,
                str(s.peers),
                str(s.excluded),
                str(s.step) + (f"/{spec.steps}" if spec.steps else ""),
                "…" + s.signed.owner[-8:],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
