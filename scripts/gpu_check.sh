#!/usr/bin/env bash
# Validate the CUDA paths on one GPU and record what it measures in one folder (issue 49).
#
#   scripts/gpu_check.sh [--dry-run] [OUT]      (OUT defaults to gpu-check/)
#
# Made for a short, offline GPU window: it installs nothing when the dependencies import (the
# machine's own torch is used), every step runs capped in time and isolated (a failure is
# recorded in OUT/steps.tsv and the next step still runs), each model is measured in a process
# of its own, and everything lands in OUT, ready to commit. In order, with their caps:
#   machine (env.json, nvidia-smi.txt)                                     10 s
#   record: GPU facts, tests/gpufacts.py's format (facts/facts.json)      150 s
#   CUDA tests (cuda-tests.txt)                                            60 s
#   pre-flight replayed against the facts just recorded (replay.txt)       40 s
#   plans: eager and torch.compile at three budgets (plans.json)           40 s
#   offload: two offloading plans, measured, and pre-flight's (offload.json) 60 s
# which is at most 6 minutes; then the seed study's GPU grid (grids/seed-study-gpu.toml) for
# at most 4 minutes, resumable (study.duckdb: STUDY_DB=that file continues it), then fit and
# stats. docs/gpu.md estimates each step. `--dry-run` runs the same steps on the CPU at the
# smallest sizes (what CI runs).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-gpu-check}
mkdir -p "$OUT"
start=$(date +%s)
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
printf 'step\texit\tseconds\n' > "$OUT/steps.tsv"

# A Python that imports everything the check needs, installing nothing if one does.
imports() { "$1" -c 'import torch, numpy, typer, rich, pydantic, duckdb, pandas, sklearn, scipy, statsmodels, matplotlib, jinja2, skops, transformers, pytest' 2>/dev/null; }
PY=
for cand in ${PYTHON:-} .venv-gpu/bin/python .venv/bin/python python3; do
    if [ -x "$(command -v "$cand")" ] && imports "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
    if [ "$DRY" = 1 ]; then
        make -s .venv/.installed && PY=.venv/bin/python
    else  # the machine's torch, the rest from wheels/ if given (no network), else PyPI
        python3 -m venv --system-site-packages .venv-gpu
        find_links=(); [ -d wheels ] && find_links=(--no-index --find-links wheels)
        grep -v '^torch==' requirements.txt | .venv-gpu/bin/pip install -q "${find_links[@]}" \
            -r /dev/stdin && PY=.venv-gpu/bin/python
    fi
fi
if [ -z "$PY" ] || ! imports "$PY"; then echo "no Python with the dependencies" >&2; exit 2; fi
if [ "$DRY" = 1 ]; then DEV=cpu; else
    DEV=cuda
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA/ROCm GPU: use --dry-run")' || exit 2
fi

# step NAME SECONDS CMD...: runs CMD capped at SECONDS, output in OUT/NAME.log, outcome in
# OUT/steps.tsv and OUT/summary.txt; never stops the script.
step() {
    local name=$1 limit=$2; shift 2
    local t0; t0=$(date +%s)
    echo "== $name (at $(( t0 - start )) s, cap $limit s)" | tee -a "$OUT/summary.txt"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
    tail -3 "$OUT/$name.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
    [ "$rc" = 0 ] || echo "   FAILED (exit $rc$([ "$rc" = 124 ] && echo ': out of time'))" \
        | tee -a "$OUT/summary.txt"
}

if [ "$DRY" = 1 ]; then
    SMALL=(--dry-run); SCALE=cifar; BATCH=4; COMPILE_MODEL=mlp3; LIMIT=300
else
    SMALL=(); SCALE=cifar; BATCH=64; COMPILE_MODEL=mlp3; LIMIT=45
fi

step machine 10 "$PY" - "$OUT/env.json" "$DEV" <<'PYEOF'
import json, subprocess, sys, torch
from rematlab.measurement.measure import environment
env = environment(torch.device(sys.argv[2]))
env["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    env.update(total_memory=p.total_memory, capability=f"{p.major}.{p.minor}")
    for tool in ("nvidia-smi", "rocm-smi"):
        try:
            env[tool] = subprocess.run([tool], capture_output=True, text=True, timeout=5).stdout
        except OSError:
            pass
json.dump(env, open(sys.argv[1], "w"), indent=2)
print("machine recorded")
PYEOF

step record 150 "$PY" scripts/gpu_record.py "${SMALL[@]}" --out "$OUT/facts" --limit "$LIMIT"
step cuda-tests 60 "$PY" -m pytest tests/test_cuda.py -q -rA -p no:cacheprovider
step replay 40 env REMATLAB_FACTS="$OUT/facts" "$PY" -m pytest tests/test_gpu_facts.py -q \
    -p no:cacheprovider -k "recorded_layers or preflight_matches"
step plans 40 "$PY" scripts/gpu_plans.py --model vgg16 --input "$SCALE" --batch "$BATCH" \
    --device "$DEV" --compile-model "$COMPILE_MODEL" --out "$OUT/plans.json"
step offload 60 "$PY" scripts/gpu_offload.py --device "$DEV" --out "$OUT/offload.json"

# the seed study's GPU grid (grids/seed-study-gpu.toml, 2,124 configurations, ~4.2 min on an
# H200 by scripts/gpu_grid_estimate.py), last and resumable: a run cut off keeps its rows, and
# a later check continues it when given the database it brought back (STUDY_DB=path)
DB="$OUT/study.duckdb"
if [ -n "${STUDY_DB:-}" ]; then cp "$STUDY_DB" "$DB"; fi
if [ "$DRY" = 1 ]; then
    GRID="$OUT/study.toml"
    cat > "$GRID" <<TOML
# the GPU grid's factors at this CPU's sizes (grids/seed-study-gpu.toml)
name = "seed-study-gpu-dry"
batches = [8]
strategies = ["none", "uniform:2", "selective"]
dtypes = ["float32", "bfloat16"]
devices = ["cpu"]
optimizers = ["sgd", "adam"]
warmup = 1
repeats = 3
min_repeat_s = 0.005
[[models]]
name = "mlp3"
[[models]]
name = "lenet5"
TOML
else
    GRID=seed-study-gpu
fi
step study 240 "$PY" -m rematlab.cli sweep "$GRID" --db "$DB" --max-wait 5 \
    --max-wait-total 30 --json
step fit 30 "$PY" -m rematlab.cli fit --db "$DB" --out "$OUT/predictor.skops" --json
step stats 30 "$PY" -m rematlab.cli stats --db "$DB" --markdown "$OUT/stats.md" --json

echo "== done in $(( $(date +%s) - start )) s: everything is in $OUT" | tee -a "$OUT/summary.txt"
failed=$(awk -F'\t' 'NR > 1 && $2 != 0' "$OUT/steps.tsv" | wc -l)
[ "$failed" = 0 ] || { echo "$failed step(s) failed: see $OUT/steps.tsv" >&2; exit 1; }
