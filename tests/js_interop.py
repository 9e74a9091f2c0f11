"""The js-libp2p reader of tests/js (kad GET_VALUE of a meshtrain peer record, verified in
JavaScript): installing its npm packages and running it, for tests/test_interop_js.py and
scripts/bench/bench_ecosystem.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import trio

JS = Path(__file__).parent / "js"
JS_TIMEOUT_MS = 20_000


def install_js(where: Path) -> str | None:
    """Copy tests/js to `where` and install its packages there at the lock file's versions
    (`npm ci`); None when done, else why it cannot run here (no Node.js, npm, or registry)."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        return "no Node.js / npm on this machine: the js-libp2p side cannot run"
    where.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json", "kad_get_record.mjs"):
        shutil.copy(JS / name, where / name)
    try:
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],  # the lock's versions
            cwd=where,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return "npm ci took over 5 minutes (registry unreachable?)"
    if done.returncode != 0:
        return f"npm ci failed (registry unreachable?): {done.stderr.strip()[-300:]}"
    return None


async def js_get(where: Path, bootstrap: str, key: str, timeout_ms: int = JS_TIMEOUT_MS) -> tuple[dict, float]:
    """Run the js reader in `where` (`install_js`) against the node at `bootstrap`; its one JSON
    line ({"verified", "record" or "error", "latency_ms"}) and its wall time in seconds."""
    started = time.monotonic()
    done = await trio.run_process(
        ["node", "kad_get_record.mjs", bootstrap, key, str(timeout_ms)],
        cwd=where,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    wall = time.monotonic() - started
    lines = done.stdout.decode().strip().splitlines()
    if done.returncode != 0 or not lines:
        raise AssertionError(f"the js reader exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return json.loads(lines[-1]), wall
