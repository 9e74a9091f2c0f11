"""Whom a swarm counts: admission by the signed rule (`admission`), strikes and exclusion
(`strikes`), loss scoring (`scoring`), replay spot checks (`spot_check`), the verification that
wires them (`verification`), and the adversary test hooks (`adversary`)."""
