#!/usr/bin/env bash
# GPU validation: on a host with a CUDA GPU, from the repository root.
#
#   bash benchmarks/gpu_validate.sh OUT_DIR [PART ...]
#
# PARTS (default: env tests kernels):
#   env        versions, devices, nvidia-smi
#   tests      the Pallas kernel tests compiled through Triton (not interpreted)
#              against the float64 per-token reference, the NSA layer (Pallas kernels)
#              against the naive reference, and Pallas-vs-XLA training steps
#   kernels    python -m benchmarks.bench_kernels: Pallas vs XLA vs dense, fwd and fwd+bwd, bf16
#   selection  the selection kernels side by side in one process, fwd and fwd+bwd, against cuDNN at
#              SELECTION_SEQ_LENS (default 8192,32768,65536): gather (the layer's tiles,
#              kernels.SELECTION_KERNELS) and the SELECTION_VARIANTS (';'-separated
#              SelectionBlockSizes, each a candidate sel[...]); then the same at 32768 with runs of R
#              queries sharing a selection for each R in SELECTION_RUNS (default 8; --idx-runs R: at
#              P=4 runs of 8 load 0.25 of the tiles, runs of 2 0.43 at 32k, as neighbours that share do)
#   window     the window branch: Pallas flash vs cuDNN's sliding window (local_window_size) vs
#              dense cuDNN, fwd and fwd+bwd, with the outputs compared
#   compressed the compressed branch: the layer's Pallas attention with scoring and top-n, the Pallas
#              attention alone, and cuDNN's causal attention over the regrouped compressed sequence
#              (kernels/cudnn.py), fwd and fwd+bwd, against dense cuDNN at COMPRESSED_SEQ_LENS
#              (default 8192,32768,65536)
#   flash      the flash kernels (window, compressed attention, block-sparse selection) with each of
#              FLASH_VARIANTS (';'-separated FlashBlockSizes; default two and three pipeline stages, each
#              compiled without spills for sm_80 and sm_90 on the CPU host) beside today's tiles and cuDNN, fwd and
#              fwd+bwd: window and compressed at FLASH_SEQ_LENS (default 8192,32768,65536), the
#              block-sparse kernel at T=2048 with FLASH_BATCH rows (default 16, the training step's shape)
#   attention  python -m benchmarks.bench_attention: the NSA layer vs dense attention over T
#   layer      python -m benchmarks.export_report (largest tensor and kernel count of the layer's
#              fwd+bwd lowered for CUDA, T=LAYER_SEQ_LEN) then bench_attention fwd+bwd at
#              T=LAYER_SEQ_LENS (where the block-score tensors used to dominate)
#   train      python -m benchmarks.bench_train: a100_pcie tokens/s and MFU against the measured bf16 peak,
#              as configured and with each of TRAIN_VARIANTS (';'-separated override sets; default
#              logging.aux_stats=false: what the logged statistics cost; parallel.overlap_reduce=true:
#              the gradient reduction inside the backward; model.nsa.scorer=rescore: launch.convert's scorer)
#   smoke      python -m launch.train --config a100_pcie for a few steps, then resumed from its
#              checkpoint (artifacts in OUT_DIR/run)
#   profile    python -m benchmarks.profile_step: where one NSA layer's fwd+bwd time goes (T=PROFILE_SEQ_LEN)
#   stepprof   python -m benchmarks.profile_step on the a100_pcie train step (PROFILE_BATCH rows,
#              default the config's): kernels by name and time. The profile parts keep their traces
#              in OUT_DIR (<part>_trace): `profile_step --read-trace` reads them on any machine
#   peak       the NSA layer alone at T=PEAK_SEQ_LEN (default 65536), forward then fwd+bwd, in
#              its own process: the device's measured high-water mark beside the compiled memory
#   kv         python -m experiments.kv_recall_ablation: NSA vs NSA without selection (KV_ARGS adds flags)
#   needle     python -m launch.stages: whole runs of the needle recipes (configs/recipes/needle.yaml),
#              several recipes over seeds side by side (NEEDLE_RECIPES, default needle:plain,rope,ropedecay;
#              NEEDLE_SEEDS, default 1,2,3,4; NEEDLE_P runs at a time, default 16; NEEDLE_DEADLINE seconds,
#              default 480), fp32 matmuls at full precision as on the CPU the recipe is for, and XLA's
#              autotuning off (16 runs compiling at once spent 7 minutes autotuning gemm fusions
#              without reaching a first step); the runs' figures packed into OUT_DIR/needle.tgz
#              (`python -m experiments.needle_seeds DIR` reads them)
#
# Each part has its own time limit (seconds, PART_TIMEOUT_<part>), writes OUT_DIR/<part>.log
# (and .json where the benchmark has one) and a line to OUT_DIR/summary.txt; a failing
# part does not stop the others. PYTHON picks the interpreter (default python3).
#
# Extra flags by part: TEST_ARGS (pytest, e.g. "-n 8 --timeout 60"; default -x), TEST_FILES and TEST_K
# (tests: which files, and pytest -k; default "not lowers"), KERNEL_ARGS
# (kernels; e.g. "--impls gather,blocksparse,dense"), ATTN_ARGS (attention,
# e.g. "--dense cudnn"), TRAIN_BATCHES (train: comma-separated global batches, one row each).
# DEADLINE=S: no part starts after S seconds and each part's limit is cut to what is left
# (for a machine lent by the minute). ARCHIVE=FILE.tgz: OUT_DIR is packed into FILE after every
# part, so what finished survives a run stopped from outside; the profile traces (*_trace) stay out of it
# unless ARCHIVE_TRACES=1 (a 64k trace can pass what a lent machine hands back).
set -uo pipefail

