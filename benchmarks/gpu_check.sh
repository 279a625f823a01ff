#!/usr/bin/env bash
# make gpu-check: every check of a CUDA machine (docs/gpu.md lists them), one report file.
#
# Runs from the source tree (PYTHONPATH=src) with the machine's own Python, not .venv:
# a GPU machine has its own torch, triton and jax and may reach no package index.
# Settings (environment):
#   GPU_PYTHON        the interpreter (default python3)
#   GPU_REPORT        the report folder (default $OUT when set, else runs/gpu-check):
#                     report.md (every command, its exit status, time and output),
#                     logs/, and the benchmarks' JSON
#   DATA              the Fashion-MNIST folder (four .gz files) for the training steps
#                     (default /usr/share/datasets/fashion-mnist; absent: those steps
#                     are reported as not run)
#   GPU_CHECK_BUDGET  seconds for all steps together (default 570); each step also has
#                     its own limit, a failing or stopped step does not stop the others,
#                     and a step left without time is reported as not run
#   GPU_CHECK_FROM    the number of the first step to run (default 1): a second call takes
#                     the steps the budget of the first left (their report in its own folder)
#   GPU_CHECK_STEPS   the steps to run, numbers and ranges (e.g. 8-12,18; default all):
#                     one call takes the steps an earlier one left, in any set
#   GPU_STEPS_SECONDS, GPU_STEPS_JOBS: the steps study's limit (240 s) and runs at once (4)
# Without a GPU it says so and exits 0; where GPU_PYTHON cannot import torch it fails.
set -u
cd "$(dirname "$0")/.."

PY=${GPU_PYTHON:-python3}
DIR=${GPU_REPORT:-${OUT:-runs/gpu-check}}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
BUDGET=${GPU_CHECK_BUDGET:-570}
FROM=${GPU_CHECK_FROM:-1}
case $FROM in '' | *[!0-9]*) echo "make gpu-check: GPU_CHECK_FROM must be a step number, got '$FROM'" >&2; exit 2 ;; esac
STEPS=${GPU_CHECK_STEPS:-}
if [ -n "$STEPS" ] && ! [[ $STEPS =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]]; then
    echo "make gpu-check: GPU_CHECK_STEPS must be step numbers and ranges such as 8-12,18, got '$STEPS'" >&2
    exit 2
fi

# Exit 0 only where torch ran and saw no GPU; a Python that cannot run torch fails.
errors=$(mktemp)
if ! cuda=$("$PY" -c "import torch; print(torch.cuda.is_available())" 2>"$errors"); then
    echo "make gpu-check: $PY cannot run torch ($(tail -n 1 "$errors")); set GPU_PYTHON to" \
         "the interpreter that has the machine's torch" >&2
    rm -f "$errors"
    exit 1
fi
rm -f "$errors"
if [ "$cuda" != True ]; then
    echo "make gpu-check: no CUDA GPU here ($PY: torch.cuda.is_available() is False); nothing to run"
    exit 0
fi

export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX beside torch in one process: no 75% grab
unset TRITON_INTERPRET
rm -rf "$DIR/logs" "$DIR/study-quick" "$DIR"/train-* "$DIR"/steps-*  # this script's own outputs of an earlier run
mkdir -p "$DIR/logs"
REPORT="$DIR/report.md"
START=$(date +%s)
N=0
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")

REVISION="not a git checkout"
if git rev-parse --short HEAD >/dev/null 2>&1; then
    REVISION="commit $(git rev-parse --short HEAD)"
    git diff --quiet HEAD 2>/dev/null || REVISION="$REVISION with local changes"
fi
{
    echo "# make gpu-check"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname), $REVISION, $NGPU GPU(s), budget ${BUDGET} s, from step ${FROM}${STEPS:+, steps $STEPS};"
    echo "run from $(pwd) with PYTHONPATH=$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false"
    if command -v nvidia-smi >/dev/null; then
        echo
        echo '```'
        echo '$ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader'
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
        echo '```'
    fi
} >"$REPORT"

# quote ARGS...: the command line as a shell would take it back (single quotes where needed).
quote() {
    local out="" a q="'"
    for a in "$@"; do
        case $a in
            '' | *[!A-Za-z0-9_./=:,+@%-]*) out="$out '${a//$q/$q\\$q$q}'" ;;
            *) out="$out $a" ;;
        esac
    done
    echo "${out# }"
}

