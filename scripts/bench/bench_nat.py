"""NAT traversal benchmark: hole punching and relay fallback in a namespace NAT lab (issue #7).

    sudo .venv/bin/python scripts/bench/bench_nat.py [--trials 10] [--mib 4] [--keep-logs DIR]

One lab: a relay on the public segment (pub0) and four homes, two behind a port-preserving cone
NAT that drops unsolicited inbound, two behind a symmetric NAT (`snat ... fully-random`). Every
trial starts a fresh pair of peer processes (fresh identities, a fresh listen port, so no NAT
mapping survives from an earlier trial) behind the two NATs of one type, reserves on the relay,
connects A -> B through the relay, and then:

- cone: DCUtR upgrade; success = the libp2p connection is direct AND `--mib` MiB of tensors
  arrive over the data plane's own hole-punched TCP connection (path "direct"), digests equal.
  `cone_time_to_direct_s` = from starting the relayed connect to the direct libp2p connection.
- symmetric: success = the tensors arrive intact through the relay (path "libp2p").

Then `nat_round_ok`: four fresh peers (two per NAT type) connect pairwise through the relay,
upgrade what can be upgraded, and run one `SwarmCollective.all_reduce` (DiLoCo's outer
all-reduce); ok = every peer finished with all four contributors and the same digest.

Progress goes to stderr; the last stdout line is one JSON object. Needs root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.labs.natlab.lab import LabUnavailable, NatLab, check_support, cleanup_stale  # noqa: E402
from scripts.labs.natlab.peers import LabPeer, LabPeerError, start_peers  # noqa: E402

HOMES = {"cone": ("h0", "h1"), "symmetric": ("h2", "h3")}


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def trial(lab: NatLab, relay: LabPeer, variant: str, n: int, mib: float, logs: str) -> dict:
    a_host, b_host = HOMES[variant]
    peers = start_peers(lab, {a_host: {"port": 4100 + n}, b_host: {"port": 4100 + n}}, log_dir=f"{logs}/{variant}{n}")
    a, b = peers[a_host], peers[b_host]
    out: dict[str, Any] = {"variant": variant, "trial": n, "ok": False}
    try:
        for p in (a, b):
            p.call("connect", addr=relay.addr)
            p.call("reserve", relay=relay.addr)
            p.call("probe")  # private: its data plane punches instead of listening
        t0 = time.monotonic()
        out["connect"] = a.call("connect", addr=b.circuit(relay))["type"]
        if variant == "cone":
            up = a.call("upgrade", peer=b.peer_id, timeout=30)
            out["direct"] = up["direct"]
            if up["direct"]:
                out["time_to_direct_s"] = time.monotonic() - t0
        rid = b.submit("recv", peer=a.peer_id, tag="bench", timeout=90)
        sent = a.call("send", peer=b.peer_id, tag="bench", mib=mib, timeout=90, check=False)
        got = b.result(rid, timeout=100, check=False)
        out["path"] = sent.get("path")
        out["data_ok"] = bool(sent.get("ok") and got.get("ok") and sent["digest"] == got["digest"])
        if not out["data_ok"]:
            out["error"] = sent.get("error") or got.get("error")
        want_path = "direct" if variant == "cone" else "libp2p"
        out["ok"] = out["data_ok"] and out["path"] == want_path and (variant != "cone" or bool(out.get("direct")))
    except LabPeerError as e:
        out["error"] = str(e)
    finally:
        for p in (a, b):
            p.close()
    return out


def nat_round(lab: NatLab, relay: LabPeer, mib: float, logs: str) -> dict:
    hosts = [*HOMES["cone"], *HOMES["symmetric"]]
    peers = start_peers(lab, {h: {"port": 4300} for h in hosts}, log_dir=f"{logs}/round")
    out: dict[str, Any] = {"ok": False}
    try:
        for p in peers.values():
            p.call("connect", addr=relay.addr)
            p.call("reserve", relay=relay.addr)
            p.call("probe")  # private: its data plane punches instead of listening
        ps = [peers[h] for h in hosts]
        for i, a in enumerate(ps):
            for b in ps[i + 1 :]:
                a.call("connect", addr=b.circuit(relay))
        c0, c1 = peers["h0"], peers["h1"]
        out["cone_pair_direct"] = c0.call("upgrade", peer=c1.peer_id, timeout=30)["direct"]
        ids = [p.peer_id for p in ps]
        t0 = time.monotonic()
        cids = {p.name: p.submit("allreduce", peers=ids, round=1, mib=mib) for p in ps}
        res = {name: peers[name].result(cid, timeout=240, check=False) for name, cid in cids.items()}
        out["seconds"] = time.monotonic() - t0
        out["results"] = {
            n: {k: r.get(k) for k in ("ok", "digest", "contributors", "error", "paths")} for n, r in res.items()
        }
        digests = {r.get("digest") for r in res.values()}
        out["ok"] = (
            all(r.get("ok") for r in res.values())
            and len(digests) == 1
            and all(len(r.get("contributors") or []) == 4 for r in res.values())
        )
    except LabPeerError as e:
        out["error"] = str(e)
    finally:
        for p in peers.values():
            p.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--mib", type=float, default=4.0, help="tensor payload per trial")
    ap.add_argument("--round-mib", type=float, default=4.0, help="all-reduce payload per peer")
    ap.add_argument("--keep-logs", default=None, help="directory for peer logs (default: temp)")
    args = ap.parse_args()
    try:
        check_support()
    except LabUnavailable as e:
        print(json.dumps({"error": f"NAT lab unavailable: {e}"}))
        return 2
    cleanup_stale()
    logs = args.keep_logs or tempfile.mkdtemp(prefix="bench_nat_")
    Path(logs).mkdir(parents=True, exist_ok=True)
    log(f"peer logs: {logs}")
    started = time.monotonic()
    results: dict[str, list[dict]] = {"cone": [], "symmetric": []}
    with NatLab(["cone", "cone", "symmetric", "symmetric"], public_hosts=1) as lab:
        relay = LabPeer(lab, "pub0", serve_relay=True, log_path=f"{logs}/pub0.log")
        try:
            for variant in ("cone", "symmetric"):
                for n in range(args.trials):
                    r = trial(lab, relay, variant, n, args.mib, logs)
                    results[variant].append(r)
                    log(json.dumps(r))
            round_result = nat_round(lab, relay, args.round_mib, logs)
            log(json.dumps(round_result))
        finally:
            relay.close()
    cone, sym = results["cone"], results["symmetric"]
    times = [r["time_to_direct_s"] for r in cone if r.get("time_to_direct_s") is not None]
    summary = {
        "cone_direct_rate": sum(r["ok"] for r in cone) / max(1, len(cone)),
        "cone_libp2p_direct_rate": sum(bool(r.get("direct")) for r in cone) / max(1, len(cone)),
        "cone_time_to_direct_s_p50": round(statistics.median(times), 3) if times else None,
        "symmetric_relay_rate": sum(r["ok"] for r in sym) / max(1, len(sym)),
        "nat_round_ok": bool(round_result["ok"]),
        "nat_round_s": round(round_result.get("seconds") or 0.0, 2),
        "trials_per_variant": args.trials,
        "payload_mib": args.mib,
        "bench_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
