"""Admission: which peers of a swarm count, by the rule its owner signed into the spec.

Problem. Anyone can reach a public swarm, write a membership record into its CRDTs (signed by a
key they made a moment ago) and so become a round candidate, a state donor's client and a
data-plane peer. Peer ids cost nothing, so one stranger can be a thousand.

Design. The spec (`SwarmSpec.admission`, signed by the owner, part of the swarm id) names one of
three rules, and every honest peer applies it on its own to every membership record it holds
(`SwarmView.admit`, set by `PeerPresence`): a record that fails is ignored — not a trainer, not
a round candidate, not a donor or a donor's client, not on the data plane (`is_member`). No
peer decides for another; all decide alike because the inputs (the spec, the records, the
owner's config CRDT) are replicated. The rule (`base_reason`, strikes aside) also decides what
is stored at all (`SwarmView.keep`, set by `PeerPresence`): a membership record that fails it,
and the progress, metrics and strikes records of a peer without a membership record that passes
it, are refused by the CRDT replica — neither kept nor spread — so identities minted for free
cost honest peers no memory (crdt/swarm_view.py; counted as `crdt-not-admitted` and
`crdt-not-a-member` in the status document's `refused`).
- **open**: anyone who shows a proof of work on its peer id. The proof is a nonce such that
  `blake3(POW_DOMAIN + msgpack([swarm id, peer id]) + nonce as 8 bytes big-endian)` starts with
  `spec.admission.pow_bits` zero bits; it rides in the membership record's capabilities under `"pow"`.
  Bound to the swarm and the peer id, it cannot be reused for another identity or swarm, so
  n identities cost n times one (about 2**pow_bits hashes each); checking it is one hash
  (cached per peer and nonce). A node mints its own once and keeps it in `admission.json` in its
  data dir (`load_or_mint_pow`).
- **allowlist**: the owner, the peer ids in the spec's `allowlist`, and the peer ids the owner
  allows at run time: config CRDT keys `allow/<peer id>` → true (false revokes). Only the
  owner's key may write the config CRDT (`swarm_specs` sets its writers), so an entry that any
  other key signed is refused on every peer before it is merged. This is the config CRDT's first
  reader. `meshtrain swarm allow <peer id>` asks the owner's running node to write one
  (`POST /allow` on its status endpoint, with its control token). The owner's config is one
  CRDT entry of at most 48 KiB (`replica.MAX_ENTRY_BYTES`), so some 600 peers can be allowed at
  run time; a larger run lists its peers in the spec.
- **private**: the libp2p swarm key (pnet): a host without it cannot even connect, so every
  peer that reaches us holds the key and is admitted.
The owner is always admitted by the rule. **Strikes** come on top of every rule (against
admitted peers that lie about their updates, node/trust/strikes.py): a peer struck out by the
swarm's verified strikes is refused like one that fails the rule (`EXCLUDED`), the owner too.

Failures. A peer that fails admission is ignored, not told: its own node sees that it is not
admitted (`Admission.reason` for its own record) and waits, saying why (`Node`). Only its own
replica holds its records meanwhile; once the owner allows it, the others take them at its next
heartbeat or anti-entropy exchange. A run-time revocation stops counting a peer at once; what it
wrote before stays stored, what it writes after is refused. A peer excluded by strikes stays
stored (it paid for admission; the rule for storage leaves strikes out, as their verdicts may
differ between peers while they spread, and storage must not split the replicas for long).

Not here: what admission does not prevent (docs/guide.md, "Public swarms": a patient attacker who pays
for many identities, a majority of colluding admitted peers, lies about work — verifying work is
screening, loss scoring, spot-checks and strikes), the swarm key itself (`transport/host.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import blake3

from meshtrain.crdt.swarm_view import PeerInfo, SwarmView
from meshtrain.log import get_logger, kv
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.trust.strikes import StrikeBook
from meshtrain.transport.framing import packb
from meshtrain.transport.identity import IdentityError, public_key_of
from meshtrain.transport.validate import is_int

log = get_logger(__name__)

POW_DOMAIN = b"meshtrain/admission-pow/v1\x00"
POW_CAP = "pow"  # the membership capability that carries the proof-of-work nonce
ALLOW_PREFIX = "allow/"  # the owner's config CRDT: allow/<peer id> -> True (admitted) | False (revoked)
POW_FILE = "admission.json"  # a node's minted proof, kept across restarts
NONCE_MAX = (1 << 64) - 1
MAX_CACHED_PROOFS = 8192

NO_PROOF = "no-proof-of-work"
NOT_ALLOWED = "not-on-allowlist"
EXCLUDED = "excluded-by-strikes"


def _pow_hasher(swarm_id: str, peer_id: str) -> Any:
    return blake3.blake3(POW_DOMAIN + packb([swarm_id, peer_id]))


def _leading_zeros_ok(digest8: bytes, bits: int) -> bool:
    return bits == 0 or int.from_bytes(digest8, "big") >> (64 - bits) == 0


def pow_ok(swarm_id: str, peer_id: str, nonce: Any, bits: int) -> bool:
    """Whether `nonce` is a proof of `bits` leading zero bits for `peer_id` in `swarm_id`."""
    if bits == 0:
        return True
    if not is_int(nonce) or not 0 <= nonce <= NONCE_MAX:
        return False
    h = _pow_hasher(swarm_id, peer_id)
    h.update(nonce.to_bytes(8, "big"))
    return _leading_zeros_ok(h.digest(8), bits)


def mint_pow(swarm_id: str, peer_id: str, bits: int, *, start: int = 0) -> int:
    """The first nonce from `start` that proves `bits` bits for `peer_id` (about 2**bits tries)."""
    if bits == 0:
        return 0
    base = _pow_hasher(swarm_id, peer_id)
    nonce = start
    while True:
        h = base.copy()
        h.update(nonce.to_bytes(8, "big"))
        if _leading_zeros_ok(h.digest(8), bits):
            return nonce
        nonce += 1


def load_or_mint_pow(data_dir: str | os.PathLike[str], swarm_id: str, peer_id: str, bits: int) -> int:
    """Our proof for this swarm: the one kept in `data_dir/admission.json` if it still proves
    `bits` bits for this swarm and peer, else a new one (minted here, then kept)."""
    path = Path(data_dir) / POW_FILE
    try:
        kept = json.loads(path.read_text())
        nonce = kept.get(swarm_id, {}).get(peer_id) if isinstance(kept, dict) else None
    except (OSError, ValueError, AttributeError):
        kept, nonce = {}, None
    if nonce is not None and pow_ok(swarm_id, peer_id, nonce, bits):
        return int(nonce)
    nonce = mint_pow(swarm_id, peer_id, bits)
    from meshtrain.durable import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({swarm_id: {peer_id: nonce}}).encode())
    return nonce


def allow_key(peer_id: str) -> str:
    """The owner's config CRDT key that admits `peer_id` in an allowlist swarm."""
    try:
        public_key_of(peer_id)
    except IdentityError:
        from meshtrain.errors import ConfigError

        raise ConfigError(f"{peer_id!r:.70} is not a peer id (12D3KooW...)") from None
    return ALLOW_PREFIX + peer_id


