#!/usr/bin/env bash
# 2x A100 production run of the "M7C 125M" model (docs/RUNBOOK.md, "Phases").
#
#   bash launch/run_2xa100_production.sh                 # preflight, then phases 0..3, stopping at a failure
#   PHASE=1 bash launch/run_2xa100_production.sh         # one phase: preflight | 0 | 1 | 2 | 3
#   DRY_RUN=1 bash launch/run_2xa100_production.sh       # print the commands, run nothing
#
# One process drives both GPUs (jax), so there is no torchrun here. Settings, each
# overridable from the environment:
#   OUT        artifacts root (default artifacts/m7c_125m_2xa100_prod; phases 0-2 write into
#              $OUT/phase<N>, production into $OUT itself, the preflight into $OUT/preflight.json)
#   DATASET    fineweb_edu (default) or synthetic, for phases 1-3; DATA_PATH: the parquet shards
#   STEPS1, STEPS2, STEPS3   300, 1000, and the config's 50000
#   LAST       the last steps phases 1 and 2 are judged and summarised on (default 50, the runbook's)
#   REPORT_FLAGS  more flags for that judgement, launch.report's limits (e.g. "--max-step-cv 0.5" on a
#              host shared with other work, where step times spread; default none)
#   INTERCONNECT auto (default: NVLink if `nvidia-smi topo -m` shows NV#), pcie or nvlink
#   STALL_SECONDS  in-process stall watchdog (default 1800); WATCHDOG=0 skips launch.watchdog in phase 3
#   ALLOW_BUSY_GPU=1  start although a GPU holds another process's memory (the preflight refuses, else)
#   PYTHON     the interpreter (default python)
set -euo pipefail

cd "$(dirname "$0")/.."
PHASE=${PHASE:-all}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python}
CONFIG=${CONFIG:-a100_pcie}
OUT=${OUT:-artifacts/m7c_125m_2xa100_prod}
DATASET=${DATASET:-fineweb_edu}
DATA_PATH=${DATA_PATH:-}
STEPS1=${STEPS1:-300}
STEPS2=${STEPS2:-1000}
STEPS3=${STEPS3:-}
LAST=${LAST:-50}
REPORT_FLAGS=${REPORT_FLAGS:-}
STALL_SECONDS=${STALL_SECONDS:-1800}
WATCHDOG=${WATCHDOG:-1}
INTERCONNECT=${INTERCONNECT:-auto}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD

# Runbook defaults. Gradients are all-reduced in bf16 (NSA_DDP_COMPRESS=bf16) and XLA
# combines all-reduces up to NSA_DDP_BUCKET_MB (--xla_gpu_all_reduce_combine_threshold_bytes).
export NSA_DDP_COMPRESS=${NSA_DDP_COMPRESS:-bf16}
export NSA_DDP_BUCKET_MB=${NSA_DDP_BUCKET_MB:-25}

if [[ $INTERCONNECT == auto ]]; then
  INTERCONNECT=pcie
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi topo -m 2>/dev/null | grep -Eq '\bNV[0-9]+\b'; then
    INTERCONNECT=nvlink
  fi
fi
if [[ $INTERCONNECT == pcie ]]; then
  # XLA's GPU collectives are NCCL: the torch runbooks' PCIe settings apply unchanged.
  export NCCL_ALGO=${NCCL_ALGO:-Ring}
  export NCCL_PROTO=${NCCL_PROTO:-Simple}
  export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1}
fi

