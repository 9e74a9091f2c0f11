"""Whose swarm records a peer stores at all: the gate a `SwarmView` with a `keep` rule installs.

The problem: keep strangers honest. A swarm that admits peers (a proof of work, the owner's
allowlist: node/trust/admission.py) counts only admitted records (swarm_view.py, "Admission"). That
is not enough: identities are free, so a stranger could sign records with as many as it likes and
every member would store and spread them.

Design. With a `keep` rule (the admission rule without verdicts that come and go, such as
strikes), the view installs a `RecordGate` on the replica it is built over (`Replica.install_gate`,
replica.py; `check` reads that replica's CRDTs and returns None to store an entry, or why not,
counted in the replica's stats by reason): a membership record that fails `keep` is refused
(`REFUSED_NOT_ADMITTED`), and so is a progress, metrics or strikes record whose owner holds no
membership record that passes it (`REFUSED_NOT_A_MEMBER`) — the records only members write; a
strikes record also passes on the capabilities it carries (the reporter's proof: kept strikes
reload after a restart that left no membership record behind, crdt/strikes.py). Config has its own
rule (only the owner writes it). Our own records are never refused. `keep` must depend on
replicated state only.

A joiner's progress may reach a peer before its membership record: it is refused then (parked by
the replica) and taken when it comes again — with the owner's next write, or at the next
anti-entropy exchange with any peer that holds it (its owner always does; anti-entropy compares
digests, so a refused entry is offered again at every exchange, and the membership CRDT merges
before the others in every message). Likewise a record refused for want of the owner's run-time
allow (allowlist swarms) is taken once the allow has arrived. The last `MAX_REFUSED_SHOWN` refused
membership records (signed by their owners) are remembered, not replicated, so that the view's
`ignored_peers` still names who was turned away. Without `keep` (the default) there is no gate:
nothing is refused, and a refused peer's records are kept and replicated but never counted.

Failure: when `keep` turns a peer away for good after some peers stored a record of it (a run-time
revocation that reached them later), those peers keep it and the others keep refusing it; their
fingerprints of that CRDT differ for good, so each exchange between them sends digests and that one
entry again (bounded: one entry per such owner and CRDT).

Not here: the admission rule itself (node/trust/admission.py), who is counted (swarm_view.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshtrain.crdt.entries import SignedEntry, verify_entry
from meshtrain.crdt.replica import Replica
from meshtrain.crdt.strikes import record_of
from meshtrain.crdt.swarm_records import MEMBERSHIP, METRICS, PROGRESS, STRIKES, PeerInfo, peer_info

MAX_REFUSED_SHOWN = 32  # refused membership records remembered for `refused` (the view's `ignored_peers`)
REFUSED_NOT_ADMITTED = "crdt-not-admitted"  # a membership record that fails `keep`
REFUSED_NOT_A_MEMBER = "crdt-not-a-member"  # a member-only record of an owner without an admitted record
MEMBER_RECORDS = frozenset({PROGRESS, METRICS, STRIKES})  # CRDTs only members write


class RecordGate:
    """The gate over `replica` that stores what `keep(peer id, capabilities)` allows (module docstring)."""

    def __init__(self, replica: Replica, keep: Callable[[str, dict[str, Any]], bool]) -> None:
        self.replica = replica
        self.keep = keep
        self._refused: dict[str, PeerInfo] = {}  # the latest refused membership records, by owner

    def install(self) -> None:
        """Gate the replica's incoming entries from now on."""
        # A record refused for want of its owner's membership record is tried again once that arrives.
        self.replica.install_gate(self.check, park_reasons={REFUSED_NOT_A_MEMBER})

    def refused(self) -> list[PeerInfo]:
        """The latest `MAX_REFUSED_SHOWN` refused membership records signed by their owners, oldest first."""
        return list(self._refused.values())

    def check(self, name: str, entry: SignedEntry) -> str | None:
        """None to store `entry` of CRDT `name`, else why it is refused."""
        keep = self.keep
        if name == MEMBERSHIP:
            info = peer_info(entry)
            if keep(info.peer_id, info.capabilities):
                return None
            if verify_entry(self.replica.crdt(MEMBERSHIP).scope, entry):  # shown only if its owner signed it
                self._refused.pop(entry.owner, None)
                self._refused[entry.owner] = info
                if len(self._refused) > MAX_REFUSED_SHOWN:
                    del self._refused[next(iter(self._refused))]
            return REFUSED_NOT_ADMITTED
        if name in MEMBER_RECORDS:
            if name == STRIKES and keep(entry.owner, record_of(entry).capabilities):
                return None  # its own caps pass: kept strikes reload after a restart with no membership
            held = self.replica.crdt(MEMBERSHIP).entry(entry.owner)
            return None if held is not None and keep(held.owner, peer_info(held).capabilities) else REFUSED_NOT_A_MEMBER
        return None
