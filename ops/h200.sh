#!/usr/bin/env bash
# The H200 figures the open issues wait on, one part per device call (each under the
# 600 s a call may run), on the 0.5B-shaped random model built once per warm machine.
#
#   here, once:     bash ops/h200.sh prepare   (fills .gpu/1 and .gpu/2, ../shared/gpu)
#   device call A: carry [".gpu/1"]  bash .gpu/1/stash.sh
#   device call B: carry [".gpu/2"]  source .gpu/2/setup.sh && PARTS=base,weights bash ops/h200.sh priority
#   then, on the still-warm machine: ... && PARTS=both bash ops/h200.sh priority
#                                     ... && bash ops/h200.sh serve
#                                     ... && bash ops/h200.sh structured
#                                     ... && bash ops/h200.sh step
#                                     ... && bash ops/h200.sh engine  (ops/bench_engine_steps.py)
#                                     ... && bash ops/h200.sh attention  (the decode pass's launches)
#                                     ... && bash ops/h200.sh fused   (ops/bench_fused.py)
#                                     ... && bash ops/h200.sh graphs  (MLX's CUDA graph settings)
#
# The worker's decode steps run as one sequence; WORKER_ARGS="--fused-prefill on" TAG=fused
# PARTS=both gives the same tree with each chat job's prompt in the batch's pass.
#
# Logs and JSON go to $OUT. SHAPE=tiny with small sizes (SMALL=1) rehearses every part on
# a CPU.
#
# Another tree side by side, in the same call: here `bash ops/h200.sh code REV` installs
# that commit's mlxq into .gpu/code (carry it beside .gpu/2), then CODE=.gpu/code TAG=old
# PARTS=both ... runs the worker and the benchmark from it (put before, not instead of,
# the device's PYTHONPATH). The commit each part prints is the device checkout's, which
# may lag this tree's; the sources' hash beside it is of the files that ran. Where the two
# pass the 64 MiB a call carries (py-spy's wheel is in .gpu/2), carry .gpu/2 in call B and
# .gpu/code alone in a later call on the warm machine: what a call carried stays there.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?"which part: prepare, code, priority, serve, step, engine, attention, fused, graphs or structured"}

if [ "$part" = prepare ]; then
    # The gateway's and the openai client's wheels (../shared/gpu/README.md's list), then
    # mlxq's own: llguidance 1.9.1 is built for manylinux_2_31, a tag prepare.sh does not
    # ask for, so it and what the worker and the benchmarks import come here (with
    # httptools and uvloop, the serve extra's uvicorn[standard], and hiredis, the worker's and
    # the gateway's Redis parser).
    bash ../shared/gpu/prepare.sh fastapi starlette pydantic pydantic-core uvicorn \
        annotated-types typing-inspection opentelemetry-api typing_extensions openai httpx2 \
        httpcore2 anyio h11 idna truststore jiter distro sniffio
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .gpu/2/whl llguidance==1.9.1 tqdm \
        rich markdown-it-py mdurl pygments prometheus-client jsonschema \
        jsonschema-specifications referencing rpds-py attrs httptools uvloop hiredis
    # py-spy, for GIL=1 (which of a worker's threads hold the interpreter's lock): its
    # binary unpacks with the wheels, under $MLXQ_GPU_SITE/py_spy-*.data/scripts.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_5_x86_64 -d .gpu/2/whl py-spy==0.4.3
    du -sh .gpu/1 .gpu/2  # each must stay under the 64 MiB a device call carries
    exit 0
fi
if [ "$part" = code ]; then
    rev=${2:?"which commit"}
    src=$(mktemp -d)
    git archive "$rev" | tar -x -C "$src"
    rm -rf .gpu/code
    python3 -m pip install -q --no-deps --target .gpu/code "$src"
    rm -rf "$src" .gpu/code/bin
    echo "$rev $(git rev-parse --short "$rev")" > .gpu/code/REV
    du -sh .gpu/code
    exit 0
fi
[ -n "${CODE:-}" ] && export PYTHONPATH="$(cd "$CODE" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$(mktemp -d)}
SHAPE=${SHAPE:-0.5b}
MODEL=${MODEL:-/tmp/mlxq-h200-$SHAPE}
PY=${PYTHON:-python}
small=${SMALL:-0}
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/h200.log"; }

