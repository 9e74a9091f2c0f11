#!/usr/bin/env bash
# The suite, N times in a row, with one of the machine's cores kept busy: a test that only passes
# on an idle machine fails here, where it would fail on a loaded CI runner or a developer's laptop.
#
#     scripts/stress_suite.sh [--no-load] N [pytest args...]
#
# Each run is the whole suite as `make test` runs it (.venv/bin/pytest -q -p no:cacheprovider
# -n 2 --dist loadfile --no-loadscope-reorder --durations=15: two xdist workers, a module at a time) plus -rfE and
# the extra args, while `stress-ng --cpu 1` loads one core (--no-load: no stress-ng, for
# a run to compare with). Prints each run's summary line, failed test ids and wall time, and last
# one JSON line:
#     {"runs": N, "load": ..., "failures_per_run": [...], "wall_s": [...], "failed_tests": {id: runs}}
# Each run's whole output stays in $STRESS_OUT (default: a new folder under /tmp), and each
# failure's whole report is in runI.failures as soon as the test fails. Ctrl-C stops
# it at once, SIGTERM after the run under way; stress-ng goes with it either way.
# Exit status: 0 when every run passed, 1 when one failed, 2 for bad arguments.
set -euo pipefail

usage() {
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

load=1
if [[ "${1:-}" == "--no-load" ]]; then
    load=0
    shift
fi
[[ "${1:-}" =~ ^[1-9][0-9]*$ ]] || usage
runs=$1
shift

cd "$(dirname "$0")/.."
PYTEST=.venv/bin/pytest
PY=.venv/bin/python
[[ -x $PYTEST ]] || { echo "no $PYTEST: run 'make install' first" >&2; exit 2; }

out=${STRESS_OUT:-$(mktemp -d /tmp/stress_suite.XXXXXX)}
mkdir -p "$out"

stress_pid=""
cleanup() {
    if [[ -n $stress_pid ]]; then
        # its own process group (setsid below): stress-ng and its workers go together
        kill -TERM -- "-$stress_pid" 2>/dev/null || true
        wait "$stress_pid" 2>/dev/null || true
        stress_pid=""
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ((load)); then
    if ! command -v stress-ng >/dev/null; then
        if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
            echo "installing stress-ng ..." >&2
            { apt-get install -y stress-ng || { apt-get update && apt-get install -y stress-ng; }; } >"$out/apt.log" 2>&1 ||
                { echo "could not install stress-ng (see $out/apt.log)" >&2; exit 2; }
        else
            echo "stress-ng is missing: apt-get install stress-ng (or run with --no-load)" >&2
            exit 2
        fi
    fi
    setsid stress-ng --cpu 1 --timeout 0 --quiet &
    stress_pid=$!
    sleep 0.5
    kill -0 "$stress_pid" 2>/dev/null || { echo "stress-ng did not start" >&2; exit 2; }
    load_name="stress-ng --cpu 1"
else
    load_name="none"
fi

echo "$runs run(s) of the suite, load: $load_name; outputs in $out" >&2
for ((i = 1; i <= runs; i++)); do
    log="$out/run$i.log"
    t0=$(date +%s.%N)
    rc=0
    MESHTRAIN_FAILURE_LOG="$out/run$i.failures" \
        "$PYTEST" -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=15 -rfE "$@" >"$log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    wall=$("$PY" -c "print(round($t1 - $t0, 1))")
    echo "$wall" >"$out/run$i.wall"
    echo "$rc" >"$out/run$i.rc"
    # the short summary's "FAILED id - message" and "ERROR id - message" lines
    grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\1 \2/' >"$out/run$i.failed" || true
    summary=$(grep -E '^=* ?[0-9]+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed)|^=* ?no tests ran' "$log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
    echo "run $i/$runs: ${summary:-no summary line (exit $rc, see $log)} [wall ${wall} s, exit $rc]"
    if [[ -s "$out/run$i.failed" ]]; then
        sed 's/^/    /' "$out/run$i.failed"
    elif ((rc != 0 && rc != 5)); then
        echo "    exit $rc with no failed test listed: the last lines of $log:"
        tail -5 "$log" | sed 's/^/    /'
    fi
done

cleanup
"$PY" - "$out" "$runs" "$load_name" <<'EOF'
import json
import sys
from collections import Counter
from pathlib import Path

out, runs, load = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
failures, walls, failed = [], [], Counter()
for i in range(1, runs + 1):
    ids = sorted({line.split(" ", 1)[1] for line in (out / f"run{i}.failed").read_text().splitlines() if " " in line})
    rc = int((out / f"run{i}.rc").read_text())
    if not ids and rc not in (0, 5):  # pytest stopped without a summary: interrupted, internal error
        ids = [f"<pytest exit {rc}>"]
    failures.append(len(ids))
    walls.append(float((out / f"run{i}.wall").read_text()))
    failed.update(ids)
result = {
    "runs": runs,
    "load": load,
    "failures_per_run": failures,
    "wall_s": walls,
    "failed_tests": dict(sorted(failed.items(), key=lambda kv: (-kv[1], kv[0]))),
}
print(json.dumps(result))
sys.exit(1 if any(failures) else 0)
EOF