# selected N: whether step N is in GPU_CHECK_STEPS (every step where it is unset).
selected() {
    [ -z "$STEPS" ] && return 0
    local part
    for part in ${STEPS//,/ }; do
        if [ "$1" -ge "${part%-*}" ] && [ "$1" -le "${part#*-}" ]; then
            return 0
        fi
    done
    return 1
}

# step TITLE LIMIT_SECONDS COMMAND...: run COMMAND under a time limit, log it, report it.
step() {
    local title=$1 limit=$2
    shift 2
    N=$((N + 1))
    local log
    log="$DIR/logs/$(printf '%02d' "$N")-$(echo "$title" | tr -c 'A-Za-z0-9' '-' | tr -s '-' | cut -c1-40 | sed 's/-$//').log"
    local left=$((BUDGET - ($(date +%s) - START)))
    {
        echo
        echo "## $N. $title"
        echo
        echo '```'
        echo "\$ $(quote "$@")"
        echo '```'
        echo
    } >>"$REPORT"
    if [ "$N" -lt "$FROM" ]; then
        echo "not run: before GPU_CHECK_FROM=$FROM" >>"$REPORT"
        echo "[$N] $title: not run (before GPU_CHECK_FROM=$FROM)"
        return
    fi
    if ! selected "$N"; then
        echo "not run: not in GPU_CHECK_STEPS=$STEPS" >>"$REPORT"
        echo "[$N] $title: not run (not in GPU_CHECK_STEPS=$STEPS)"
        return
    fi
    if [ "$left" -lt 15 ]; then
        echo "not run: the budget of ${BUDGET} s is spent (GPU_CHECK_BUDGET)" >>"$REPORT"
        echo "[$N] $title: not run (budget spent)"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "[$N] $title (at most ${limit} s)"
    local t0 status
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    status=$?
    local took=$(($(date +%s) - t0))
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "stopped at its limit of ${limit} s (exit status $status); the output so far:" >>"$REPORT"
    else
        echo "exit status $status after ${took} s" >>"$REPORT"
    fi
    {
        echo
        echo '```'
        if [ "$(wc -l <"$log")" -gt 150 ]; then
            echo "[the last 150 of $(wc -l <"$log") lines; the whole output: $log]"
            tail -n 150 "$log"
        else
            cat "$log"
        fi
        echo '```'
    } >>"$REPORT"
    echo "    exit status $status after ${took} s"
}

# not_run TITLE REASON: a step that cannot run here, reported as such; where
# GPU_CHECK_FROM or GPU_CHECK_STEPS leaves it out, that is the reason given first.
not_run() {
    N=$((N + 1))
    local why=$2
    if [ "$N" -lt "$FROM" ]; then
        why="before GPU_CHECK_FROM=$FROM"
    elif ! selected "$N"; then
        why="not in GPU_CHECK_STEPS=$STEPS"
    fi
    local detail=$why
    [ "$why" != "$2" ] && detail="$why; nor could it run here: $2"
    printf '\n## %s. %s\n\nnot run: %s\n' "$N" "$1" "$detail" >>"$REPORT"
    echo "[$N] $1: not run ($why)"
}

have_data() { [ -f "$DATA/train-images-idx3-ubyte.gz" ]; }
NO_DATA="no Fashion-MNIST in $DATA (DATA=DIR names the folder with its four .gz files)"

step "Versions and device" 60 "$PY" -c "import torch, triton, jax; print(torch.__version__, \
torch.version.cuda, triton.__version__, jax.__version__, torch.cuda.get_device_name(), jax.devices())"

step "Tests in the CUDA mode (every path against the spec and run to run, no host syncs, state dicts)" 300 \
    env LARGEBATCH_CUDA_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fused_syncs.py tests/test_fused_replay.py tests/test_comm.py \
    tests/test_comm_kernels.py -k "not captured and not fsdp2" -rfEs
step "CUDA graph: a captured fused step replayed 100 steps (one overflowing) against eager" 120 \
    env LARGEBATCH_CUDA_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k captured -rA
step "FSDP2 on the fused path (one NCCL rank per process) against an unsharded model" 90 \
    env LARGEBATCH_CUDA_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k fsdp2 -rA

# The rest in the order of what the speed issue needs measured: a budget that runs short
# drops the last steps (GPU_CHECK_FROM runs them in a second call).
PEERS="fused,foreach,timm,torch-optimizer,torch,apex,floor"
GRAPHED="cuda graph"  # ResNet-50 only: the kernels without the host (BERT-large's steps are near their limits)
step "Optimizer step, ResNet-50 fp32: the kernels against the copy bandwidth, timm, apex, torch fused, optax" 150 \
    "$PY" benchmarks/optimizer_step.py --device cuda --model resnet50 --precision fp32 \
    --providers "$PEERS,$GRAPHED,moved grads,optax,(jax,packed,(pallas" --json "$DIR/step-resnet50-fp32.json"
step "The fused JAX path compiled (Pallas on the GPU): the spec's cases in float32, awkward trees; AdaComp's packed exchange against leaf by leaf" 120 \
    env LARGEBATCH_CUDA_TESTS=1 JAX_PLATFORMS=cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_jax_fused.py \
    tests/test_jax_comm_packed.py -k "matches_the_spec and float32 or awkward or launches or comm_packed" -rfEs
if [ "$NGPU" -gt 1 ]; then
    step "AdaComp hook (torch operations, and fused kernels) against DDP's all-reduce, NCCL, $NGPU processes; AdaComp in JAX" 200 \
        bash -c "'$PY' -m torch.distributed.run --standalone --nproc_per_node=$NGPU benchmarks/comm_hook.py \
        --device cuda --json '$DIR/comm-hook.json'; '$PY' benchmarks/jax_adacomp.py --json '$DIR/jax-adacomp.json'"
else
    step "AdaComp hook (torch operations, and fused kernels) against DDP's all-reduce, NCCL, one process (the hook's own cost; goal: fused at most 1.5x DDP); AdaComp in JAX against pmean" 200 \
        bash -c "'$PY' benchmarks/comm_hook.py --device cuda --json '$DIR/comm-hook.json'; \
        '$PY' benchmarks/jax_adacomp.py --json '$DIR/jax-adacomp.json'"
fi
step "Optimizer step, BERT-large fp32, JAX: optax against the fused path" 180 \
    "$PY" benchmarks/optimizer_step.py --device cuda --model bert-large --precision fp32 \
    --steps 5 --warmup 2 --providers "optax,(pallas" --json "$DIR/step-bert-large-fp32-jax.json"
step "Optimizer step, BERT-large fp32" 120 \
    "$PY" benchmarks/optimizer_step.py --device cuda --model bert-large --precision fp32 \
    --steps 5 --warmup 2 --providers "fused,timm,torch,apex,floor" --json "$DIR/step-bert-large-fp32.json"
step "XLA's profile of the JAX step, ResNet-50: kernels a step and their times, optax against ours" 150 \
    "$PY" benchmarks/xla_profile.py --device cuda --model resnet50 --json "$DIR/xla-profile-resnet50.json"
step "Optimizer step, ResNet-50 fp16 (our fp32 masters)" 110 \
    "$PY" benchmarks/optimizer_step.py --device cuda --model resnet50 --precision fp16 \
    --providers "$PEERS,$GRAPHED" --json "$DIR/step-resnet50-fp16.json"
step "Optimizer step, BERT-large fp16 (our fp32 masters)" 120 \
    "$PY" benchmarks/optimizer_step.py --device cuda --model bert-large --precision fp16 \
    --steps 5 --warmup 2 --providers "fused,timm,torch,apex,floor" --json "$DIR/step-bert-large-fp16.json"

if have_data; then
    step "Demo: the steps study's quick version on the GPU (4 runs at once)" 150 \
        "$PY" -m largebatch steps --quick --device cuda --jobs 4 --data "$DATA" \
        --out "$DIR/steps-quick"
    for precision in fp32 fp16 bf16; do
        step "Training, fmnist-lamb-1536 in $precision (2 epochs)" 60 \
            "$PY" -m largebatch train --recipe fmnist-lamb-1536 --device cuda --precision "$precision" \
            --epochs 2 --data "$DATA" --out "$DIR/train-$precision"
    done
    if [ "$NGPU" -gt 1 ]; then
        step "Training under FSDP2 on the fused path, fmnist-lars-1536 ($NGPU processes, 2 epochs)" 90 \
            "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" -m largebatch train \
            --recipe fmnist-lars-1536 --fsdp --device cuda --epochs 2 --data "$DATA" --out "$DIR/train-fsdp2"
    else
        not_run "Training under FSDP2 on the fused path" "it needs 2 or more GPUs (NCCL puts each \
rank on its own GPU); the one-rank FSDP2 test (step 4) covers this machine"
    fi
    # The steps study that is still running (docs/study.md; GPU_STEPS_STUDY names another),
    # from where its runs stand: the GPU takes the runs its plan gives next, four at once,
    # for GPU_STEPS_SECONDS; the copy's runs.jsonl comes back in the report folder, each
    # run labelled with the GPU's name (docs/gpu.md says how it joins the study).
    STUDY=${GPU_STEPS_STUDY:-$("$PY" tools/study_docs.py --running | head -n 1)}
    if [ -n "$STUDY" ] && [ -f "$STUDY/runs.jsonl" ]; then
        COPY="$DIR/$(basename "$STUDY")"
        rm -rf "$COPY"
        cp -r "$STUDY" "$COPY"
        step "The steps study on the GPU ($(basename "$STUDY")), from its runs so far (${GPU_STEPS_JOBS:-4} at once)" \
            "${GPU_STEPS_SECONDS:-240}" \
            "$PY" -m largebatch steps --out "$COPY" --device cuda --jobs "${GPU_STEPS_JOBS:-4}" --data "$DATA"
    else
        not_run "The steps study on the GPU" \
            "${STUDY:-no study in docs/study has runs to go}${STUDY:+ holds no runs.jsonl}"
    fi
else
    not_run "Demo: the steps study's quick version on the GPU" "$NO_DATA"
    not_run "Training per precision" "$NO_DATA"
    not_run "Training under FSDP2 on the fused path" "$NO_DATA"
    not_run "The steps study on the GPU" "$NO_DATA"
fi

echo "make gpu-check: $N steps in $(($(date +%s) - START)) s; the report: $REPORT"
echo >>"$REPORT"
echo "$N steps in $(($(date +%s) - START)) s." >>"$REPORT"
