#!/usr/bin/env bash
# Validate every CUDA path on one GPU and record what it measures in one folder (issue 18).
#
#   scripts/gpu_check.sh [--dry-run] [OUT]      (OUT defaults to gpu-check/)
#
# Steps, each writing into OUT: the machine (env.json, nvidia-smi.txt), the CUDA tests
# (cuda-tests.txt), `rematlab measure` on VGG-16 for none / uniform:4 / sqrt in fp32 and under
# bf16 autocast (the user's step, `--precision bf16`), `rematlab plan`
# eager and under torch.compile at three budgets with measured peaks (plans.json), pre-flight
# plans (predicted without running, for the GPU here and its data sheet: five models, bf16
# autocast, three budgets) with their allocated and reserved peaks measured and the CUDA
# context (preflight.json; docs/gpu.md on a GPU, gpu.md in OUT on a dry run), a slice of the seed study's grid spanning every factor swept
# into a database (slice.duckdb), then
# `fit` (predictor MAPE on GPU data) and `stats`. `--dry-run` runs the same steps on the CPU
# at the smallest sizes (what CI runs); without it the script needs a GPU and about 8 minutes.
#
# Set-up: reuses .venv (dry run) or makes .venv-gpu on top of the machine's own CUDA/ROCm
# build of torch (--system-site-packages), installing the rest of requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-gpu-check}
mkdir -p "$OUT"
start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start )) s)" | tee -a "$OUT/summary.txt"; }

if [ "$DRY" = 1 ]; then
    make -s .venv/.installed
    PY=.venv/bin/python
    DEV=cpu
else
    if [ ! -x .venv-gpu/bin/python ]; then
        python3 -m venv --system-site-packages .venv-gpu
        grep -v '^torch==' requirements.txt | .venv-gpu/bin/pip install -q -r /dev/stdin
        .venv-gpu/bin/pip install -q --no-deps -e .
    fi
    PY=.venv-gpu/bin/python
    DEV=cuda
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA/ROCm GPU: use --dry-run")'
fi
REMATLAB=("$PY" -m rematlab.cli)

step "machine"
"$PY" - "$OUT/env.json" "$DEV" <<'EOF'
import json, sys, torch
from rematlab.measurement.measure import environment
env = environment(torch.device(sys.argv[2]))
env["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    env.update(total_memory=p.total_memory, capability=f"{p.major}.{p.minor}")
json.dump(env, open(sys.argv[1], "w"), indent=2)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
command -v rocm-smi >/dev/null && rocm-smi > "$OUT/rocm-smi.txt" 2>&1 || true

step "CUDA tests"
"$PY" -m pytest tests/test_cuda.py -q -rA -p no:cacheprovider > "$OUT/cuda-tests.txt" 2>&1 \
    || { tail -5 "$OUT/cuda-tests.txt"; exit 1; }
tail -1 "$OUT/cuda-tests.txt" | tee -a "$OUT/summary.txt"

if [ "$DRY" = 1 ]; then
    SCALE=cifar; BATCH=4; REPEATS=1; PLAN_BATCH=4; COMPILE_MODEL=mlp3
else
    SCALE=imagenet; BATCH=64; REPEATS=5; PLAN_BATCH=64; COMPILE_MODEL=vgg16
fi

step "measure VGG-16 ($SCALE, batch $BATCH), fp32 and the user's bf16 autocast step"
for p in fp32 bf16; do
    for s in none uniform:4 sqrt; do
        "${REMATLAB[@]}" measure --model vgg16 --input "$SCALE" --batch "$BATCH" --strategy "$s" \
            --device "$DEV" --repeats "$REPEATS" --precision "$p" --json \
            > "$OUT/measure-vgg16-${s/:/-}$([ "$p" = fp32 ] || echo "-$p").json"
    done
done

step "plans: eager and torch.compile, three budgets each"
"$PY" scripts/gpu_plans.py --model vgg16 --input "$SCALE" --batch "$PLAN_BATCH" --device "$DEV" \
    --compile-model "$COMPILE_MODEL" --out "$OUT/plans.json" | tee -a "$OUT/summary.txt"

step "pre-flight: plans predicted without running, their peaks measured"
if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu_preflight.py --device cpu --profile h200 --small --out "$OUT/preflight.json" \
        --doc "$OUT/gpu.md" | tee -a "$OUT/summary.txt"
else
    "$PY" scripts/gpu_preflight.py --device cuda --profile h200 --out "$OUT/preflight.json" \
        --doc docs/gpu.md | tee -a "$OUT/summary.txt"
fi

step "sweep a slice of the seed study"
if [ "$DRY" = 1 ]; then
    cat > "$OUT/slice.toml" <<'EOF'
# the seed study's factors at the smallest sizes (dry run on the CPU)
name = "seed-slice-dry"
batches = [4, 8]
strategies = ["none", "uniform:2", "sqrt"]
dtypes = ["float32"]
devices = ["cpu"]
optimizers = ["momentum"]
repeats = 1
max_wait_s = 5          # CI's machine may be busy: wait a little for quiet, then move on
max_wait_total_s = 60
[[models]]
name = "mlp3"
[[models]]
name = "lenet5"
EOF
else
    cat > "$OUT/slice.toml" <<'EOF'
# a slice of grids/seed-study.toml spanning every factor: the six architectures, small and
# large batches, four strategy kinds, both dtypes, two optimizers (192 configurations)
name = "seed-slice"
batches = [64, 256]
strategies = ["none", "uniform:2", "sqrt", "selective"]
dtypes = ["float32", "bfloat16"]
devices = ["cuda"]
optimizers = ["momentum", "adam"]
warmup = 2
repeats = 3
timeout = 300
[[models]]
name = "mlp3"
[[models]]
name = "mlp7"
[[models]]
name = "lenet5"
[[models]]
name = "alexnet"
inputs = ["cifar"]
[[models]]
name = "vgg16"
inputs = ["cifar"]
[[models]]
name = "vgg16"
inputs = ["imagenet"]
batches = [16, 32]
EOF
fi
"${REMATLAB[@]}" sweep "$OUT/slice.toml" --db "$OUT/slice.duckdb" --json > "$OUT/sweep.json"

step "fit and stats on the slice"
"${REMATLAB[@]}" fit --db "$OUT/slice.duckdb" --out "$OUT/predictor.skops" --json > "$OUT/fit.json"
"${REMATLAB[@]}" stats --db "$OUT/slice.duckdb" --markdown "$OUT/stats.md" --json > "$OUT/stats.json"
"$PY" - "$OUT/fit.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
for r in json.load(open(sys.argv[1]))["evaluation"]:
    if r["protocol"] == "random 80/20":
        print(f"{r['target']:6} {r['model']:24} MAPE {r['mape']:.2%}  R2 {r['r2']:.4f}")
EOF

step "done: everything is in $OUT"
