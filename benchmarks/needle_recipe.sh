#!/usr/bin/env bash
# The CPU needle recipe (docs/LONG_CONTEXT.md): a cpu_tiny model learns pass-key retrieval
# at T=1024 in two stages, NSA and full attention side by side, each evaluated at 1x, 2x and
# 4x the training length on held-out text. From the repository root:
#
#   bash benchmarks/needle_recipe.sh OUT_DIR [SEEDS] [VARIANTS]
#
# SEEDS: comma list (default 1). VARIANTS: comma list of nsa, full (default nsa,full).
# Stage 1: T=128, 16 rows a step, 800 steps: the copy circuit forms where the whole row is
#   in reach of every branch. Stage 2: T=1024, 4 rows a step, 300 more steps, continuing
#   from stage 1's checkpoint (weights, AdamW moments, step; the data stream restarts).
# The learning rate is constant after a 30-step warm-up (2e-3, then 1e-3 at T=1024): the
# schedule is a function of the global step, and a cosine to stage 1's end would leave
# stage 2 at the floor.
# Full attention is the same model with only the sliding-window branch, w=4096 (causal
# attention over the whole row, also at 4x the training length).
# Writes OUT_DIR/<variant>_s<seed>/ (the run, its eval/ with evaluation.json and the
# PNGs) and OUT_DIR/summary.txt (one line per run: the needle accuracy by length).
set -euo pipefail
OUT=${1:?usage: bash benchmarks/needle_recipe.sh OUT_DIR [SEEDS] [VARIANTS]}
SEEDS=${2:-1}
VARIANTS=${3:-nsa,full}
PY=${PYTHON:-python}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$OUT"

COMMON=(--config cpu_tiny --dataset needle --data-path "docs/[EPR]*.md" --set train.log_every=50)
STAGE1=(--set train.seq_len=128 --set train.global_batch=16 --set train.lr=2e-3 --set train.min_lr=2e-3 --set train.warmup=30
        --set train.eval_every=400 --set checkpoint.save_every=400 --steps 800)
STAGE2=(--set train.seq_len=1024 --set train.global_batch=4 --set train.lr=1e-3 --set train.min_lr=1e-3
        --set train.eval_every=150 --set checkpoint.save_every=150 --set checkpoint.restore_data=false --steps 1100)

for seed in ${SEEDS//,/ }; do
  for variant in ${VARIANTS//,/ }; do
    case $variant in
      nsa) model=() ;;
      full) model=(--set model.nsa.branches=win --set model.nsa.w=4096) ;;
      *) echo "error: unknown variant $variant (use nsa, full)" >&2; exit 2 ;;
    esac
    run=$OUT/${variant}_s$seed
    args=("${COMMON[@]}" "${model[@]}" --set train.seed="$seed" --out-dir "$run")
    start=$(date +%s)
    $PY -m launch.train "${args[@]}" "${STAGE1[@]}"
    mid=$(date +%s)
    $PY -m launch.train "${args[@]}" "${STAGE2[@]}"
    end=$(date +%s)
    $PY -m launch.evaluate --ckpt "$run" --suites needle,loss-by-position --lengths 1024,2048,4096 \
      --samples 4 --text README.md docs/NSA.md --out "$run/eval"
    $PY - "$run/eval/evaluation.json" "$variant" "$seed" "$((mid - start))" "$((end - mid))" >>"$OUT/summary.txt" <<'EOF'
import json, sys
res = json.load(open(sys.argv[1]))["needle"]  # accuracy [L][depth]
by_len = "  ".join(
    f"L={L}: mean {sum(a) / len(a):.2f} min {min(a):.2f}" for L, a in zip(res["lengths"], res["accuracy"])
)
print(f"{sys.argv[2]} seed {sys.argv[3]}: stage 1 {sys.argv[4]} s, stage 2 {sys.argv[5]} s | {by_len}")
EOF
    tail -n 1 "$OUT/summary.txt"
  done
done