{
    # The device checkout's commit may lag the files it was sent: the sources' hash says
    # which code ran (here: the same pipeline over a checkout names it).
    src=$(find producer worker batching -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-10)
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) sources $src part $part shape $SHAPE${CODE:+ code $(cat "$CODE/REV" 2>/dev/null)}"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
} | tee -a "$OUT/h200.log"

# step, fused and graphs build their model in memory: only the rest read this one (built
# once per machine, about a minute of device time).
if [[ "$part" =~ ^(priority|serve|structured|engine|attention)$ ]] && [ ! -f "$MODEL/config.json" ]; then
    log "building the $SHAPE model into $MODEL"
    # As bench_serve builds it (so it reuses it): end of sequence unreachable, so every
    # unconstrained job runs its max_tokens.
    "$PY" -c "import sys; from mlxq.worker.random_model import build_random_model as b; \
b(sys.argv[1], shape=sys.argv[2], dtype=sys.argv[3], eos_reachable=False)" \
        "$MODEL" "$SHAPE" "$([ "$SHAPE" = tiny ] && echo float32 || echo bfloat16)"
fi
shape_args=()
[ "$SHAPE" = tiny ] || shape_args=(--shape "$SHAPE")

case "$part" in
priority)
    # Issue 22: interactive chat jobs (32 tokens, one every 0.5 s) on the top level beside
    # a 10,000-job sweep of 64-token jobs; then weights 3:1 over 10 s windows.
    jobs=10000 duration=40
    [ "$small" = 1 ] && jobs=300 duration=12
    jobs=${JOBS:-$jobs}  # JOBS=3000 PARTS=mix: a shorter look, idle, alone and both in one call
    idle=${IDLE_JOBS:-60}  # interactive jobs on the idle worker, one every 0.5 s
    # The 10,000-job mix takes more than a call's 600 s there: PARTS=base,weights (idle,
    # the sweep alone, weights 3:1) in one call, then PARTS=both (the sweep beside the
    # interactive jobs, against the first call's figures, kept on the warm machine).
    parts=${PARTS:-mix,weights}
    base=/tmp/mlxq-h200-base-$SHAPE.json
    extra=()
    if [[ ",$parts," == *,both,* ]]; then
        [ -f "$base" ] || { echo "no $base: run PARTS=base first on this machine" >&2; exit 2; }
        extra=(--baseline "$base")
    fi
    # PARTS=pairs PAIRS=3 JOBS=5000: the sweep alone then beside the chat jobs, three times
    # over in one call, each pair's ratio its own (the card's pace drifts between calls).
    # PARTS=turns JOBS=20000 (TURNS=8 TURN_S=5): one worker, one sweep throughout, 5 s
    # windows with the chat jobs and without in turn (the pace drifts between runs too).
    # WORKER_ARGS: more worker options, e.g. "--admit-hold-steps 4" (the CPU's hold: a
    # sweep's refills gathered up to 16 steps) for a PARTS=both run against the default's.
    name=priority-${parts//,/-}${TAG:+-$TAG}  # TAG: tells two runs of one call apart
    # TRACE=1: each worker's decode thread, pass by pass (ops/stage_trace.py), gzipped.
    [ "${TRACE:-0}" = 1 ] && extra+=(--trace "$OUT/trace-$name")
    # GIL=1 (PARTS=turns): which of the worker's threads hold the interpreter's lock, each
    # window (ops/gil_sample.py; py-spy from prepare's wheel, or PY_SPY, or PATH).
    if [ "${GIL:-0}" = 1 ]; then
        spy=$(ls "${MLXQ_GPU_SITE:-/nonexistent}"/py_spy-*.data/scripts/py-spy 2>/dev/null | head -1 || true)
        [ -n "$spy" ] && chmod +x "$spy" && export PY_SPY=${PY_SPY:-$spy}
        extra+=(--gil "$OUT/gil-$name")
    fi
    log "bench_priority $parts: sweep $jobs jobs ${WORKER_ARGS:-}"
    # The card's clocks, power and temperature each second: its pace drifts between runs
    # (an H100's decode step from 6.7 to 10 ms over one call), and this says whether the
    # card throttled.
    clocks=""
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
            --format=csv -l 1 > "$OUT/clocks-$name.csv" 2>&1 &
        clocks=$!
    fi
    "$PY" ops/bench_priority.py "${shape_args[@]}" --model "$MODEL" --parts "$parts" \
        --sweep-jobs "$jobs" --idle-jobs "$idle" --duration "$duration" --json "$OUT/$name.json" "${extra[@]}" \
        --worker-args="${WORKER_ARGS:-}" --logs "$OUT/logs-$name" --pairs "${PAIRS:-2}" \
        --turns "${TURNS:-8}" --turn-s "${TURN_S:-5}" 2>&1 |
        tee "$OUT/$name.log"
    [ -n "$clocks" ] && kill "$clocks" 2>/dev/null || true
    # The kernels MLX compiled on this machine (NVRTC, cached under /tmp/mlx), by when: a
    # worker's turn logged as slow (--slow-turn-ms) at a compile's time was that compile.
    mkdir -p "$OUT/logs-$name"
    ls -l --time-style=+%T /tmp/mlx/*/ptx 2>/dev/null | sort -k6 > "$OUT/logs-$name/ptx.txt" || true
    if [[ ",$parts," == *,base,* || ",$parts," == *,mix,* ]]; then cp "$OUT/$name.json" "$base"; fi
    # One file for the traces and the workers' logs: a device call brings back 8 files.
    packed=()
    for d in "trace-$name" "logs-$name" "gil-$name"; do [ -d "$OUT/$d" ] && packed+=("$d"); done
    if [ ${#packed[@]} -gt 0 ]; then
        tar czf "$OUT/$name-logs.tgz" -C "$OUT" "${packed[@]}" && (cd "$OUT" && rm -rf "${packed[@]}")
    fi
    ;;
serve)
    # Issue 22: the openai client through `mlxq serve` against direct and submit_many at
    # 64, 256 and 1,024 streams, and the first token of an idle worker's burst of 64; the
    # default worker (VARIANTS='--variant="--window-max-ms 0" --variant=""' compares the
    # fixed idle window with the one a burst keeps open).
    variants=(--variant=)
    [ -n "${VARIANTS:-}" ] && eval "variants=($VARIANTS)"
    streams=64,256,1024 tokens=128
    # serve-split: the same streams over 4 client processes, the openai client's own
    # Python process out of the way (MODES adds serve-warm: the pool open beforehand).
    modes=direct,submit,serve,serve-split
    [ "$small" = 1 ] && streams=64 tokens=16
    streams=${STREAMS:-$streams}  # STREAMS=64,256 ROUNDS=2: the short points twice
    log "bench_serve $streams streams"
    "$PY" ops/bench_serve.py "${shape_args[@]}" --model-dir "$MODEL" --batch 64 \
        --tokens "$tokens" --streams "$streams" --burst 64 --modes "${MODES:-$modes}" --rounds "${ROUNDS:-1}" \
        "${variants[@]}" --json "$OUT/serve.json" 2>&1 |
        tee "$OUT/serve.log"
    # The way in alone (worker suspended): how soon a burst's requests reach the queue on
    # this host's cores, raw HTTP and the openai client against submit_many (~30 s).
    log "bench_intake"
    "$PY" ops/bench_intake.py --rounds 5 2>&1 | tee "$OUT/intake.log"
    # The openai client's own part of a burst's first token: a server that answers at
    # once, on this host's cores (~10 s).
    log "bench_client_floor"
    "$PY" ops/bench_client_floor.py --rounds 5 2>&1 | tee "$OUT/floor.log"
    ;;
step)
    # A decode step's parts outside the worker: whole steps by rows and sampled rows, and
    # the sampler call alone (ops/bench_step_mix.py builds its model in memory, ~1 min).
    # With CODE=.gpu/code TAG=old, the other tree's sampler beside this one's.
    log "bench_step_mix"
    step_args=()
    [ "$small" = 1 ] && step_args=(--steps 3)
    # STEP_ARGS="--pipelined --steps 200 --rounds 3": steps in sequence, as the worker runs
    # them, every variant once a round (a card drifts over one process); with
    # --variants 62:0,63:1,64:0,64:1 --rounds 12, a chat row's step inside 64 rows only.
    "$PY" ops/bench_step_mix.py --shape "$SHAPE" "${step_args[@]}" ${STEP_ARGS:-} 2>&1 |
        tee "$OUT/step-mix${TAG:+-$TAG}.log"
    ;;
engine)
    # A chat row's cost to a sweep's decode steps through the worker's own Engine (no
    # Redis, no helper threads): greedy rows, with a chat row, with one more greedy row.
    log "bench_engine_steps"
    engine_args=()
    [ "$small" = 1 ] && engine_args=(--steps 10 --rounds 2 --settle 2)
    "$PY" ops/bench_engine_steps.py --model "$MODEL" "${engine_args[@]}" ${ENGINE_ARGS:-} 2>&1 |
        tee "$OUT/engine-steps${TAG:+-$TAG}.log"
    ;;
attention)
    # The decode pass's launches: the one-kernel attention checked against MLX's own and
    # timed beside it (24 layers' attention a step), then the engine's steps with it, with
    # the joined projections alone, and with neither (each its own process, the same steps).
    log "bench_decode_attention"
    MLXQ_DECODE_ATTENTION=1 "$PY" ops/bench_decode_attention.py 2>&1 | tee "$OUT/decode-attention.log"
    engine_args=(--phases greedy,chat --rounds 3 --steps 60 --nodes)
    [ "$small" = 1 ] && engine_args=(--phases greedy,chat --rounds 2 --steps 10 --settle 2)
    for cfg in "all MLXQ_DECODE_ATTENTION=1" "joins MLXQ_DECODE_ATTENTION=0" \
        "none MLXQ_DECODE_ATTENTION=0 MLXQ_JOINED_PROJECTIONS=0"; do
        set -- $cfg
        log "bench_engine_steps: $*"
        env "${@:2}" "$PY" ops/bench_engine_steps.py --model "$MODEL" "${engine_args[@]}" 2>&1 |
            tee "$OUT/engine-$1.log"
    done
    ;;
fused)
    # A decode step and a chat row's prefill, two passes against one fused pass
    # (ops/bench_fused.py builds its model in memory), 4-bit and bfloat16.
    for bits in 4 0; do
        log "bench_fused bits $bits"
        "$PY" ops/bench_fused.py --shape "$SHAPE" --bits "$bits" 2>&1 | tee -a "$OUT/fused.log"
    done
    ;;
graphs)
    # MLX's CUDA backend runs a pass as CUDA graphs of a few nodes each (MLX_MAX_OPS_PER_BUFFER,
    # 20 by default), cached by their topology (MLX_CUDA_GRAPH_CACHE_SIZE, 400): a step after
    # a row joined or left has other nodes, so other graphs. A join and a leave and the
    # steps after them (ops/bench_kv_rows.py builds its model in memory) under each setting.
    # A worker takes the same variables from the environment, e.g.
    # MLX_CUDA_GRAPH_CACHE_SIZE=2000 TAG=cache2000 JOBS=10000 PARTS=both ... priority.
    cycles=16
    [ "$small" = 1 ] && cycles=2
    for setting in "" MLX_CUDA_GRAPH_CACHE_SIZE=2000 MLX_MAX_OPS_PER_BUFFER=100 MLX_USE_CUDA_GRAPHS=0; do
        log "bench_kv_rows ${setting:-default}"
        env $setting "$PY" ops/bench_kv_rows.py --shape "$SHAPE" --cycles "$cycles" 2>&1 |
            tee -a "$OUT/graphs.log"
    done
    ;;
structured)
    # Issue 25: one shared JSON schema on every row, on a quarter of the rows, and a
    # 2,000-question choice sweep, each against the same batch unconstrained.
    # ANSWERS=0: the cost ratios only (validity was 100% of 2,000 each on 2026-12-05).
    answers=${ANSWERS:-2000} sweep=2000
    [ "$small" = 1 ] && answers=${ANSWERS:-64} sweep=128
    log "bench_structured: $answers answers, $sweep choice questions"
    "$PY" ops/bench_structured.py --model "$MODEL" --batch 64 --tokens 64 \
        --answers "$answers" --sweep "$sweep" 2>&1 | tee "$OUT/structured.log"
    ;;
*)
    echo "unknown part $part: priority, serve, step, engine, fused, graphs or structured" >&2
    exit 2
    ;;
esac
log "done: $part"
