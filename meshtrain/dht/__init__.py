"""dht layer of meshtrain (see docs/architecture.md): signed, expiring records with subkeys,
merged on the storing node (`records`), Kademlia lookups over py-libp2p's routing table
(`routing`) with our own STORE/GET RPCs (`kademlia`; one DHT network serves every swarm), swarm
discovery under `/meshtrain/<swarm>/peers` (`discovery`), the swarm index under
`/meshtrain/swarms` (`swarm_index`), and each peer's announcement as a standard kad record other
libp2p stacks read (`interop`)."""

from meshtrain.dht.discovery import Announcement, Discovery, DiscoveryConfig, peers_key
from meshtrain.dht.kademlia import NETWORK, BootstrapError, Dht, DhtConfig
from meshtrain.dht.records import DhtError, InvalidRecord, Record, RecordLimits, RecordStore
from meshtrain.dht.swarm_index import SWARMS_KEY, SwarmAdvert, publish_advert, read_adverts

__all__ = [
    "NETWORK",
    "SWARMS_KEY",
    "SwarmAdvert",
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
    "publish_advert",
    "read_adverts",
]
