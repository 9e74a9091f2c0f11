#!/usr/bin/env bash
# The GPU check: what a machine with a CUDA GPU runs first, in one go, within ~8 minutes.
#
#   scripts/gpu_check.sh [python]      (default: .venv/bin/python if present, else python3)
#
# 1. the environment: the GPU, torch and its CUDA, and whether meshtrain's dependencies import;
# 2. the `cuda`-marked tests (tests/test_devices.py, tests/test_multi_rank.py: the trainer on
#    cuda, bf16 autocast, the outer state fp32 on the host; tests/test_pipeline_device.py: pipeline
#    stages on cuda in bf16, their hops, a 3-peer bf16 pipeline learning — a few seconds);
# 3. scripts/bench/bench_trainer.py --quick --skip-multi-rank, whose trainer phase also runs on
#    cuda where torch sees one (gpu_samples_per_s, gpu_trainer_overhead).
# Its last line is one JSON object: {"cuda", "gpu", "torch", "deps_missing", "tests", "bench_trainer"}.
#
# Nothing here has run on CUDA yet (README, "Running on GPUs"). A machine without meshtrain's
# dependencies (py-libp2p, trio, blake3, pydantic, ...) reports them in `deps_missing` and skips
# the rest: install them first (`pip install -e '.[dev]'` where an index is reachable).
set -u
cd "$(dirname "$0")/.."
PY=${1:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG=$(mktemp -d)

"$PY" - >"$LOG/env.json" <<'EOF'
import importlib, json
import torch
missing = []
for name in ("libp2p", "trio", "msgpack", "cryptography", "blake3", "safetensors", "pydantic",
             "datasets", "transformers", "tokenizers", "pytest", "pytest_trio", "hypothesis"):
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 — any import failure is a missing dependency here
        missing.append(f"{name} ({type(e).__name__})")
cuda = torch.cuda.is_available()
print(json.dumps({"cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda, "deps_missing": missing}))
EOF
cat "$LOG/env.json"

tests='{"skipped": "dependencies missing"}'
bench='null'
if "$PY" -c 'import json,sys; sys.exit(1 if json.load(open(sys.argv[1]))["deps_missing"] else 0)' "$LOG/env.json"; then
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_devices.py tests/test_multi_rank.py tests/test_pipeline_device.py 2>&1 | tee "$LOG/tests.txt" | tail -20
    tests=$("$PY" - "$LOG/tests.txt" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
print(json.dumps(counts or {"output": text[-300:]}))
EOF
)
    timeout 240 "$PY" scripts/bench/bench_trainer.py --quick --skip-multi-rank 2>"$LOG/bench.err" | tee "$LOG/bench.txt" | tail -3
    bench=$(grep '^{' "$LOG/bench.txt" | tail -1)
    bench=${bench:-null}
fi
"$PY" - "$LOG/env.json" "$tests" "$bench" <<'EOF'
import json, sys
env = json.load(open(sys.argv[1]))
print(json.dumps({**env, "tests": json.loads(sys.argv[2]), "bench_trainer": json.loads(sys.argv[3])}))
EOF
