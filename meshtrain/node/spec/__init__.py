"""What a swarm trains and how this machine runs: the swarm spec (`swarm`), its signed form and
swarm id (`signed`), the outer optimizer it names (`outer`), this node's config (`config`, with
the shipped `node.toml`), and the swarms the DHT lists (`listing`)."""
