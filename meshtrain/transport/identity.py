"""A node's identity: one Ed25519 key pair, persisted, from which its libp2p peer id derives.

The same key signs everything the node says about itself (DHT records, CRDT entries, swarm specs),
so a peer id is all another peer needs to check a signature: Ed25519 peer ids inline the public key
(identity multihash), and `public_key_of` extracts it.

The private key is stored as its 32-byte seed in a file readable only by the owner (0600). A file
that is corrupt or readable by others is refused with `IdentityError` rather than silently replaced:
replacing it would give the node a new peer id and orphan everything signed with the old one.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from meshtrain.durable import write_atomic
from meshtrain.errors import MeshtrainError

KEY_FILE_NAME = "identity.key"
_MAGIC = b"meshtrain-ed25519-v1\n"
_SEED_BYTES = 32


class IdentityError(MeshtrainError):
    """The identity key file cannot be used (corrupt, wrong permissions, unreadable)."""


@dataclass(frozen=True, eq=False)
class Identity:
    """An Ed25519 key pair and the peer id it implies."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        if len(seed) != _SEED_BYTES:
            raise IdentityError(f"an Ed25519 seed is {_SEED_BYTES} bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, data_dir: str | os.PathLike[str]) -> Identity:
        """Load `data_dir/identity.key`, creating it (and `data_dir`) on first start."""
        path = Path(data_dir) / KEY_FILE_NAME
        if path.exists():
            return cls.load(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        identity = cls.generate()
        identity.save(path)
        return identity

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        path = Path(path)
        try:
            mode = path.stat().st_mode
            raw = path.read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read identity key {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(
                f"identity key {path} is accessible by other users (mode {stat.filemode(mode)}); run `chmod 600 {path}`"
            )
        if not raw.startswith(_MAGIC) or len(raw) != len(_MAGIC) + _SEED_BYTES:
            raise IdentityError(
                f"identity key {path} is corrupt; restore it from a backup, or delete it to start "
                "as a new peer (a new peer id)"
            )
        return cls.from_seed(raw[len(_MAGIC) :])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the seed atomically with mode 0600 (`write_atomic`: temp file, fsync, rename)."""
        write_atomic(Path(path), _MAGIC + self.seed, mode=0o600)

    @property
    def seed(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

        return self.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @cached_property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @cached_property
    def libp2p_key_pair(self) -> KeyPair:
        return create_new_key_pair(self.seed)

    @cached_property
    def peer_id(self) -> ID:
        return ID.from_pubkey(self.libp2p_key_pair.public_key)

    @cached_property
    def peer_id_str(self) -> str:
        return self.peer_id.to_base58()

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)


@functools.lru_cache(maxsize=8192)
def parse_peer_id(peer: str) -> ID:
    """`ID.from_base58`, cached: base58 in pure Python costs ~40 us, and the hot paths parse the
    same few peer ids again and again — a DHT lookup every id of every reply, the host every
    connection check (`Host.is_connected`: a round's liveness watch asks it for each partner, many
    times a second). ValueError for a string that is not a peer id (not cached)."""
    return ID.from_base58(peer)


def public_key_of(peer_id: str | ID) -> bytes:
    """The raw Ed25519 public key inlined in a peer id; `IdentityError` if it has none."""
    try:
        pid = peer_id if isinstance(peer_id, ID) else parse_peer_id(peer_id)
        key = pid.extract_public_key()
    except Exception:
        key = None
    if key is None or key.get_type().name != "Ed25519":
        raise IdentityError(f"peer id {peer_id!s:.60} does not carry an Ed25519 public key")
    return key.to_bytes()


def verify(peer_id: str | ID, message: bytes, signature: bytes) -> bool:
    """True if `signature` over `message` was made by the key behind `peer_id`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key_of(peer_id)).verify(signature, message)
    except (IdentityError, InvalidSignature, ValueError, TypeError):
        return False
    return True
