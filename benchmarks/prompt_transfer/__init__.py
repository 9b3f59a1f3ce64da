"""PCT prompt-transfer benchmarks: the fast MiniLM variant (:mod:`.minilm`) and SmolLM2 prompt-based
classification (:mod:`.llm`, resumable), both on docs/benchmarks/prompt_transfer.md; raw results in
``benchmarks/prompt_transfer/results/``."""
