"""Zeroth-order training of OFTv2 adapters on an nf4 base through the Lightning module (the benchmark's nf4 phase,
docs/helene.md "Zeroth-order on an nf4 base"), on a tiny Llama.

What must hold for ZO on a quantized base: every forward of a step sees the same function (the two-point estimate
divides a loss difference by 2ε, so any drift of the 4-bit weights between forwards -- e.g. bitsandbytes repacking
them in place at the first eval forward on AVX512-BF16 CPUs -- corrupts it), the 4-bit weights never change, and the
trajectory equals the optimizer stepped by hand on an identically loaded model in eval mode (the adapter has block
dropout here, so a step that forgot eval mode would differ). On AVX2-only CPUs bitsandbytes
never repacks; on AVX512-BF16 ones peftplug's loader switches it off (tests/oftv2_bnb/test_repack_table.py covers
both cases, the repacking one simulated where the CPU lacks it); this test runs whichever path the CPU takes.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from helene import FZOO, ZOSGD

pytestmark = pytest.mark.filterwarnings("ignore")

L = pytest.importorskip("lightning")
pytest.importorskip("bitsandbytes")

#: Block dropout on: both forwards of a ZO step must see the same function, so the step has to run in eval mode.
OFT = {"peft_type": "OFTV2", "block_size": 16, "target_modules": "all-linear", "module_dropout": 0.5}


def _module(checkpoint, make):
    from peftplug.lightning import PeftModule

    return PeftModule(str(checkpoint), quantization="nf4", peft=OFT, optimizer=make)


def _packed(module) -> dict[str, torch.Tensor]:
    """Every 4-bit weight's packed bytes (uint8 parameters), by name."""
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.dtype == torch.uint8}


def _batches(n=2):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(4, 90, (4, 16), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


@pytest.mark.parametrize("make", [partial(ZOSGD, lr=1e-2, eps=1e-3, seed=7),
                                  partial(FZOO, lr=1e-2, eps=1e-3, n_probes=3, seed=7)], ids=["mezo", "fzoo"])
def test_zeroth_order_fit_on_nf4_equals_manual_steps_and_leaves_the_4bit_weights(tiny_checkpoint, device, tmp_path,
                                                                                  make):
    from torch.utils.data import DataLoader

    batches = [{k: v.to(device) for k, v in b.items()} for b in _batches()]
    module = _module(tiny_checkpoint, make)
    packed = _packed(module)
    assert packed, "no 4-bit weights: the base was not quantized"
    trainer = L.Trainer(max_steps=3, accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    opt = trainer.optimizers[0]
    assert not module.automatic_optimization and opt.step_count == 3
    assert opt.skipped_nonfinite == 0 and getattr(opt, "skipped_zero_std", 0) == 0

    # The 4-bit weights are the same bytes after training (no repacking, no perturbation of frozen tensors).
    after = _packed(module)
    assert after.keys() == packed.keys()
    for name, before in packed.items():
        assert torch.equal(before, after[name].cpu()), name  # Lightning moved the model to `device`

    # The same steps by hand on an identically loaded model, in eval mode.
    reference = _module(tiny_checkpoint, make).to(device)  # where Lightning put the trained one
    reference.model.eval()
    ref_opt = make([(n, p) for n, p in reference.model.named_parameters() if p.requires_grad])
    for i in range(3):
        batch = batches[i % 2]

        def closure(batch=batch):
            with torch.no_grad():
                return reference.model(**batch).loss.detach().float()

        ref_opt.step(closure)
    trained = dict(module.model.named_parameters())
    moved = 0
    for name, p in reference.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=0, atol=1e-7, msg=name)
            moved += int(not torch.equal(p.detach(), torch.zeros_like(p)))  # OFTv2 starts at Q = 0
    assert moved > 0


def test_nf4_forward_is_the_same_function_at_the_same_parameters(tiny_checkpoint, device):
    """The premise of a two-point estimate on a 4-bit base: repeated eval forwards at the same θ agree exactly,
    also after a perturb-and-restore of the adapter (what a ZO step does between its forwards)."""
    from peftplug.quantized_layout import repacked_layers

    module = _module(tiny_checkpoint, None)
    module.model.eval()
    batch = {k: v.to(device) for k, v in _batches(1)[0].items()}
    trainable = [p for p in module.model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainable:  # away from Q = 0, so the rotations are not the identity
            p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.05)
        first = module.model(**batch).loss.item()
        z = [torch.randn(p.shape, generator=gen).to(p) for p in trainable]
        for p, d in zip(trainable, z):
            p.add_(d, alpha=1e-3)
        perturbed = module.model(**batch).loss.item()
        for p, d in zip(trainable, z):
            p.sub_(d, alpha=1e-3)
        second = module.model(**batch).loss.item()
    assert perturbed != first  # the perturbation is visible through the 4-bit layers
    # Forwards that agree with each other could still all run on repacked weights (it happens inside the first).
    assert not repacked_layers(module.model)
    assert abs(second - first) <= 1e-6 * abs(first), (first, second)