say() { printf '[run_2xa100 %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Prints a command (with the NSA_/NCCL_/XLA_ variables in force) and runs it unless DRY_RUN=1.
run() {
  local envs
  envs=$(env | grep -E '^(NSA_|NCCL_|XLA_FLAGS=)' | sort | tr '\n' ' ' || true)
  printf '+ %s%s\n' "$envs" "$*" >&2
  if [[ $DRY_RUN == 1 ]]; then return 0; fi
  "$@"
}

train() {  # train <out_dir> <args...>
  local dir=$1; shift
  run "$PYTHON" -m launch.train --config "$CONFIG" --out-dir "$dir" \
    --set ops.stall_seconds="$STALL_SECONDS" "$@"
}

need_data() {  # called directly, not in $(...), so that its exit ends the script
  if [[ $DATASET != synthetic && -z $DATA_PATH && $DRY_RUN != 1 ]]; then
    say "DATA_PATH is empty: set it to the directory of the $DATASET parquet shards (or DATASET=synthetic)"
    exit 2
  fi
}

data_args() {
  if [[ $DATASET == synthetic ]]; then
    echo "--dataset synthetic"
  else
    echo "--dataset $DATASET --loader-timeout 120 --set data.path=${DATA_PATH:-/path/to/shards}"
  fi
}

summary() {  # summary <out_dir>: throughput of the last $LAST rows, memory peak, gates; by column name
  [[ $DRY_RUN == 1 ]] && return 0
  "$PYTHON" - "$1" "$LAST" <<'PY'
import csv, json, pathlib, statistics as st, sys
out = pathlib.Path(sys.argv[1])
rows = list(csv.DictReader(open(out / "training.csv"))) if (out / "training.csv").exists() else []
if rows:
    last = rows[-int(sys.argv[2]):]
    toks = [float(r["toks_per_s"]) for r in last]
    secs = [float(r["step_time_s"]) for r in last]
    # As launch.report: total tokens / total step time, and the median step (a mean of
    # per-step rates overweights the fast steps).
    rate = sum(t * s for t, s in zip(toks, secs)) / max(sum(secs), 1e-9)
    spread = st.stdev(toks) if len(toks) > 1 else 0.0
    line = f"{out}: steps {rows[0]['step']}..{rows[-1]['step']}, toks_per_s last {len(toks)}: " \
           f"{rate:,.0f} (median step {st.median(toks):,.0f}; per-step mean {st.mean(toks):,.0f}, " \
           f"stdev {spread:,.0f}), loss {float(rows[-1]['loss']):.4f}"
    if rows[-1].get("gate_entropy"):
        line += ", gate_entropy " + rows[-1]["gate_entropy"] + ", sel_far_frac " + rows[-1]["sel_far_frac"]
    print(line)
for hb in sorted(out.glob("heartbeat_rank*.jsonl")):
    peak, source = 0, "?"
    for ln in open(hb):
        try:
            mem = json.loads(ln).get("memory") or {}
        except ValueError:
            continue
        source = mem.get("source", source)
        peak = max(peak, mem.get("peak_bytes_in_use") or mem.get("bytes_in_use") or 0)
    print(f"{hb.name}: peak memory {peak / 2**30:.2f} GiB ({source})")
for name in (".HALT", ".anomaly_type"):
    if (out / name).exists():
        print(f"{name}: {(out / name).read_text().strip()}")
PY
}

check_phase() {  # check_phase <out_dir> <steps> [judge]: a step_end for the last step, no .HALT; with
  # judge, launch.report --strict over the last $LAST steps as well (loss, step-time spread, memory plateau,
  # gates, heartbeats: each GO)
  [[ $DRY_RUN == 1 ]] && return 0
  local dir=$1 steps=$2
  if [[ -e $dir/.HALT ]]; then
    say "FAIL: $dir/.HALT: $(cat "$dir/.HALT")"; return 1
  fi
  if ! "$PYTHON" - "$dir" "$steps" <<'PY'
import json, pathlib, sys
out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for hb in sorted(out.glob("heartbeat_rank*.jsonl")) or [out / "heartbeat_rank0.jsonl"]:
    ends = set()
    for line in (hb.read_text().splitlines() if hb.exists() else []):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "step_end":
            ends.add(ev.get("step"))
    if steps not in ends:
        sys.exit(f"FAIL: no step_end for step {steps} in {hb}")
PY
  then
    return 1
  fi
  # shellcheck disable=SC2086  # REPORT_FLAGS: several words on purpose
  if [[ ${3:-} == judge ]] && ! "$PYTHON" -m launch.report "$dir" --strict --last "$LAST" $REPORT_FLAGS; then
    say "FAIL: launch.report $dir --strict: a criterion is not GO (above; report in $dir/report)"; return 1
  fi
  say "ok: $dir reached step $steps on every rank${3:+; launch.report: GO}"
}

preflight() {
  run mkdir -p "$OUT"
  if command -v nvidia-smi >/dev/null 2>&1; then
    run nvidia-smi -L
    run nvidia-smi topo -m || true
  else
    say "nvidia-smi not found: no NVIDIA driver on this machine"
  fi
  say "interconnect: $INTERCONNECT"
  local busy=()
  [[ ${ALLOW_BUSY_GPU:-0} == 1 ]] && busy=(--allow-busy)
  # preflight.json, nvidia_smi_q.xml, each GPU's PCIe link; refuses a GPU that holds another process's memory
  run "$PYTHON" -m launch.preflight "$OUT" "${busy[@]}"
}

phase0() {  # DP wiring and the bf16 path: synthetic data, 1 step
  train "$OUT/phase0" --overwrite-checkpoints --dataset synthetic --steps 1 --set logging.tensorboard=false
  check_phase "$OUT/phase0" 1
}

phase1() {  # real data I/O and the loop: 300 steps
  need_data
  # shellcheck disable=SC2046
  train "$OUT/phase1" --overwrite-checkpoints $(data_args) --steps "$STEPS1" --set logging.tensorboard=false
  check_phase "$OUT/phase1" "$STEPS1" judge && summary "$OUT/phase1"
}

phase2() {  # confidence before the long run: 1000 steps, one evaluation
  need_data
  # shellcheck disable=SC2046
  train "$OUT/phase2" --overwrite-checkpoints $(data_args) --steps "$STEPS2" --set logging.tensorboard=false
  check_phase "$OUT/phase2" "$STEPS2" judge && summary "$OUT/phase2"
}

phase3() {  # production: the config's 50k steps, TensorBoard on, resumes from $OUT's checkpoints
  need_data
  local wd_pid=""
  if [[ $WATCHDOG == 1 && $DRY_RUN != 1 ]]; then
    mkdir -p "$OUT"
    "$PYTHON" -m launch.watchdog --dir "$OUT" --halt 1 --interval 30 --fresh >>"$OUT/watchdog.log" 2>&1 &
    wd_pid=$!
    say "launch.watchdog pid $wd_pid -> $OUT/watchdog.log"
  elif [[ $WATCHDOG == 1 ]]; then
    run "$PYTHON" -m launch.watchdog --dir "$OUT" --halt 1 --interval 30 --fresh
  fi
  local status=0
  # shellcheck disable=SC2046
  train "$OUT" $(data_args) ${STEPS3:+--steps "$STEPS3"} || status=$?
  if [[ -n $wd_pid ]]; then
    kill "$wd_pid" 2>/dev/null || true
  fi
  summary "$OUT"
  if [[ $status == 75 ]]; then
    say "the in-process stall watchdog ended the run (stackdump_*.txt in $OUT); rerun PHASE=3 to resume"
  fi
  return "$status"
}

case $PHASE in
  preflight) preflight ;;
  0) phase0 ;;
  1) phase1 ;;
  2) phase2 ;;
  3) phase3 ;;
  all)
    preflight
    for p in 0 1 2 3; do
      say "phase $p"
      "phase$p" || { say "phase $p failed: stopping (docs/RUNBOOK.md, Triage)"; exit 1; }
    done ;;
  *) say "PHASE must be preflight, 0, 1, 2, 3 or all; got '$PHASE'"; exit 2 ;;
esac
