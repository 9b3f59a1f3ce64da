"""OFTv2 benchmarks: step time and memory against PEFT OFT, LoRA and weight-centric OFT (:mod:`.cpu`), Conv2d
(:mod:`.conv`), QOFT on 4-bit bases (:mod:`.qoft`), SmolLM2 finetuning (:mod:`.llm_sft`), LoRA export
(:mod:`.lora_export`) and FSDP2 memory per rank (:mod:`.fsdp2_memory`); pages docs/benchmarks/oftv2.md, qoft.md,
llm_sft.md, oftv2_lora_export.md and fsdp2_memory.md; raw results in ``benchmarks/oftv2/results/``."""
