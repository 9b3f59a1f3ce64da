"""OFTv2 benchmarks: step time and memory against PEFT OFT, LoRA and weight-centric OFT (:mod:`.cpu`), Conv2d
(:mod:`.conv`), QOFT on 4-bit bases (:mod:`.qoft`) and SmolLM2 finetuning (:mod:`.llm_sft`); pages
docs/benchmarks/oftv2.md, qoft.md and llm_sft.md; raw results in ``benchmarks/oftv2/results/``."""
