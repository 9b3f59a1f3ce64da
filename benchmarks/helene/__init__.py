"""HELENE benchmarks: a fast MiniLM tier (:mod:`.minilm`, docs/benchmarks/helene.md: head/top/LoRA/full settings and
the Hessian-estimator study) and the SmolLM2 grid of HELENE/MeZO and their ablations (:mod:`.smollm2`, pages
helene_llm.md and prompt_cls_zero_shot.md); raw results in ``benchmarks/helene/results/``."""
