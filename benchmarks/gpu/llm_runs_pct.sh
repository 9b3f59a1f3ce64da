# Sourced by llm_runs.sh `run` (uses its job, PY and $W): PCT on SmolLM2 -- 4 source prompts in parallel, the
# decomposition, then one process per (target, seed). Caches under runs/pct_llm, as on CPU.
PCT="$PY -m benchmarks.prompt_transfer.llm --model smollm2-135m-instruct --device cuda --data-dir $W/data
  --work runs/pct_llm --out runs/pct_llm/report.md"
mkdir -p runs/pct_llm
for s in mnli qnli qqp sst2; do job pct_source_$s $PCT --stage sources --only-sources $s & done; wait
job pct_decompose $PCT --stage sources
for t in rte mrpc cola boolq; do for s in 13 42 21; do
  job pct_target_${t}_$s $PCT --stage targets --targets $t --seeds $s &
done; done; wait
