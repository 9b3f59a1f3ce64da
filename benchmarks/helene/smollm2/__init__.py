"""HELENE, MeZO, ZO-Adam and AdamW-LoRA on SmolLM2-135M-Instruct, MeZO's prompt protocol
(``python -m benchmarks.helene.smollm2 COMMAND``, see :mod:`.grid`)."""
