"""Keeps bitsandbytes 4-bit weights in their exact, portable layout on every CPU.

bitsandbytes 0.50 repacks a ``Linear4bit`` weight *in place* at its first forward in eval mode without gradients
on CPUs with AVX512-BF16 (``bitsandbytes.functional._convert_weight_packed_for_cpu``): the nibbles are reordered
for its fused CPU GEMM, double-quantized scales are expanded and the per-block scales are rounded to bfloat16. Two
things then go wrong silently:

- the inverse (run by ``.cuda()``, ``state_dict()`` and our merges) cannot give the original scales back, so
  merges, saves and dequantized references work on corrupted weights;
- the repacked matmul (``bitsandbytes::gemv_4bit``) has no autograd, so in a later training step no gradient
  flows through that layer to the adapters before it (PEFT's LoRA on nf4 got gradients 48-54 % off).

AVX2-only CPUs (and GPUs) never take that path. :func:`keep_exact_4bit_layout` switches the repacking off for
every 4-bit layer of a model (bitsandbytes then runs its portable dequantize + matmul on CPU, which has autograd),
and refuses a model that an earlier forward already repacked: the exact weight cannot be restored from it.

A third CPU fault it cannot switch off: bitsandbytes 0.50's AVX512 CPU 4-bit dequantization restarts the
quantization blocks at every weight row (for widths that are a multiple of 16), while its quantizer lays them over the
flattened weight. A layer whose ``in_features`` is not a multiple of the blocksize therefore computes on such a CPU
with a scrambled weight (20-30 % off, against ~9 % for nf4 itself); AVX2-only CPUs take bitsandbytes' scalar path,
which is exact. Which one this machine takes is found by running it (:func:`cpu_dequantize_restarts_blocks`).
QOFT-adapted layers decode their stored weight themselves where it scrambles (``oftv2.bnb``); for every other such
layer :func:`keep_exact_4bit_layout` adds a forward pre-hook that warns once per model, at the first forward that
runs the scrambling kernel on such a layer on CPU, naming the layer.

A leaf module (it imports nothing else of peftplug, and bitsandbytes only if it is already imported: a 4-bit
layer cannot exist otherwise), so method packages may use it.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from collections.abc import Iterator

from torch import nn

#: What bitsandbytes' ``Linear4bit`` sets from the CPU's flags; False keeps the portable layout.
REPACK_SWITCH = "support_avx512bf16_for_cpu"


class RepackedWeightError(ValueError):
    """A 4-bit layer was repacked by bitsandbytes' CPU inference before peftplug could protect it."""


def _linear4bit_class() -> type | None:
    module = sys.modules.get("bitsandbytes.nn")
    return getattr(module, "Linear4bit", None) if module is not None else None


