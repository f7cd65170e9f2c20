#!/usr/bin/env bash
# Everything a lent GPU machine is for, as ONE prepared command (a session gets ~15 minutes
# of device time and one call may run at most 10), results copied to $OUT as they appear:
#
#   bash scripts/gpu_session.sh            # on the GPU machine (the device tool's `run`)
#   DEVICE=cpu DEADLINE=150 REPRO_BUDGET=smoke ... bash scripts/gpu_session.sh  # a CPU dry run (tested)
#
# 1. data: RS-Fashion realisations 0..2 (the protocol's trials 0..2), one process each;
# 2. (a measuring call: FASTPATH_SETTINGS etc. are off by default, see below)
#    train/fastpath.py, alone on the GPU: the training step and evaluation of rst_cnn_fb and
#    the CNN in FASTPATH_SETTINGS; with FASTPATH_ARGS "--profile --compile --align-probe" also
#    a torch.profiler profile of the fastest training step (profile.md: device busy fraction,
#    launches, the kernels that take the time), each RST conv alone at its widths and at
#    widths rounded up to 8 (align.md: does aligning pay?) and torch.compile of that step;
#    FASTPATH_ALIGNED: the grid again at other widths (the runs below train with REPRO_FLAGS);
#    train/step_cost.py (STEP_COST_ARGS) and train/kernel_probe.py (KERNEL_PROBE_ARGS: each
#    RST conv alone with the fused Triton kernels and with torch's operators, kernels.md);
# 3. the paper's protocol (train/reproduce.py --budget REPRO_BUDGET, N_tr REPRO_SIZES) as
#    SHARDS side by side, each shard one process with its own --deadline (a run cut off keeps
#    last.pt and resumes next time from its resume-<run>.tgz), plus tests/test_cuda.py.
#    Finished runs land in the committed record RESULTS (results/reproduce/rs-fashion-full).
#    Beside them, on the machine's CPU cores: export/split_check.py, each copy the app serves
#    (SPLIT_SERVED: the int8 file for single images, the checkpoint by eager torch for sweeps)
#    against its float32 checkpoint (SPLIT_CHECKPOINT, eager on the GPU) on the whole test
#    split, one after the other, resumable: each goes on from
#    results/shipped/split-check-NAME.state.npz and the float32 logits both share,
#    eager-logits-CHECKPOINT.npz (commit the files that come back in split-check.tgz
#    there, or carry them in RESUME/split-check).
# 4. train/k_sweep.py --report: the basis-size sweep's table and plot (accuracy against eval
#    time on this card) from the record; its runs are shards like any other, e.g.
#    REPRO_SIZES=5000 SHARDS="rst_cnn_fb_k6,rst_cnn_fb_k9@3 rst_cnn_fb_k17,rst_cnn_fb_ref@3 rst_cnn_fb_nr4@3".
#    Beside them, the shipped rst_cnn_fb on 4,096 test images (KERNEL_CHECK_LIMIT) through the
#    fused Triton kernels and through torch's operators (logs/kernels-check-*.json).
# Comes back in $OUT: logs.tgz (logs/; fastpath/: fastpath.md, fastpath.json, profile.md, kernels.md,
# align.md, step-cost.md; k-sweep/: sweep.md, sweep.json, accuracy-vs-time.png), record.tgz
# (RESULTS: each finished run's summary and metrics, kept as each run finishes; not the runs a
# shard parks in RESULTS/unfinished/, ~8 MB each, which come back as resume-*.tgz), split-check.tgz, and
# resume-<run>.tgz (each unfinished run's folder: unpack all into .gpu_resume/ and carry the
# run folders into the next call, RESUME; with .gpu_data, about four runs fit a call's 64 MiB).
#
# The machine has no apt and no internet: carry the Fashion-MNIST IDX files in .gpu_data/
# (mkdir -p .gpu_data && cp /usr/share/datasets/fashion-mnist/*.gz .gpu_data/).
set -uo pipefail

