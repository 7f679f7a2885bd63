#!/usr/bin/env bash
# Many whole runs of the needle recipe side by side, to compare recipes over seeds
# (docs/LONG_CONTEXT.md). Each run is benchmarks/needle_recipe.sh for one (recipe, seed):
# a few small processes one after the other, so a GPU host takes a dozen at once. From
# the repository root:
#
#   P=12 DEADLINE=540 bash benchmarks/needle_seeds.sh OUT_DIR SEEDS RECIPES_FILE
#
# SEEDS: comma list. RECIPES_FILE: one recipe a line, "NAME|STAGES" (STAGES as
# needle_recipe.sh's RECIPE_STAGES; empty: the recipe's own); '#' lines are skipped.
# Runs start seed by seed, each seed's recipes together, so that a DEADLINE cut leaves
# every recipe with the same seeds; at most P (default 8) at a time. DEADLINE=S: no run
# starts after S seconds and a run still going then is stopped (marked in its
# summary.txt). EVAL_LENGTHS, EVAL_SUITES and PYTHON go through to needle_recipe.sh.
# Writes OUT_DIR/NAME/nsa_sSEED/ (the run) and OUT_DIR/NAME/summary.txt, then
# OUT_DIR.tgz (or ARCHIVE): OUT_DIR without checkpoints, TensorBoard files or heartbeats. Read it with
# `python -m experiments.needle_seeds OUT_DIR`.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/needle_seeds.sh OUT_DIR SEEDS RECIPES_FILE}
SEEDS=${2:?usage: bash benchmarks/needle_seeds.sh OUT_DIR SEEDS RECIPES_FILE}
RECIPES=${3:?usage: bash benchmarks/needle_seeds.sh OUT_DIR SEEDS RECIPES_FILE}
P=${P:-8}
deadline=${DEADLINE:-0}
[ -f "$RECIPES" ] || { echo "error: recipes file $RECIPES not found" >&2; exit 2; }
mkdir -p "$OUT"

names=() stages=()
while IFS='|' read -r name st; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  names+=("$name") stages+=("$st")
done <"$RECIPES"
[ ${#names[@]} -gt 0 ] || { echo "error: no recipe in $RECIPES (lines NAME|STAGES)" >&2; exit 2; }

run_one() {  # name stages seed limit start(SECONDS)
  local dir=$OUT/$1
  mkdir -p "$dir"
  RECIPE_STAGES=$2 timeout --signal=TERM --kill-after=10 "$4" bash benchmarks/needle_recipe.sh "$dir" "$3" nsa \
    >"$dir/s$3.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "nsa seed $3: stopped rc=$rc after $((SECONDS - $5)) s" >>"$dir/summary.txt"
  echo "$(date +%T) done $1 seed $3 rc=$rc ($((SECONDS - $5)) s)"
}

for seed in ${SEEDS//,/ }; do
  for i in "${!names[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$P" ]; do sleep 2; done
    limit=100000
    if [ "$deadline" -gt 0 ]; then
      limit=$((deadline - SECONDS))
      [ "$limit" -lt 60 ] && { echo "$(date +%T) skipped ${names[$i]} seed $seed: DEADLINE"; continue; }
    fi
    echo "$(date +%T) start ${names[$i]} seed $seed"
    run_one "${names[$i]}" "${stages[$i]}" "$seed" "$limit" "$SECONDS" &
  done
done
wait
tar czf "${ARCHIVE:-$OUT.tgz}" --exclude=checkpoints --exclude=tb --exclude='heartbeat_*' -C "$(dirname "$OUT")" "$(basename "$OUT")"
cat "$OUT"/*/summary.txt 2>/dev/null
