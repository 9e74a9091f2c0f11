"""A peer of several local ranks (one swarm identity, N GPUs): the rank group and its process
groups (`group`), FSDP2 sharding (`sharding`), device choice and precision (`devices`). The
launcher that starts the ranks is node/local_ranks.py."""
