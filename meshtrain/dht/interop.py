"""Records other libp2p stacks can read: a swarm's peer announcements as standard Kademlia values.

The problem. Our DHT's STORE and GET are meshtrain RPCs (kademlia.py: a storing node merges
every owner's subkey into one key, which kad's PUT_VALUE cannot). A go-libp2p or js-libp2p peer
speaks kad (`/ipfs/kad/1.0.0`) and can already find a swarm's peers through our nodes' routing
tables (FIND_NODE), but it cannot read one meshtrain record: what a peer is, where it listens,
which swarm it trains in.

Design. Each node also publishes its discovery announcement (discovery.py) as one standard kad
record, under a namespace of its own with its own validator — as IPNS does with `/ipns/`:
- **key** `/meshtrain/<swarm id>/peer/<peer id>` (UTF-8): one key per peer, so PUT_VALUE's
  one-value-per-key store needs no merge; namespace `meshtrain`.
- **value** a libp2p *signed envelope* (libp2p RFC 0002, the format of signed peer records,
  which go-libp2p's `record.ConsumeEnvelope` and js-libp2p's `RecordEnvelope.openAndCertify`
  open), signed with the peer's own identity key (the key its peer id is), domain `DOMAIN`,
  payload type `PAYLOAD_TYPE`, payload UTF-8 JSON:
  `{"key": <the key>, "seq": <ms, the writer's clock>, "expiry": <unix s>, "addrs": [multiaddr],
  "role": str, "version": str}`.
- **validation** (the same rule on every side; docs/interop.md gives it to other stacks): the
  value is at most `MAX_VALUE_BYTES`; the envelope's signature verifies for `DOMAIN`; its payload
  type is `PAYLOAD_TYPE`; the payload is that JSON object; its `key` is the record's key (no
  replay under another key); the signer's peer id is the key's last segment; `expiry` has not
  passed and is at most `MAX_TTL_S` + `CLOCK_SKEW_S` ahead (clock.py's one tolerance);
  at most `MAX_ADDRS` addresses, each naming that peer. **selection** among valid values: the
  highest `seq`, ties the first.

Wire: kad's own PUT_VALUE / GET_VALUE, served by py-libp2p's kad-dht with `InteropValidator` as
the `meshtrain` namespace's validator (kademlia.py registers it; every other namespace stays
refused). `Dht.put_interop` / `Dht.get_interop` are the calls.

Failures and limits. A record that does not validate is refused on PUT_VALUE and dropped on GET.
py-libp2p's value store keeps a record 24 h from receipt whatever its `expiry`, and serves it
until then: a reader's validator drops it once expired. That store caps at 50,000 records per
node (`MAX_VALUE_STORE_SIZE`): at `MAX_VALUE_BYTES` each, identities minted to flood one node
cost it at most ~100 MiB until they expire — the bound, not a defence. Not here: the swarm
index (swarm_index.py) and membership records stay ours only; a record's capabilities are not
published (they are msgpack, not JSON, and a swarm's business).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libp2p.crypto.keys import PrivateKey
from libp2p.peer.envelope import Envelope, make_unsigned, unmarshal_envelope
from libp2p.peer.id import ID
from libp2p.records.utils import InvalidRecordType
from libp2p.records.validator import Validator

from meshtrain.clock import CLOCK_SKEW_S
from meshtrain.transport.host import peer_id_of

NAMESPACE = "meshtrain"
DOMAIN = "meshtrain-record"  # the envelope's signing domain: a signature for nothing else
PAYLOAD_TYPE = b"/meshtrain/peer/1"
MAX_VALUE_BYTES = 2048
MAX_ADDRS = 4
MAX_TTL_S = 3600.0
MAX_LABEL_CHARS = 64
MAX_ADDR_CHARS = 256


class InvalidInteropRecord(InvalidRecordType):
    """A value that is not a valid meshtrain peer record for its key (py-libp2p's own type, so
    its kad handlers refuse it as they refuse any record their validator rejects)."""


def peer_key(swarm_id: str, peer: str) -> str:
    """The kad key of `peer`'s record in swarm `swarm_id`."""
    return f"/{NAMESPACE}/{swarm_id}/peer/{peer}"


