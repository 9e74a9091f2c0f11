"""Network-namespace NAT lab for NAT-traversal tests and benchmarks.

Everything lives in `scripts.natlab.lab` (`from scripts.natlab.lab import NatLab`); see its
docstring and README.md beside it.
"""
