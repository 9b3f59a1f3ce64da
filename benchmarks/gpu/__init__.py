"""The GPU machine's runs: ``run_all.sh`` (kernel tests, kernel and step benchmarks) and the LLM job scripts; the
step benchmark (:mod:`.step`) and its tables (:mod:`.step_report`)."""
