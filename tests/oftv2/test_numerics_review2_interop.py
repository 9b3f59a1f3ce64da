"""Second numerics review of oftv2.interop: what cannot convert to or from PEFT's OFT is refused in one line (or
warned about) instead of writing an adapter vanilla PEFT cannot load or silently computes differently, and a PEFT
adapter whose block size PEFT adjusted converts with the size it was saved with.

Every refusal is paired with a check that PEFT (0.21.2) still behaves as the refusal says, so these tests fail if
PEFT learns to handle the case."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from peft import OFTConfig, PeftModel
from torch import nn

import oftv2  # noqa: F401  (registers OFTV2)
from oftv2 import OFTv2Config, export_peft_oft_adapter, load_peft_oft_adapter


def _seq(*layers) -> nn.Sequential:
    """``nn.Sequential`` of ``layers`` (factories, called after seeding: equal weights on every call)."""
    torch.manual_seed(0)
    return nn.Sequential(*(make() for make in layers))


def _convs() -> nn.Sequential:
    return _seq(lambda: nn.Conv2d(4, 6, 3, padding=1), lambda: nn.Conv2d(6, 4, 1))


def _grouped() -> nn.Sequential:
    return _seq(lambda: nn.Conv2d(4, 6, 1, groups=2))


def _conv3() -> nn.Sequential:
    return _seq(lambda: nn.Conv2d(4, 6, 3, padding=1))


def _linears(*widths: int) -> nn.Sequential:
    return _seq(*(lambda i=i: nn.Linear(widths[i], widths[i + 1]) for i in range(len(widths) - 1)))


def _peft_oft(model: nn.Module, **config) -> peft.PeftModel:
    """PEFT's own OFT on ``model`` with random rotations (PEFT's adjustment warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        oft = peft.get_peft_model(model, OFTConfig(r=0, **config))
    randomize_q(oft, std=0.05, seed=1, key="oft_R")
    return oft.eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=40, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def test_export_with_trainable_tokens_is_refused(tiny_model, tmp_path):
    # Before: exported; PEFT's OFTConfig has no trainable_token_indices, so vanilla PEFT loaded the adapter without
    # the trained rows and its logits differed by 0.25 from the OFTv2 model's, with no warning.
    assert "trainable_token_indices" not in OFTConfig.__dataclass_fields__
    model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(
        target_modules=["q_proj"], block_size=8, orthogonalization="peft_cn", trainable_token_indices=[1, 2]))
    with pytest.raises(ValueError, match="trainable_token_indices") as err:
        export_peft_oft_adapter(model, tmp_path)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("case", ["conv1d", "groups", "non_square", "dilation"])
def test_export_of_layers_peft_cannot_load_is_refused(case, tmp_path):
    # Before: exported without a word; vanilla PEFT's from_pretrained then failed (TypeError on Conv1D, a
    # size-mismatch RuntimeError for grouped and non-square convs, ValueError for dilation).
    if case == "conv1d":
        build, target, block, why = _gpt2, ["c_attn"], 4, "Conv1D"
    else:
        conv = {"groups": {"in_channels": 4, "out_channels": 6, "kernel_size": 1, "groups": 2},
                "non_square": {"in_channels": 4, "out_channels": 6, "kernel_size": (1, 3), "padding": (0, 1)},
                "dilation": {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "dilation": 2, "padding": 2}}[case]

        def build():
            return _seq(lambda: nn.Conv2d(**conv))

        target, block, why = ["0"], 2, {"groups": "groups=2", "non_square": "square", "dilation": "dilation"}[case]
    # PEFT's OFT still cannot take the layer as we store it: it refuses the layer, or sizes its rotation differently.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            theirs = peft.get_peft_model(build(), OFTConfig(target_modules=target, oft_block_size=block, r=0))
    except (TypeError, ValueError):
        theirs = None
    ours = peft.get_peft_model(build(), OFTv2Config(target_modules=target, block_size=block,
                                                    orthogonalization="peft_cn"))
    if theirs is not None:
        shape = lambda m, key: next(p.shape for n, p in m.named_parameters() if key in n)
        assert shape(theirs, "oft_R") != shape(ours, "oftv2_Q")
    with pytest.raises(ValueError, match=why) as err:
        export_peft_oft_adapter(ours, tmp_path)
    assert "\n" not in str(err.value) and "cannot load" in str(err.value)