DEVICE="${DEVICE:-cuda}"
DEADLINE="${DEADLINE:-540}"          # seconds from the start of this script
REPRO_BUDGET="${REPRO_BUDGET:-full}"
REPRO_SIZES="${REPRO_SIZES:-2000}"
RESULTS="${RESULTS:-results/reproduce/rs-fashion-$REPRO_BUDGET}"
# one process per shard: models (comma-separated) @ trials (N: trials 0..N-1; A-B: trials A..B,
# so shards side by side train different trials of one model); cells in RESULTS are skipped.
# The default trains the N_tr 2000 table's next RST-CNN trial (rst_cnn_sl's trial 2):
# every cheaper N_tr 2000 and 5000 cell (cnn, rot_cnn, scale_cnn) has three trials, trained
# on the CPU, as has rst_cnn_fb's N_tr 2000 cell; rst_cnn_sl's trials 0-1 are recorded
# there. An N_tr 2000 epoch is 16 steps, not 40: rst_cnn_fb alone took ~470 s a run at
# 5000, so ~190 s at 2000, rst_cnn_sl ~1.4x that (on the CPU); two side by side are not yet
# measured and may want two calls.
# The last window ran cheap peers at 6.3-6.5 s an epoch each with four to six side by side
# (13.7 s with nine; nine did not finish in 365 s). Runs left unfinished are lost unless
# the next call, or a session that keeps their resume-*.tgz, carries them.
# An RST run at N_tr 5000 wants a call of its own (rst_cnn_fb ~470 s alone, rst_cnn_plus_* ~3x
# that, so resumed over calls): REPRO_SIZES=5000 SHARDS="rst_cnn_plus_fb@0-0".
# A run resumes from .gpu_resume/ when its folder is carried there, or from the committed
# record's unfinished/ (train/reproduce.py parks what a CPU sitting left), else starts afresh.
SHARDS="${SHARDS-rst_cnn_sl@2-2}"
# train/fastpath.py's names, ';'-separated: bf16 with the fast paths' fused Triton kernels
# and with the torch operators they replace (the faster one trains the shards below);
# empty (the default): no fast-path run. The measurements of 2. run one after the other
# before any shard (up to FASTPATH_TIMEOUT each; 118-132 s of the last window's first call), so
# a measuring call sets them, e.g. FASTPATH_SETTINGS="bf16;bf16 torch" STEP_COST_ARGS="--batch
# 128 --bf16" KERNEL_PROBE_ARGS="--batch 128 --bf16" SHARDS="" (the fast path alone)
FASTPATH_SETTINGS="${FASTPATH_SETTINGS-}"
# e.g. "--profile --compile --align-probe" (the compile alone can take minutes)
# (default: the profile, so that the fused kernels' own times come back in profile.md)
FASTPATH_ARGS="${FASTPATH_ARGS---profile}"
FASTPATH_TIMEOUT="${FASTPATH_TIMEOUT:-150}"
# a second fast-path run at these widths (e.g. "(72,136,208)", rst_cnn_fb's rounded up to 8):
# the whole training step with aligned channels, beside align.md's per-layer probe
FASTPATH_ALIGNED="${FASTPATH_ALIGNED:-}"
# train/step_cost.py: FLOPs and bytes moved by one bf16 training step, counted on this device,
# and the floor they set at the card's peaks (empty: skip)
STEP_COST_ARGS="${STEP_COST_ARGS-}"
# train/kernel_probe.py: each RST convolution alone, fused kernels against torch's operators
# (time, bytes moved, GB/s; fastpath/kernels.md; empty: skip)
KERNEL_PROBE_ARGS="${KERNEL_PROBE_ARGS-}"
K_SWEEP="${K_SWEEP-1}"  # the sweep's report (every sweep model, from the record); empty: skip
K_SWEEP_SIZE="${K_SWEEP_SIZE:-5000}"  # the N_tr the sweep compares at (its runs: REPRO_SIZES=5000)
SPLIT_CHECKPOINT="${SPLIT_CHECKPOINT-models/rst_cnn_fb.pt}"  # empty: no split check
SPLIT_SERVED="${SPLIT_SERVED:-models/rst_cnn_fb.int8.onnx models/rst_cnn_fb.pt}"  # in turn
SPLIT_THREADS="${SPLIT_THREADS:-6}"
SPLIT_LIMIT="${SPLIT_LIMIT:-}"       # only the last N test images (empty: the whole split)
# the shipped rst_cnn_fb (KERNEL_CHECK_CHECKPOINT) on its first N test images with and without
# the fused kernels
# (logs/kernels-check-{torch,triton}.json; empty: skip)
KERNEL_CHECK_LIMIT="${KERNEL_CHECK_LIMIT-4096}"
KERNEL_CHECK_CHECKPOINT="${KERNEL_CHECK_CHECKPOINT:-models/rst_cnn_fb.pt}"
# the protocol's precision, fixed (not taken from this call's fastest setting): a resumed run
# must keep the settings it began with, and every recorded run so far is bfloat16 autocast
REPRO_FLAGS="${REPRO_FLAGS---bf16}"
RESUME="${RESUME:-.gpu_resume}"      # unfinished runs carried from the last call (resume-*.tgz)
DATA_ROOT="${DATA_ROOT:-.gpu_data}"  # the Fashion-MNIST IDX files
OUT="${OUT:-$PWD/runs/gpu-out}"
WORK="${WORK:-/tmp/rstcnn-gpu}"
PY="${PY:-}"
if [[ -z "$PY" ]]; then
    for cand in /opt/torch/.venv/bin/python python3; do
        if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
    done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RSTCNN_DATA="$WORK/data"
