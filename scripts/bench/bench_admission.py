"""What an admitted identity costs in an open swarm: minting proofs of work on peer ids.

    python scripts/bench/bench_admission.py [--bits 16] [--identities 100] [--trials 10]

Open admission (meshtrain/node/trust/admission.py) asks every peer for a nonce such that
blake3(swarm id, peer id, nonce) starts with `--bits` zero bits. This mints them as an attacker
would — fresh Ed25519 identities, one proof each, in pure Python on one core — and reports:

- `mint_one_s`: the time to mint one admitted identity (key pair + proof), the mean of `--trials`
  separate mints (one mint alone is a geometric draw: its time varies several-fold);
- `mint_many_s`: the time to mint `--identities` of them in a row;
- `sybil_cost_ratio`: `mint_many_s / mint_one_s` (the target's measure: 100 identities against
  one; it should be close to `--identities`: no discount for numbers);
- `verify_us`: checking one proof (what every honest peer pays per peer, once; cached after).

Every minted proof is verified before it counts. One JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import time

from meshtrain.node.trust.admission import mint_pow, pow_ok
from meshtrain.transport.identity import Identity

SWARM = "ms0123456789abcdef0123"


def mint_identity(bits: int) -> tuple[str, int]:
    peer = Identity.generate().peer_id_str
    nonce = mint_pow(SWARM, peer, bits)
    if not pow_ok(SWARM, peer, nonce, bits):
        raise SystemExit(f"a minted proof failed to verify for {peer}")
    return peer, nonce


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=16)
    ap.add_argument("--identities", type=int, default=100)
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()

    singles = []
    for _ in range(args.trials):
        t0 = time.perf_counter()
        mint_identity(args.bits)
        singles.append(time.perf_counter() - t0)
    mint_one = sum(singles) / len(singles)

    t0 = time.perf_counter()
    minted = [mint_identity(args.bits) for _ in range(args.identities)]
    mint_many = time.perf_counter() - t0

    t0 = time.perf_counter()
    for peer, nonce in minted:
        pow_ok(SWARM, peer, nonce, args.bits)
    verify_us = (time.perf_counter() - t0) / len(minted) * 1e6

    print(
        json.dumps(
            {
                "pow_bits": args.bits,
                "identities": args.identities,
                "mint_one_s": round(mint_one, 4),
                "mint_many_s": round(mint_many, 3),
                "sybil_cost_ratio": round(mint_many / mint_one, 1),
                "verify_us": round(verify_us, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