@dataclass(frozen=True)
class PeerAnnouncement:
    """One peer's record as a kad value carries it (module docstring)."""

    key: str
    peer: str
    seq: int
    expiry: float
    addrs: tuple[str, ...]
    role: str
    version: str

    def payload(self) -> bytes:
        body = {
            "key": self.key,
            "seq": self.seq,
            "expiry": self.expiry,
            "addrs": list(self.addrs),
            "role": self.role,
            "version": self.version,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(
    private_key: PrivateKey, swarm_id: str, peer: str, addrs: Sequence[str], *, role: str, version: str, ttl: float
) -> bytes:
    """Our announcement as a signed envelope's bytes, valid for `ttl` seconds (at most `MAX_TTL_S`)."""
    now = time.time()
    record = PeerAnnouncement(
        peer_key(swarm_id, peer),
        peer,
        int(now * 1000),
        now + min(ttl, MAX_TTL_S),
        tuple(a for a in addrs if len(a) <= MAX_ADDR_CHARS)[:MAX_ADDRS],
        role[:MAX_LABEL_CHARS],
        version[:MAX_LABEL_CHARS],
    )
    payload = record.payload()
    signature = private_key.sign(make_unsigned(DOMAIN, PAYLOAD_TYPE, payload))
    return Envelope(private_key.get_public_key(), PAYLOAD_TYPE, payload, signature).marshal_envelope()


def open_record(key: str, value: bytes, *, now: float | None = None) -> PeerAnnouncement:
    """The announcement `value` carries for `key`; raises `InvalidInteropRecord` saying why not."""
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidInteropRecord(f"value of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
    parts = key.split("/")
    if len(parts) != 5 or parts[0] or parts[1] != NAMESPACE or parts[3] != "peer" or not parts[2]:
        raise InvalidInteropRecord(f"not a meshtrain peer key: {key[:120]!r}")
    try:
        envelope = unmarshal_envelope(value)
    except Exception as e:  # protobuf's and the key parser's errors alike: not an envelope
        raise InvalidInteropRecord(f"not a signed envelope: {type(e).__name__}") from None
    if envelope.payload_type != PAYLOAD_TYPE:
        raise InvalidInteropRecord("the envelope's payload type is not a meshtrain peer record")
    try:
        envelope.validate(DOMAIN)
    except Exception:
        raise InvalidInteropRecord("the envelope's signature does not verify") from None
    signer = ID.from_pubkey(envelope.public_key).to_base58()
    if signer != parts[4]:
        raise InvalidInteropRecord("signed by another peer than the key names")
    body = _json_object(envelope.raw_payload)
    record = _announcement(body, signer)
    if record.key != key:
        raise InvalidInteropRecord("the record was signed for another key")
    now = time.time() if now is None else now
    if record.expiry <= now:
        raise InvalidInteropRecord(f"expired {now - record.expiry:.0f} s ago")
    if record.expiry > now + MAX_TTL_S + CLOCK_SKEW_S:
        raise InvalidInteropRecord("expires too far ahead")
    return record


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise InvalidInteropRecord("the payload is not JSON") from None
    if not isinstance(body, dict) or set(body) != {"key", "seq", "expiry", "addrs", "role", "version"}:
        raise InvalidInteropRecord("the payload has exactly key, seq, expiry, addrs, role, version")
    return body


def _announcement(body: dict[str, Any], signer: str) -> PeerAnnouncement:
    key, seq, expiry, addrs = body["key"], body["seq"], body["expiry"], body["addrs"]
    role, version = body["role"], body["version"]
    if not isinstance(key, str) or not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise InvalidInteropRecord("key must be a string, seq a non-negative integer")
    if not isinstance(expiry, (int, float)) or isinstance(expiry, bool) or not math.isfinite(expiry):
        raise InvalidInteropRecord("expiry must be a finite number")
    if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS:
        raise InvalidInteropRecord(f"addrs must be a list of at most {MAX_ADDRS}")
    for a in addrs:
        try:
            ok = isinstance(a, str) and len(a) <= MAX_ADDR_CHARS and peer_id_of(a) == signer
        except Exception:  # not a multiaddr, or one without /p2p/
            ok = False
        if not ok:
            raise InvalidInteropRecord("every address is a multiaddr naming the signer (/p2p/<peer id>)")
    for label in (role, version):
        if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS:
            raise InvalidInteropRecord(f"role and version are strings of at most {MAX_LABEL_CHARS} characters")
    return PeerAnnouncement(key, signer, seq, float(expiry), tuple(addrs), role, version)


class InteropValidator(Validator):
    """The `meshtrain` namespace's validator for py-libp2p's kad-dht (module docstring)."""

    def validate(self, key: str, value: bytes) -> None:
        open_record(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        best, best_seq = 0, -1
        for i, value in enumerate(values):
            try:
                seq = open_record(key, value).seq
            except InvalidInteropRecord:
                continue
            if seq > best_seq:
                best, best_seq = i, seq
        return best
