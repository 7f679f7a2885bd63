#!/usr/bin/env bash
# The CPU needle recipe (docs/LONG_CONTEXT.md): a cpu_tiny model learns pass-key retrieval
# at T=1024 in four stages, NSA and full attention side by side, each evaluated at 1x, 2x and
# 4x the training length on held-out text. From the repository root:
#
#   bash benchmarks/needle_recipe.sh OUT_DIR [SEEDS] [VARIANTS]
#
# SEEDS: comma list (default 1). VARIANTS: comma list of nsa, full (default nsa,full).
# The model learns at growing lengths, each stage continuing from the last one's
# checkpoint (weights, AdamW moments, step; the data stream restarts):
#   T=128, 16 rows a step, steps 1-800: the copy circuit forms where the whole row is in
#     reach of every branch (at T=128 the selection takes every block);
#   T=256, 16 rows, steps 801-1100; T=512, 8 rows, to 1400; T=1024, 4 rows, to 1700:
#     the selection has to find the needle's block among more and more.
# Below T=1024 RoPE sees positions spread over [0, 1024) (train.rope_positions=1024: four
# contiguous pieces with random gaps), so the copy learnt at T=128 already spans the
# distances of a 1024-token row; without it four seeds in seven lost the copy at a doubling.
# The learning rate is constant after a 30-step warm-up (2e-3, then 1e-3 from T=256), and
# the T=1024 stage decays it to 0 over its last 200 steps (train.decay_steps=200): the
# misses left at the constant rate were its noise (docs/LONG_CONTEXT.md).
# NSA is cpu_tiny's: 4 selected blocks of 32 tokens, 3 of them forced. Eight blocks of 16,
# scorer distillation and smaller steps in length were tried and not kept (docs/LONG_CONTEXT.md).
# Full attention is the same model with only the sliding-window branch, w=4096 (causal
# attention over the whole row, also at 4x the training length).
# Run several seeds and quote the spread; other stage lists (RECIPE_STAGES, below;
# benchmarks/needle_recipes.txt, `plain` there is the recipe without either change) over
# many seeds at once: benchmarks/needle_seeds.sh.
# The evaluation scores 16 needles per cell: with 4 (the first 4 KB of README.md as haystacks)
# a partial seed read 0.91-0.98 and 0.73-0.80 with 16 (docs/LONG_CONTEXT.md).
# RECIPE_STAGES (environment) replaces the stages: ';'-separated "T rows last_step lr every [key=value ...]",
# the key=value items passed as --set to that stage alone. EVAL_LENGTHS and EVAL_SUITES replace the
# evaluation's lengths (1024,2048,4096) and suites (needle,loss-by-position).
# Writes OUT_DIR/<variant>_s<seed>/ (the run, its eval/ with evaluation.json and the
# PNGs) and OUT_DIR/summary.txt (one line per run: time per stage, the needle accuracy by length).
set -euo pipefail
OUT=${1:?usage: bash benchmarks/needle_recipe.sh OUT_DIR [SEEDS] [VARIANTS]}
SEEDS=${2:-1}
VARIANTS=${3:-nsa,full}
PY=${PYTHON:-python}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$OUT"

COMMON=(--config cpu_tiny --dataset needle --data-path "docs/[EPR]*.md" --set train.log_every=50
        --set train.warmup=30 --set checkpoint.restore_data=false)
# seq_len global_batch last_step lr eval/save every [key=value ...]: `ropedecay` of needle_recipes.txt
STAGES=("128 16 800 2e-3 400 train.rope_positions=1024" "256 16 1100 1e-3 150 train.rope_positions=1024"
        "512 8 1400 1e-3 150 train.rope_positions=1024" "1024 4 1700 1e-3 150 train.decay_steps=200 train.min_lr=0")
if [ -n "${RECIPE_STAGES:-}" ]; then IFS=';' read -r -a STAGES <<<"$RECIPE_STAGES"; fi

for seed in ${SEEDS//,/ }; do
  for variant in ${VARIANTS//,/ }; do
    case $variant in
      nsa) model=() ;;
      full) model=(--set model.nsa.branches=win --set model.nsa.w=4096) ;;
      *) echo "error: unknown variant $variant (use nsa, full)" >&2; exit 2 ;;
    esac
    run=$OUT/${variant}_s$seed
    args=("${COMMON[@]}" "${model[@]}" --set train.seed="$seed" --out-dir "$run")
    times=()
    for stage in "${STAGES[@]}"; do
      read -r T B last lr every extra <<<"$stage"
      sets=()
      for kv in $extra; do sets+=(--set "$kv"); done
      t0=$(date +%s)
      $PY -m launch.train "${args[@]}" --set train.seq_len="$T" --set train.global_batch="$B" --steps "$last" \
        --set train.lr="$lr" --set train.min_lr="$lr" --set train.eval_every="$every" --set checkpoint.save_every="$every" \
        "${sets[@]}"
      times+=("T=$T $(($(date +%s) - t0)) s")
    done
    $PY -m launch.evaluate --ckpt "$run" --suites "${EVAL_SUITES:-needle,loss-by-position}" --lengths "${EVAL_LENGTHS:-1024,2048,4096}" \
      --samples 16 --text README.md docs/NSA.md --out "$run/eval" | tee "$run/evaluate.log"
    by_len=$($PY -c 'import sys; from experiments.needle_seeds import summary_line; print(summary_line(sys.argv[1]))' "$run")
    echo "$variant seed $seed: $(IFS=,; echo "${times[*]}") | $by_len" >>"$OUT/summary.txt"
    tail -n 1 "$OUT/summary.txt"
  done
done
