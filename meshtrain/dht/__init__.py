"""dht layer of meshtrain (see shared/ARCHITECTURE.md): signed, expiring records with subkeys,
merged on the storing node (`records`), Kademlia lookups over py-libp2p's routing table with
our own STORE/GET RPCs (`kademlia`), and swarm discovery under `/meshtrain/<swarm>/peers`
(`discovery`)."""

from meshtrain.dht.discovery import Announcement, Discovery, DiscoveryConfig, peers_key
from meshtrain.dht.kademlia import BootstrapError, Dht, DhtConfig
from meshtrain.dht.records import DhtError, InvalidRecord, Record, RecordLimits, RecordStore

__all__ = [
    "Announcement",
    "BootstrapError",
    "Dht",
    "DhtConfig",
    "DhtError",
    "Discovery",
    "DiscoveryConfig",
    "InvalidRecord",
    "Record",
    "RecordLimits",
    "RecordStore",
    "peers_key",
]
