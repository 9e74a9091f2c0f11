"""Network-namespace NAT lab for NAT-traversal tests and benchmarks.

Everything lives in `scripts.labs.natlab.lab` (`from scripts.labs.natlab.lab import NatLab`); see its
docstring and README.md beside it.
"""