mkdir -p "$OUT" "$WORK/logs" "$WORK/reproduce" "$RESULTS"
LOG="$WORK/logs/session.log"
log() { echo "[gpu +$((SECONDS))s] $*" | tee -a "$LOG"; }
# carried runs, but never over a run this machine already holds (a warm machine's own copy is
# at least as far on as anything carried back into a later call)
for run in "$RESUME"/*/*/*/; do
    [[ -f "$run/last.pt" ]] || continue
    held="$WORK/reproduce/${run#"$RESUME"/}"
    [[ -f "$held/last.pt" ]] || { mkdir -p "$held" && cp -r "$run". "$held"; }
done

collect() {  # what has appeared so far -> $OUT (comes back even if the call is cut off)
    local run
    (cd "$WORK" && tar czf "$OUT/fastpath.tmp" $(ls -d fastpath fastpath-aligned logs k-sweep 2>/dev/null)) \
        && mv -f "$OUT/fastpath.tmp" "$OUT/logs.tgz"
    tar czf "$OUT/record.tmp" --exclude=unfinished "$RESULTS" && mv -f "$OUT/record.tmp" "$OUT/record.tgz"
    if [[ -d "$WORK/split-check" ]]; then
        (cd "$WORK" && tar czf "$OUT/split.tmp" split-check) && mv -f "$OUT/split.tmp" "$OUT/split-check.tgz"
    fi
    rm -f "$OUT"/resume-*.tgz  # one file per unfinished run (a file comes back up to 16 MiB)
    for run in "$WORK"/reproduce/*/*/*/; do
        [[ -f "$run/last.pt" && ! -f "$run/summary.json" ]] || continue
        (cd "$WORK/reproduce" && tar czf "$OUT/resume-$(basename "$run").tgz" \
            --exclude='.lock' --exclude='.*.tmp' "${run#"$WORK/reproduce/"}")
    done
}

log "python $PY, device $DEVICE, deadline ${DEADLINE}s, shards: $SHARDS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$LOG"

# 1. the protocol's realisations, one process each (CPU), while 2. has the GPU to itself
for r in 0 1 2; do
    "$PY" -c "
import sys
from rstmodel.data import RSConfig, load_rs
load_rs(RSConfig('rs-fashion', realisation=$r), data_root=sys.argv[1])
" "$DATA_ROOT" >"$WORK/logs/prepare-$r.log" 2>&1 &
done