out=${1:?usage: bash benchmarks/gpu_validate.sh OUT_DIR [PART ...]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(env tests kernels)
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
# Leave memory to the benchmarks' own probes of what is free.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}

deadline=${DEADLINE:-0}

pack() {
    local skip=(--exclude='*_trace')
    [ "${ARCHIVE_TRACES:-0}" = 1 ] && skip=()
    [ -n "${ARCHIVE:-}" ] && tar czf "$ARCHIVE.tmp" "${skip[@]}" -C "$(dirname "$out")" "$(basename "$out")" && mv "$ARCHIVE.tmp" "$ARCHIVE"
    return 0
}

run_part() {
    local name=$1 limit=$2
    shift 2
    local var="PART_TIMEOUT_$name"
    limit=${!var:-$limit}
    if [ "$deadline" -gt 0 ]; then
        local left=$((deadline - SECONDS))
        if [ "$left" -lt 20 ]; then
            echo "$name skipped: ${left}s left before DEADLINE=$deadline" | tee -a "$out/summary.txt"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    local line="$name rc=$rc $((SECONDS - t0))s"
    echo "$line" | tee -a "$out/summary.txt"
    tail -n "${TAIL_LINES:-25}" "$out/$name.log"
    pack
}

for part in "${parts[@]}"; do
    case $part in
    env)
        run_part env 120 bash -c "nvidia-smi; $PY -c 'import sys, jax, jaxlib, flax, optax, numpy; \
print(sys.version); print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"flax\", flax.__version__, \
\"optax\", optax.__version__, \"numpy\", numpy.__version__); print(jax.devices())'; \
$PY -m pip list 2>/dev/null | grep -i -E '^(jax|flax|optax|orbax|grain|tensorboard|triton|numpy|pytest)'"
        ;;
    tests)
        # shellcheck disable=SC2086
        run_part tests 420 "$PY" -m pytest -q -p no:cacheprovider ${TEST_ARGS:--x} ${TEST_FILES:-tests/test_kernels_pallas.py \
            tests/test_pallas_model.py tests/test_nsa_layer.py tests/test_block_scores.py tests/test_blocksparse.py} \
            -k "${TEST_K:-not lowers}"
        ;;
    kernels)
        # shellcheck disable=SC2086
        run_part kernels 420 "$PY" -m benchmarks.bench_kernels --backward ${KERNEL_ARGS:-} \
            --seq-lens "${KERNEL_SEQ_LENS:-2048,8192,32768}" --json "$out/kernels.json"
        ;;
    selection)
        # Default: the pipelining depths of today's tiles (1 stage: less shared memory per program, 3: deeper
        # prefetch) and the multi-position tilings that compile without spills (lab/2026-11-27-flash-tilings.md).
        variants=${SELECTION_VARIANTS:-"positions=1,num_warps=1,num_stages=1;positions=1,num_warps=1,num_stages=3;\
positions=2,num_warps=1;positions=4,num_warps=2"}
        impls="gather,dense,$(echo "$variants" | sed 's/\([^;]*\)/sel[\1]/g; s/;/,/g')"
        # shellcheck disable=SC2086
        run_part selection 420 "$PY" -m benchmarks.bench_kernels --backward --branches selection --no-check \
            --impls "$impls" --selection-variants "$variants" \
            --seq-lens "${SELECTION_SEQ_LENS:-8192,32768,65536}" --json "$out/selection.json"
        for runs in ${SELECTION_RUNS:-8}; do
            run_part "selection_runs$runs" 300 "$PY" -m benchmarks.bench_kernels --backward --branches selection \
                --no-check --idx-runs "$runs" --impls "$impls" --selection-variants "$variants" --seq-lens 32768 \
                --json "$out/selection_runs$runs.json"
        done
        ;;
    window)
        run_part window 300 "$PY" -m benchmarks.bench_kernels --backward --branches window --impls pallas,cudnn,dense \
            --seq-lens "${WINDOW_SEQ_LENS:-2048,8192,32768,65536}" --json "$out/window.json"
        ;;
    compressed)
        run_part compressed 300 "$PY" -m benchmarks.bench_kernels --backward --branches compressed \
            --impls pallas,pallas-attn,cudnn-attn,dense --seq-lens "${COMPRESSED_SEQ_LENS:-8192,32768,65536}" \
            --json "$out/compressed.json"
        ;;
    flash)
        # Default: two and three pipeline stages (the compressed kernels run three, the window two).
        fv=${FLASH_VARIANTS:-"num_stages=2;num_stages=3"}
        win="pallas,cudnn,$(echo "$fv" | sed 's/\([^;]*\)/pallas[\1]/g; s/;/,/g')"
        cmp="pallas-attn,cudnn-attn,$(echo "$fv" | sed 's/\([^;]*\)/pallas-attn[\1]/g; s/;/,/g')"
        bsp="blocksparse,$(echo "$fv" | sed 's/\([^;]*\)/blocksparse[\1]/g; s/;/,/g')"
        run_part flash 300 "$PY" -m benchmarks.bench_kernels --backward --branches window,compressed --no-check \
            --impls "$win,$cmp,dense" --flash-variants "$fv" --seq-lens "${FLASH_SEQ_LENS:-8192,32768,65536}" \
            --json "$out/flash.json"
        run_part flash_bsp 120 "$PY" -m benchmarks.bench_kernels --backward --branches selection --no-check \
            --impls "$bsp,dense" --flash-variants "$fv" --seq-lens 2048 --batch "${FLASH_BATCH:-16}" \
            --json "$out/flash_bsp.json"
        ;;
    attention)
        # shellcheck disable=SC2086
        run_part attention 540 "$PY" -m benchmarks.bench_attention --backward ${ATTN_ARGS:-} \
            --seq-lens "${ATTN_SEQ_LENS:-2048,8192,32768,65536}" --json "$out/attention.json"
        ;;
    layer)
        run_part layer 540 bash -c "$PY -m benchmarks.export_report --seq-len ${LAYER_SEQ_LEN:-65536} \
            --json $out/export_report.json && $PY -m benchmarks.bench_attention --backward \
            --seq-lens ${LAYER_SEQ_LENS:-32768,65536} --json $out/layer.json"
        ;;
    train)
        batches=(); [ -n "${TRAIN_BATCHES:-}" ] && batches=(--global-batches "$TRAIN_BATCHES")
        run_part train 420 "$PY" -m benchmarks.bench_train --configs a100_pcie --steps 5 \
            --peak-n 8192 "${batches[@]}" --variants "${TRAIN_VARIANTS:-logging.aux_stats=false;parallel.overlap_reduce=true;model.nsa.scorer=rescore}" --json "$out/train.json"
        ;;
    smoke)
        # A fresh run that saves at step 10 and 20, then the same command with more steps:
        # it must resume from the step-20 orbax checkpoint.
        n=${SMOKE_STEPS:-20}
        train="$PY -m launch.train --config a100_pcie --out-dir $out/run --set train.log_every=5 \
            --set checkpoint.save_every=10"
        run_part smoke 420 env NSA_TB_DISABLE=1 bash -c "$train --steps $n --overwrite-checkpoints && \
            $train --steps $((n + 10)) && tail -n 4 $out/run/training.csv"
        ;;
    profile)
        run_part profile 300 "$PY" -m benchmarks.profile_step --layer --backward --config a100_pcie \
            --set model.dtype=bfloat16 --seq-len "${PROFILE_SEQ_LEN:-32768}" --steps 2 --top 20 \
            --trace-dir "$out/profile_trace" --json "$out/profile.json"
        ;;
    stepprof)
        rows=(); [ -n "${PROFILE_BATCH:-}" ] && rows=(--set "train.global_batch=$PROFILE_BATCH")
        run_part stepprof 300 "$PY" -m benchmarks.profile_step --config a100_pcie "${rows[@]}" --steps 2 \
            --top 25 --trace-dir "$out/stepprof_trace" --json "$out/stepprof.json"
        ;;
    peak)
        run_part peak 300 "$PY" -m benchmarks.bench_attention --backward --dense none \
            --seq-lens "${PEAK_SEQ_LEN:-65536}" --iters 1 --json "$out/peak.json"
        ;;
    kv)
        # shellcheck disable=SC2086
        run_part kv 540 "$PY" -m experiments.kv_recall_ablation --json "$out/kv.json" ${KV_ARGS:-}
        ;;
    needle)
        run_part needle "$((${NEEDLE_DEADLINE:-480} + 60))" env JAX_DEFAULT_MATMUL_PRECISION=highest NSA_TB_DISABLE=1 \
            XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
            "$PY" -m launch.stages --recipe "${NEEDLE_RECIPES:-needle:plain,rope,ropedecay}" --variants nsa \
            --seeds "${NEEDLE_SEEDS:-1,2,3,4}" --parallel "${NEEDLE_P:-16}" --deadline "${NEEDLE_DEADLINE:-480}" \
            --eval-suites needle --eval-lengths 1024 --out "$out/needle" --archive "$out/needle.tgz"
        ;;
    *)
        echo "unknown part: $part (env tests kernels selection window compressed flash attention layer train smoke profile stepprof peak kv needle)" >&2
        exit 2
        ;;
    esac
done