def test_export_of_a_3x3_conv_warns_and_peft_needs_the_merge(tmp_path):
    # Before: no warning, and vanilla PEFT's unmerged forward of the export was off by ~4.7 (outputs ~1).
    ours = peft.get_peft_model(_convs(),
                               OFTv2Config(target_modules=["0", "1"], block_size=2, orthogonalization="peft_cn"))
    randomize_q(ours, std=0.05)
    x = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        expected = ours(x)
    with pytest.warns(UserWarning, match=r"kernels larger than 1 x 1 or a forward of their own \(base_model.model.0\)"):
        export_peft_oft_adapter(ours, tmp_path)
    vanilla = PeftModel.from_pretrained(_convs(), tmp_path).eval()
    with torch.no_grad():
        assert (vanilla(x) - expected).abs().max() > 0.1  # what the warning is about
        torch.testing.assert_close(vanilla.merge_and_unload()(x), expected, rtol=1e-5, atol=1e-5)


def test_a_1x1_conv_and_linear_export_without_warning(tmp_path):
    ours = peft.get_peft_model(_seq(lambda: nn.Conv2d(4, 6, 1), lambda: nn.Flatten(), lambda: nn.Linear(6 * 9, 4)),
                               OFTv2Config(target_modules=["0", "2"], block_size=2, orthogonalization="peft_cn"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_peft_oft_adapter(ours, tmp_path)


def test_loading_a_grouped_conv_adapter_is_refused_in_one_line(tmp_path):
    # Before: a two-line RuntimeError "Error(s) in loading state_dict for PeftModel: size mismatch ...".
    _peft_oft(_grouped(), target_modules=["0"], oft_block_size=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"shape \(2, 1\) where OFTv2 builds \(1, 1\).*grouped conv") as err:
        load_peft_oft_adapter(_grouped(), tmp_path)
    assert "\n" not in str(err.value)


def test_adapter_with_block_size_adjusted_by_peft_converts_with_the_saved_size(tmp_path):
    # PEFT moves oft_block_size=5 to 4 on a width of 12 and saves 4-blocks. Before: the conversion built block_size=5
    # and failed with "block_size=5 does not divide the input width 12".
    theirs = _peft_oft(_linears(12, 6, 3), target_modules=["0"], oft_block_size=5)
    theirs.save_pretrained(tmp_path)
    x = torch.randn(3, 12)
    with pytest.warns(UserWarning, match="saved with block size 4"):
        ours = load_peft_oft_adapter(_linears(12, 6, 3), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_adapter_with_per_layer_adjusted_block_sizes_is_refused(tmp_path):
    # Widths 12 and 10: PEFT adjusts 5 to 4 on the first and keeps 5 on the second; one OFTv2 block size cannot hold
    # both.
    _peft_oft(_linears(12, 10, 3), target_modules=["0", "1"],
              oft_block_size=5).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"block sizes \[4, 5\]") as err:
        load_peft_oft_adapter(_linears(12, 10, 3), tmp_path)
    assert "\n" not in str(err.value)


def test_loading_a_3x3_conv_adapter_warns_that_it_equals_peft_merged(tmp_path):
    theirs = _peft_oft(_conv3(), target_modules=["0"], oft_block_size=4)
    theirs.save_pretrained(tmp_path)
    x = torch.randn(2, 4, 6, 6)
    with pytest.warns(UserWarning, match=r"kernels larger than 1 x 1"):
        ours = load_peft_oft_adapter(_conv3(), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs.merge_and_unload()(x), rtol=1e-5, atol=1e-5)