# 2. the fast path, profile and compile, alone on the device (FASTPATH_SETTINGS empty: none
#    of 2., a call that only runs shards)
IFS=';' read -ra settings <<<"$FASTPATH_SETTINGS"
if ((${#settings[@]})); then
    # shellcheck disable=SC2086
    timeout "$FASTPATH_TIMEOUT" "$PY" train/fastpath.py --device "$DEVICE" --out "$WORK/fastpath" \
        --settings "${settings[@]}" $FASTPATH_ARGS \
        >"$WORK/logs/fastpath.log" 2>&1 || log "fastpath exit $?"
fi
FLAGS=$(sed -n 's/^FLAGS: //p' "$WORK/logs/fastpath.log" 2>/dev/null | tail -1)
# the environment the fastest setting needs (RSTCNN_KERNELS=torch where torch's operators
# beat the fused Triton kernels, or where a kernel failed); without a verdict from the fast
# path, torch's operators, as measured in earlier windows
if grep -qs '^ENV:' "$WORK/logs/fastpath.log"; then
    for kv in $(sed -n 's/^ENV: //p' "$WORK/logs/fastpath.log" | tail -1); do export "${kv?}"; done
else
    export RSTCNN_KERNELS=torch
fi
if [[ -n "$STEP_COST_ARGS" ]]; then
    # FLOPs and bytes of one training step as this device runs it, beside the step's time
    # in the first of FASTPATH_SETTINGS
    measured=$("$PY" -c '
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["model"] != "cnn" and r["setting"] == sys.argv[2]]
print("%.2f" % (rows[0]["train_s"] * 1e3) if rows else "")' "$WORK/fastpath/fastpath.json" "${settings[0]-}" 2>/dev/null)
    # shellcheck disable=SC2086
    timeout "$FASTPATH_TIMEOUT" "$PY" train/step_cost.py --device "$DEVICE" $STEP_COST_ARGS \
        ${measured:+--measured-ms "$measured"} --out "$WORK/fastpath/step-cost.md" \
        >"$WORK/logs/step-cost.log" 2>&1 || log "step_cost exit $?"
fi
if [[ -n "$KERNEL_PROBE_ARGS" ]]; then
    # each RST convolution alone with and without the fused kernels: time, bytes, GB/s
    # shellcheck disable=SC2086
    timeout "$FASTPATH_TIMEOUT" "$PY" train/kernel_probe.py --device "$DEVICE" $KERNEL_PROBE_ARGS \
        --out "$WORK/fastpath/kernels.md" >"$WORK/logs/kernel-probe.log" 2>&1 || log "kernel_probe exit $?"
fi
if [[ -n "$FASTPATH_ALIGNED" ]] && ((${#settings[@]})); then
    aligned_args="${FASTPATH_ARGS//--profile/}" aligned_args="${aligned_args//--compile/}"
    # shellcheck disable=SC2086
    timeout "$FASTPATH_TIMEOUT" "$PY" train/fastpath.py --device "$DEVICE" \
        --out "$WORK/fastpath-aligned" --settings "${settings[@]}" ${aligned_args//--align-probe/} \
        --model-arg "channels=$FASTPATH_ALIGNED" >"$WORK/logs/fastpath-aligned.log" 2>&1 ||
        log "fastpath (aligned widths) exit $?"
fi
log "fastest training setting: flags '${FLAGS}', kernels '${RSTCNN_KERNELS:-auto}'; $(grep -m1 'device busy' "$WORK/fastpath/profile.md" 2>/dev/null)"
wait
log "data ready: $(ls "$RSTCNN_DATA"/rs-fashion/seed*/*.npz 2>/dev/null | wc -l) renderings"
collect

# 3. the protocol's shards side by side, each in its own process group
# shellcheck disable=SC2206
repro_flags=($REPRO_FLAGS)
pids=()
for shard in $SHARDS; do
    models="${shard%@*}" trials="${shard#*@}" first=0
    if [[ "$trials" == *-* ]]; then first="${trials%-*}" trials=$((${trials#*-} + 1)); fi
    # shellcheck disable=SC2086
    setsid "$PY" train/reproduce.py --data rs-fashion --budget "$REPRO_BUDGET" --models ${models//,/ } \
        --trials "$trials" --first-trial "$first" --train-sizes $REPRO_SIZES --augment no --device "$DEVICE" \
        --data-root "$DATA_ROOT" "${repro_flags[@]}" --out "$WORK/reproduce" --results "$RESULTS" \
        --deadline $((DEADLINE - SECONDS > 30 ? DEADLINE - SECONDS : 30)) \
        >"$WORK/logs/reproduce-${models//,/-}-${shard#*@}.log" 2>&1 &
    pids+=($!)
done
if [[ -n "$SPLIT_CHECKPOINT" ]]; then
    # goes on from the committed state (results/shipped), or a newer one carried in RESUME
    mkdir -p "$WORK/split-check"
    split_until=$((SECONDS + (DEADLINE - SECONDS > 30 ? DEADLINE - SECONDS : 30)))
    (
        for served in $SPLIT_SERVED; do
            split_name="split-check-$(basename "$served" .onnx)"
            split_name="${split_name%.pt}"
            [[ "$served" == *.pt ]] && split_name="$split_name.eager"
            reference="eager-logits-$(basename "$SPLIT_CHECKPOINT" .pt).npz"  # shared by both
            for saved in "results/shipped/$split_name.state.npz" "$RESUME/split-check/$split_name.state.npz" \
                "results/shipped/$reference" "$RESUME/split-check/$reference"; do
                [[ -f "$saved" && ! "$WORK/split-check/$(basename "$saved")" -nt "$saved" ]] &&
                    cp "$saved" "$WORK/split-check/"
            done
            left=$((split_until - SECONDS))
            ((left > 10)) || break
            timeout "$left" "$PY" -m rstcnn.export.split_check \
                "$SPLIT_CHECKPOINT" "$served" --device "$DEVICE" --threads "$SPLIT_THREADS" \
                ${SPLIT_LIMIT:+--limit "$SPLIT_LIMIT"} --out "$WORK/split-check/$split_name.json" \
                --no-progress
        done
    ) >"$WORK/logs/split-check.log" 2>&1 &
fi
if [[ "$DEVICE" == cuda ]]; then
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$WORK/logs/test_cuda.log" 2>&1 &
fi
if [[ -n "$KERNEL_CHECK_LIMIT" ]]; then
    # the shipped checkpoint on its own test images through the fused kernels and through
    # torch's operators: the same accuracy, float32 and bf16 (train/precision_check.py each)
    (
        for kernels in torch triton; do
            RSTCNN_KERNELS=$kernels timeout 120 "$PY" train/precision_check.py "$KERNEL_CHECK_CHECKPOINT" \
                --device "$DEVICE" --limit "$KERNEL_CHECK_LIMIT" --data-root "$DATA_ROOT" \
                --json "$WORK/logs/kernels-check-$kernels.json"
        done
    ) >"$WORK/logs/kernels-check.log" 2>&1 &
fi
stopped=0
while :; do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 10
    collect
    if (( SECONDS > DEADLINE + 20 && ! stopped )); then
        log "past the deadline: Ctrl-C to every shard still going (each saves last.pt)"
        for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null; done
        stopped=1
    fi
done
wait
log "finished runs in the record: $(ls "$RESULTS"/runs 2>/dev/null | tr '\n' ' ')"
log "unfinished: $(cd "$WORK/reproduce" && for d in */*/*/; do [[ -f $d/summary.json ]] || echo -n "$d "; done)"
log "test_cuda: $(tail -1 "$WORK/logs/test_cuda.log" 2>/dev/null)"
log "split check: $(grep -E '^[0-9]+ of [0-9]+ images' "$WORK/logs/split-check.log" 2>/dev/null | tr '\n' ' ')"
if [[ -n "$K_SWEEP" ]]; then
    timeout 180 "$PY" train/k_sweep.py --report --budget "$REPRO_BUDGET" \
        --train-size "$K_SWEEP_SIZE" --results "$RESULTS" --out "$WORK/reproduce" \
        --sweep-out "$WORK/k-sweep" --device "$DEVICE" >"$WORK/logs/k-sweep.log" 2>&1 \
        || log "k_sweep exit $?"
    log "k sweep: $(grep -m1 '^Verdict' "$WORK/k-sweep/sweep.md" 2>/dev/null)"
fi
log "done"
collect
