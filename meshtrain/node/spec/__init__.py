"""What a swarm trains and how this machine runs: the swarm spec (`swarm`), its signed form and
swarm id (`signed`), the outer optimizer it names (`outer`), this node's config (`config`, with
the shipped `node.toml`), the swarms the DHT lists (`listing`), and the configuration reference
rendered from the spec and config models (`reference`: docs/configuration.md)."""