class Admission:
    """The swarm's admission rule, applied to membership records. `admits(peer)` is the filter
    `PeerPresence` hands the swarm view; `reason(peer id, capabilities)` says why a peer is not
    admitted (None: it is). `view` (set once the view exists) supplies the owner's run-time
    allowlist; until then only the spec's allowlist counts. `strikes` (set with the view) adds
    the swarm's verdicts: an excluded peer is refused too."""

    def __init__(self, signed: SignedSpec) -> None:
        self.signed = signed
        self.swarm_id = signed.swarm_id
        self.mode = signed.spec.admission.mode
        self.bits = signed.spec.admission.pow_bits
        self.allowlist = frozenset(signed.spec.admission.allowlist)
        self.view: SwarmView | None = None
        self.strikes: StrikeBook | None = None
        self._proofs: dict[tuple[str, Any], bool] = {}

    def admits(self, peer: PeerInfo) -> bool:
        return self.reason(peer.peer_id, peer.capabilities) is None

    def reason(self, peer_id: str, capabilities: dict[str, Any]) -> str | None:
        """Why the peer with this membership record is not admitted; None if it is."""
        if self.strikes is not None and self.strikes.excluded(peer_id):
            return EXCLUDED
        return self.base_reason(peer_id, capabilities)

    def admits_reporter(self, peer_id: str, capabilities: dict[str, Any]) -> bool:
        """Whether a strikes reporter passes the rule, strikes aside (node/trust/strikes.py): by the
        capabilities its strikes record carries, or by its membership record."""
        if self.base_reason(peer_id, capabilities) is None:
            return True
        records = self.view.records() if self.view is not None else []
        return any(p.peer_id == peer_id and self.base_reason(p.peer_id, p.capabilities) is None for p in records)

    def base_reason(self, peer_id: str, capabilities: dict[str, Any]) -> str | None:
        """The rule alone: why this membership record fails it (None: it passes)."""
        if peer_id == self.signed.owner or self.mode == "private":
            return None
        if self.mode == "open":
            return None if self._proof_ok(peer_id, capabilities.get(POW_CAP)) else NO_PROOF
        return None if self.allowed(peer_id) else NOT_ALLOWED

    def allowed(self, peer_id: str) -> bool:
        """Allowlist admission: in the signed spec, or allowed at run time by the owner."""
        if peer_id in self.allowlist:
            return True
        return self.view is not None and self.view.config_get(ALLOW_PREFIX + peer_id) is True

    def _proof_ok(self, peer_id: str, nonce: Any) -> bool:
        if self.bits == 0:
            return True
        key = (peer_id, nonce if is_int(nonce) else None)
        verdict = self._proofs.get(key)
        if verdict is None:
            if len(self._proofs) >= MAX_CACHED_PROOFS:
                self._proofs.clear()
            verdict = self._proofs[key] = pow_ok(self.swarm_id, peer_id, nonce, self.bits)
            if not verdict:
                log.info(kv("ignoring a peer without a valid proof of work", peer=peer_id[-12:]))
        return verdict
