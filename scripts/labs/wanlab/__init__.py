"""WAN lab: peers on rate-limited, delayed links in network namespaces (root); see lab.py."""
