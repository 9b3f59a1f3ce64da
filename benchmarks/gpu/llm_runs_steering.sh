# Sourced by llm_runs.sh `run` (uses its job, PY and $W): steering on SmolLM2 -- the sst2 plan in 6 shards without
# the classifier (it stays on the CPU machine: `--rescore` there), then the weddings plan (keyword scorer, scored
# here), then the steered-vs-unsteered generation overhead. Caches under runs/steering_llm_gpu.
ST="$PY -m benchmarks.steering.llm --device cuda --data-dir $W/data --out-dir runs/steering_llm_gpu"
for i in 0 1 2 3 4 5; do job steering_sst2_$i $ST --no-score --skip-overhead --shard $i/6 & done; wait
for i in 0 1 2 3 4 5; do job steering_weddings_$i $ST --concept weddings --skip-overhead --shard $i/6 & done; wait
job steering_overhead $ST --no-score --shard 0/6 --overhead-rounds 5
