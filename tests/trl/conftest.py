"""Fixtures of the TRL tests; every test here skips when TRL is not installed (the ``trl`` extra)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")


@pytest.fixture
def trl_args(tmp_path):
    """Factory: ``trl_args(cls, **overrides)`` -> an SFTConfig/DPOConfig for a few fp32 CPU steps, no saving."""

    def make(cls, **overrides):
        # bf16=False: TRL's default bf16 changes the numbers on CPU (and is slow on CPUs without AVX512-BF16).
        return cls(**{
            "output_dir": str(tmp_path / "trainer"), "max_steps": 2, "per_device_train_batch_size": 4,
            "learning_rate": 1e-2, "bf16": False, "use_cpu": True, "report_to": [], "logging_steps": 1,
            "save_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0, "seed": 0, **overrides,
        })

    return make


@pytest.fixture
def decomposition(tmp_path):
    """A saved PCT decomposition of three random source prompts (4 virtual tokens of width 64, the tiny models')."""
    import torch

    import prompt_transfer as pt

    g = torch.Generator().manual_seed(0)
    prompts = {f"src{i}": torch.randn(4, 64, generator=g) * 0.5 for i in range(3)}
    path = tmp_path / "dec"
    pt.save_decomposition(pt.decompose(prompts, contrastive_steps=30), str(path))
    return str(path)