def four_bit_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` for every bitsandbytes ``Linear4bit`` in ``model`` (adapted bases included).

    Args:
        model: Any module.
    """
    cls = _linear4bit_class()
    if cls is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, cls):
            yield name, module


def is_repacked(layer: nn.Module) -> bool:
    """Whether a ``Linear4bit``'s weight is in bitsandbytes' CPU inference layout.

    Args:
        layer: A bitsandbytes ``Linear4bit``.
    """
    state = getattr(getattr(layer, "weight", None), "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def repacked_layers(model: nn.Module) -> list[str]:
    """Names of the 4-bit layers of ``model`` whose weight an earlier eval forward repacked.

    Args:
        model: Any module.
    """
    return [name for name, layer in four_bit_layers(model) if is_repacked(layer)]


def repacked_message(names: list[str]) -> str:
    """The one-line explanation for layers that were repacked before an adapter was attached.

    Args:
        names: The repacked layers' names (the first three are shown).
    """
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"4-bit layer(s) {shown} were repacked in place by an earlier eval forward (bitsandbytes' AVX512-BF16 CPU "
        "inference; its inverse rounds the scales, and the repacked matmul has no autograd), so the exact weight "
        "is lost: reload the model and attach the adapter before its first forward (peftplug's loader and "
        "PeftModule protect a model they load)"
    )


def refuse_repacked(model: nn.Module) -> None:
    """Raises :class:`RepackedWeightError` if any 4-bit layer of ``model`` is repacked.

    Args:
        model: Any module.
    """
    names = repacked_layers(model)
    if names:
        raise RepackedWeightError(repacked_message(names))


def keep_exact_4bit_layout(model: nn.Module) -> int:
    """Stops bitsandbytes from repacking any 4-bit layer of ``model``; refuses one already repacked.

    Idempotent, and harmless where the CPU has no AVX512-BF16 (the switch is already off there) or the layer is on
    a GPU (the switch only matters for CPU tensors).

    Args:
        model: Any module (a plain model, a PeftModel, or a single layer).

    Returns:
        The number of 4-bit layers seen.

    Raises:
        RepackedWeightError: Naming the layers an earlier forward repacked.
    """
    refuse_repacked(model)
    count = 0
    straddling = _StraddlingBlocks()
    for name, layer in four_bit_layers(model):
        setattr(layer, REPACK_SWITCH, False)
        count += 1
        if _blocks_straddle_rows(layer) and not any(
                isinstance(hook, _StraddlingBlocks.Hook) for hook in layer._forward_pre_hooks.values()):
            straddling.names.append(name)
            layer.register_forward_pre_hook(_StraddlingBlocks.Hook(straddling, name))
    return count


def keep_exact_4bit_layout_if_intact(model: nn.Module) -> int:
    """:func:`keep_exact_4bit_layout`, except that a model an earlier forward already repacked is left as it is (it
    still infers; what would train through it is refused where training starts): for adapters attached to a model
    the user may have run already (prompt learning, steering).

    Args:
        model: Any module.

    Returns:
        The number of 4-bit layers switched (0 for a repacked model).
    """
    return 0 if repacked_layers(model) else keep_exact_4bit_layout(model)


def _blocks_straddle_rows(layer: nn.Module) -> bool:
    """Whether a ``Linear4bit``'s quantization blocks straddle its rows (``in_features % blocksize != 0``)."""
    state = getattr(getattr(layer, "weight", None), "quant_state", None)
    shape, blocksize = getattr(state, "shape", None), getattr(state, "blocksize", None)
    return shape is not None and len(shape) == 2 and bool(blocksize) and int(shape[1]) % int(blocksize) != 0


@functools.cache
def cpu_dequantize_restarts_blocks(in_features: int, blocksize: int, quant_type: str) -> bool:
    """Whether this machine's bitsandbytes CPU dequantization restarts the quantization blocks at every row of a
    weight this wide: its AVX512 branch does, its scalar one (AVX2-only CPUs) does not.

    Found once per width by running it: a two-row weight is quantized and decoded as two rows and, the same bytes,
    as one row (where no block can restart); the two decodings differ exactly when the blocks restart.

    Args:
        in_features: The weight's row length.
        blocksize: Its quantization blocksize.
        quant_type: ``nf4`` or ``fp4``.
    """
    import copy

    import torch
    from bitsandbytes import functional as bnb_functional

    weight = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type)
    one_row = copy.copy(state)
    one_row.shape = torch.Size([1, 2 * in_features])
    as_rows = bnb_functional.dequantize_4bit(packed, state)
    return not torch.equal(as_rows, bnb_functional.dequantize_4bit(packed, one_row).reshape(as_rows.shape))


def cpu_kernel_scrambles(layer: nn.Module, x: object) -> bool:
    """Whether bitsandbytes 0.50's CPU kernel would compute ``layer(x)`` with a scrambled weight: ``x`` on CPU, the
    portable layout, quantization blocks that straddle rows, and a CPU whose kernel restarts them at every row
    (:func:`cpu_dequantize_restarts_blocks`).

    Args:
        layer: A bitsandbytes ``Linear4bit``.
        x: Its input.
    """
    if not (getattr(x, "is_cpu", False) and not is_repacked(layer) and _blocks_straddle_rows(layer)):
        return False
    state = layer.weight.quant_state
    return cpu_dequantize_restarts_blocks(int(state.shape[1]), int(state.blocksize), str(state.quant_type))


class _StraddlingBlocks:
    """The 4-bit layers of one model whose blocks straddle rows, and whether their warning was given."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.warned = False

    class Hook:
        """Forward pre-hook of one such layer: warns (once per model) when bitsandbytes' kernel runs it on CPU.

        A class, not a closure, so that a model holding it still pickles and deep-copies. A QOFT layer never calls
        its base layer on CPU in this case (it decodes the stored weight itself), so its hook never fires.

        Args:
            shared: The model's :class:`_StraddlingBlocks`.
            name: The layer's qualified name.
        """

        def __init__(self, shared: _StraddlingBlocks, name: str) -> None:
            self.shared, self.name = shared, name

        def __call__(self, layer: nn.Module, args: tuple) -> None:
            if self.shared.warned or not args or not cpu_kernel_scrambles(layer, args[0]):
                return
            self.shared.warned = True
            state = layer.weight.quant_state
            others = [n for n in self.shared.names if n != self.name]
            listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            also = (f"; the model's other 4-bit layers with such an in_features (exact where QOFT adapts them): "
                    f"{listed}") if others else ""
            warnings.warn(
                f"4-bit layer {self.name or type(layer).__name__!r} (in_features {int(state.shape[1])}, not a "
                f"multiple of the blocksize {int(state.blocksize)}) runs bitsandbytes' CPU kernel, which restarts the "
                "quantization blocks at every row: it computes with a scrambled weight (20-30 % off). Adapt it with "
                "QOFT (oftv2, which decodes the stored weight), run the model on a GPU, or load it with "
                f"quantization 'int8' or 'none'{also}",
                RuntimeWarning, stacklevel=2,
            )


#: Start-up messages about bitsandbytes' AVX512-BF16 CPU kernel, which only multiplies repacked weights: bitsandbytes
#: fetches it from the hub at import (through Hugging Face's `kernels`) and logs when it cannot (offline, or `kernels`
#: absent), and `kernels` logs that it skips the trust check offline. {logger name: message prefix}. A logger filter
#: only sees records its own logger creates, so each module that logs is named: `kernels` moved the trust check from
#: ``kernels.hf_hub`` (< 0.19) to ``kernels._internals.hf_hub`` (0.19).
_TRUST_CHECK = "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"
UNUSED_KERNEL_MESSAGES = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
    "kernels.hf_hub": _TRUST_CHECK,
    "kernels._internals.hf_hub": _TRUST_CHECK,
}


class _UnusedKernelMessages(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def hide_unused_kernel_warning() -> None:
    """Drops the start-up messages about bitsandbytes' CPU hub kernel (idempotent; call before bitsandbytes loads).

    That kernel only runs on repacked weights, which peftplug's loader never lets exist, so on AVX512-BF16 CPUs the
    messages (error-looking lines on the first screen of every ``peftplug`` command) concern something peftplug does
    not use. Every other message of those loggers is left alone.
    """
    for name, prefix in UNUSED_KERNEL_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _UnusedKernelMessages) for f in logger.filters):
            logger.addFilter(_UnusedKernelMessages(prefix))
