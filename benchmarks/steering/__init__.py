"""Steering-vector benchmarks: the stories260K concept sweep and generation overhead (:mod:`.stories260k`, page
docs/benchmarks/steering.md) and SmolLM2 with EasyEdit2's metrics (:mod:`.llm`, pages steering_llm*.md); raw results in
``benchmarks/steering/results/`` (the SmolLM2 runs: ``runs/steering_llm/``, see docs/benchmarks/README.md)."""
