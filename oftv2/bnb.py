"""QOFT: OFTv2 on bitsandbytes 4-bit (``Linear4bit``: NF4/FP4, with or without double quantization) and 8-bit
(``Linear8bitLt``) bases.

Forward: rotate the input block-wise (the adapter stays fp32/bf16), then call the quantized layer unchanged (on CPU,
where bitsandbytes' kernels scramble layers whose quantization blocks straddle rows, decode the weight here). On
CUDA with Triton, a single active adapter on a 4-bit base can run the fused ``peftplug_kernels.ops.nf4_rotate_matmul``
(rotation in the GEMM prologue, 4-bit dequantized on the fly) instead: always with ``kernel_impl="triton"`` (a
``ValueError`` naming the layer where the fused kernel cannot run it, e.g. fp32 compute), and under ``"auto"`` only
on layers it takes, up to the token count ``peftplug_kernels.dispatch_table`` gives for the device (0 on every
device measured so far: the fused kernel was slower than rotate + bitsandbytes at every size on an H200).

Merge into a quantized base: dequantize -> ``W Rᵀ`` (fp32) -> requantize with the same quant type, blocksize,
double-quant setting and storage dtype; unmerge likewise with the exact inverse. Requantization moves the
weights to a new 4-bit grid, so a merged quantized model is close to, not equal to, the unmerged adapter:
:func:`merge_drift` measures that on a calibration batch, and :func:`merge_and_export_full_precision` avoids it by
returning a full-precision model with the rotations folded in.

This is the only module of ours that imports bitsandbytes, and only lazily: the dispatchers recognise bnb layers
through ``sys.modules`` (a bnb layer can only exist once bitsandbytes is imported), so adapting an ordinary model
never imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from peftplug.optional import bitsandbytes_available
from peftplug.quantized_layout import (
    RepackedWeightError,
    cpu_kernel_scrambles,
    is_repacked,
    keep_exact_4bit_layout,
    repacked_message,
)
from peftplug_kernels import dispatch_table, ops
from peftplug_kernels.nf4_rotate_matmul.fit import HALF_DTYPES, w4a16_unfit

from .config import OFTv2Config
from .dispatch import FUSE_ALWAYS, KernelPlan, choose_impl
from .drift import merge_drift  # noqa: F401  (public here: oftv2.bnb.merge_drift)
from .layer import Linear
from .merge_order import merged_weight


def _bnb():
    if not bitsandbytes_available():
        raise ImportError("quantized OFTv2 layers need bitsandbytes (pip install bitsandbytes)")
    import bitsandbytes

    return bitsandbytes


def _loaded_bnb_class(name: str) -> type | None:
    """``bitsandbytes.nn.<name>`` if bitsandbytes is already imported, else ``None`` (imports nothing)."""
    module = sys.modules.get("bitsandbytes.nn")
    return getattr(module, name, None) if module is not None else None


def _exact_4bit_weight(base: nn.Module, layer_name: str = "") -> Any:
    """The portable 4-bit weight of a ``Linear4bit``; refuses one that bitsandbytes' CPU inference repacked.

    Args:
        base: A bitsandbytes ``Linear4bit``.
        layer_name: Its qualified name, for the error message.

    Raises:
        RepackedWeightError: The weight was repacked in place by an eval forward before the adapter protected it
            (bitsandbytes' inverse rounds the scales to bf16, so the exact weight is gone).
    """
    if is_repacked(base):
        raise RepackedWeightError(repacked_message([layer_name or type(base).__name__]))
    return base.weight


def dequantize_4bit_weight(base: nn.Module) -> torch.Tensor:
    """The fp32 ``out × in`` weight of a ``Linear4bit``: ``code[nibble] · absmax`` exactly, the stored format's values.

    Not bitsandbytes' ``dequantize_4bit``, which rounds to the state's dtype (a bf16-loaded model's fp32-compute
    forward multiplies by the unrounded values, so merges and exports lost ~1e-3) and, on CPU, restarts quantization
    blocks at every row (wrong where blocks straddle rows; its quantizer and GPU kernels do not).

    Args:
        base: A bitsandbytes ``Linear4bit`` in the portable layout (see :mod:`peftplug.quantized_layout`).
    """
    weight = _exact_4bit_weight(base)
    return ops.dequantize_4bit(weight.data, weight.quant_state, torch.float32).float()


# Block scales tried by the "mse" requantization, as fractions of the block's absmax (1.0 = bitsandbytes' own).
MSE_SCALE_GRID = tuple(0.70 + 0.025 * i for i in range(13))
REQUANTIZATION_MODES = ("auto", "mse", "absmax")


def resolve_requantization(mode: str, quant_type: str) -> str:
    """``"auto"`` -> ``"mse"`` for NF4, ``"absmax"`` for FP4; other modes unchanged.

    Measured (docs/benchmarks/qoft.md): MSE-optimal scales lowered the merged NF4 model's logit drift by ~10% in
    every setting, while for FP4 the gain in weight error did not carry over to the outputs (±1% either way),
    so FP4 keeps bitsandbytes' absmax scales.

    Args:
        mode: ``"auto"``, ``"mse"`` or ``"absmax"``.
        quant_type: ``"nf4"`` or ``"fp4"``.
    """
    if mode == "auto":
        return "mse" if quant_type == "nf4" else "absmax"
    return mode


def quantize_4bit(weight: torch.Tensor, quant_type: str, blocksize: int, nested: bool, dtype: torch.dtype,
                  mode: str = "auto") -> tuple[torch.Tensor, Any]:
    """Quantizes ``weight`` to the bitsandbytes 4-bit format (packed nibbles, high first; per-block absmax).

    ``mode="absmax"`` reproduces ``bitsandbytes.functional.quantize_4bit`` (scale = block absmax).
    ``mode="mse"`` picks, per block, the scale from :data:`MSE_SCALE_GRID` × absmax that minimises the block's
    squared error (values beyond the scale are clipped to ±1 code). The stored format is unchanged — bitsandbytes
    dequantizes ``code[nibble] * absmax`` whatever absmax holds — so any bnb kernel reads it; it only lowers the
    requantization error of a merge.

    Args:
        weight: ``out × in`` weight.
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: Elements per scale.
        nested: Double-quantize the scales (bitsandbytes' ``compress_statistics``).
        dtype: The dtype the state dequantizes to.
        mode: ``"mse"``, ``"absmax"`` or ``"auto"`` (see :func:`resolve_requantization`).

    Returns:
        ``(packed uint8 [(n + 1) // 2, 1], QuantState)``.
    """
    if mode not in REQUANTIZATION_MODES:
        raise ValueError(f"requantization mode must be one of {REQUANTIZATION_MODES}, got {mode!r}")
    mode = resolve_requantization(mode, quant_type)
    bnbf = _bnb().functional
    device = weight.device
    flat = weight.detach().reshape(-1).float()
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, (-n) % blocksize))
    blocks = padded.view(-1, blocksize)
    amax = blocks.abs().amax(dim=1)
    code = bnbf.get_4bit_type(quant_type, device=device)
    order = torch.argsort(code)
    midpoints = (code[order[:-1]] + code[order[1:]]) / 2
    best_err = best_scale = best_idx = None
    for alpha in (1.0,) if mode == "absmax" else MSE_SCALE_GRID:
        scale = (amax * alpha).clamp(min=1e-38)
        scaled = torch.clamp(blocks * (1.0 / scale.view(-1, 1)), -1, 1)
        idx = order[torch.bucketize(scaled, midpoints, out_int32=True)]
        err = ((code[idx] * scale.view(-1, 1) - blocks) ** 2).sum(dim=1)
        if best_err is None:
            best_err, best_scale, best_idx = err, amax * alpha, idx
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, amax * alpha, best_scale)
            best_idx = torch.where(better.view(-1, 1), idx, best_idx)
    q = best_idx.reshape(-1)[:n]
    q = torch.nn.functional.pad(q, (0, n % 2)).to(torch.uint8)
    packed = ((q[::2] << 4) | q[1::2]).unsqueeze(1)
    absmax = best_scale.float()
    if nested:
        offset = absmax.mean()
        qabsmax, state2 = bnbf.quantize_blockwise(absmax - offset, blocksize=256)
        state = bnbf.QuantState(absmax=qabsmax, shape=weight.shape, dtype=dtype, blocksize=blocksize, code=code,
                                quant_type=quant_type, offset=offset, state2=state2)
    else:
        state = bnbf.QuantState(absmax=absmax, shape=weight.shape, dtype=dtype, blocksize=blocksize, code=code,
                                quant_type=quant_type)
    return packed, state


def requantize_4bit_weight(base: nn.Module, weight: torch.Tensor, mode: str = "auto") -> None:
    """Replaces a ``Linear4bit``'s weight by ``weight`` quantized with the layer's own settings.

    Same quant type, blocksize, double quantization and storage dtype as before; the state's dtype (the dtype the
    layer dequantizes to) is kept too.

    Args:
        base: A bitsandbytes ``Linear4bit``.
        weight: New ``out × in`` weight (any float dtype).
        mode: ``"auto"`` (default, see :func:`resolve_requantization`), ``"mse"`` (per-block MSE-optimal scales)
            or ``"absmax"`` (bitsandbytes' own quantizer).
    """
    bnb = _bnb()
    old = base.weight
    mode = resolve_requantization(mode, old.quant_type)
    dtype = old.quant_state.dtype if old.quant_state is not None else weight.dtype
    settings = {"blocksize": old.blocksize, "compress_statistics": old.compress_statistics,
                    "quant_type": old.quant_type, "quant_storage": old.quant_storage, "module": base}
    if mode == "absmax":
        # Params4bit quantizes when moved to a device (also the one it is on).
        new = bnb.nn.Params4bit(weight.detach().to(dtype).contiguous(), requires_grad=False, **settings)
        base.weight = new.to(weight.device)
        return
    # Quantize what the base would have been stored as (its dtype), from fp32 math.
    packed, state = quantize_4bit(weight.to(dtype), old.quant_type, old.blocksize, old.compress_statistics, dtype,
                                  mode=mode)
    if old.quant_storage != torch.uint8:
        packed = packed.squeeze(1).view(old.quant_storage).unsqueeze(1)
    base.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True, **settings)


def _int8_scales(base: nn.Module) -> torch.Tensor:
    scb = base.weight.SCB if getattr(base.weight, "SCB", None) is not None else base.state.SCB
    if scb is None:
        raise RuntimeError("Linear8bitLt has no row scales (SCB): was it moved to a device after loading?")
    return scb


def dequantize_8bit_weight(base: nn.Module) -> torch.Tensor:
    """The fp32 ``out × in`` weight of a ``Linear8bitLt`` (int8 rows times their absmax / 127).

    Args:
        base: A bitsandbytes ``Linear8bitLt`` with int8 weights.
    """
    weight = base.weight
    if weight.dtype != torch.int8:  # has_fp16_weights=True: still a plain float weight
        return weight.data.float()
    return weight.data.float() * (_int8_scales(base).float().view(-1, 1) / 127.0)


def requantize_8bit_weight(base: nn.Module, weight: torch.Tensor) -> None:
    """Replaces a ``Linear8bitLt``'s weight by ``weight`` requantized row-wise to int8.

    Args:
        base: A bitsandbytes ``Linear8bitLt``.
        weight: New ``out × in`` weight.
    """
    bnb = _bnb()
    old = base.weight
    if old.dtype != torch.int8:  # has_fp16_weights=True: a float weight that each forward quantizes
        with torch.no_grad():
            old.data.copy_(weight.to(old.dtype))
        # An eval forward reuses the int8 copy the last forward cached (state.CB): without this it ran the old weight.
        base.state.reset_grads()
        return
    device = weight.device
    base.weight = bnb.nn.Int8Params(
        weight.detach().to(torch.float16).contiguous().cpu(), requires_grad=False,
        has_fp16_weights=old.has_fp16_weights,
    ).to(device)
    # The matmul state caches the previous int8 weight and scales.
    base.state.reset_grads()
    base.state.SCB = None


class _QuantizedOFTv2(Linear):
    """OFTv2 around a quantized linear layer: rotate the input, then call the quantized layer unchanged.

    Forward, disable and merge bookkeeping are :class:`oftv2.layer.Linear`'s; subclasses provide the base weight
    access (dequantize / requantize) that merge and unmerge go through.

    Args:
        base_layer: The bitsandbytes layer (possibly wrapped by another tuner).
        adapter_name: Name of the first adapter.
        config: Its configuration.
        **kwargs: ``layer_name`` for error messages.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: OFTv2Config, **kwargs: Any) -> None:
        super().__init__(base_layer, adapter_name, config, fan_in_fan_out=False, **kwargs)

    def full_precision_weight(self, adapter_names: list[str] | None = None) -> torch.Tensor:
        """The fp32 base weight with the given adapters (default: active ones) folded in, never requantized.

        Adapters merged into the quantized weight already stay in it; the others are folded in forward order
        relative to them (:func:`oftv2.merge_order.merged_weight`).

        Args:
            adapter_names: Adapters to fold in.
        """
        names = [a for a in (self.active_adapters if adapter_names is None else adapter_names)
                 if a in self.oftv2_Q and a not in self.merged_adapters]
        weight, _ = merged_weight(self, self._get_base_weight(), self.merged_adapters, names)
        return weight


class Linear4bit(_QuantizedOFTv2):
    """OFTv2 around bitsandbytes ``Linear4bit`` (NF4 or FP4, double quantization or not, any compute dtype).

    Args:
        base_layer: The ``Linear4bit``.
        adapter_name: Name of the first adapter.
        config: Its configuration.
        **kwargs: ``layer_name`` for error messages.
    """

    # How merge/unmerge requantize: "auto", "mse" (per-block MSE-optimal scales) or "absmax" (bitsandbytes').
    requantization: str = "auto"

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: OFTv2Config, **kwargs: Any) -> None:
        base = _base_of(base_layer)
        # bitsandbytes 0.50 repacks a 4-bit weight in place at its first CPU eval forward on AVX512-BF16 CPUs (bf16
        # scales, a lossy inverse, and a matmul without autograd). Merges and gradients need the exact weight, so
        # a layer already repacked is refused and the others are kept in the portable layout from here on; their
        # CPU inference uses bitsandbytes' dequantize + matmul instead.
        _exact_4bit_weight(base, kwargs.get("layer_name", ""))
        keep_exact_4bit_layout(base)
        # Read by _plan_kernels, which runs inside super().__init__ (a plain attribute may precede Module.__init__).
        self._layer_name = kwargs.get("layer_name", "")
        super().__init__(base_layer, adapter_name, config, **kwargs)

    def _get_base_weight(self) -> torch.Tensor:
        return dequantize_4bit_weight(self.get_base_layer())

    def _set_base_weight(self, weight: torch.Tensor) -> None:
        requantize_4bit_weight(self.get_base_layer(), weight, mode=self.requantization)

    def update_layer(self, adapter_name: str, config: OFTv2Config, **kwargs) -> None:
        """Adds the adapter, refusing ``kernel_impl='triton'`` on a layer the fused kernels do not take.

        Args:
            adapter_name: Name of the adapter.
            config: Its configuration.
            **kwargs: As for :meth:`OFTv2Layer.update_layer`.

        Raises:
            ValueError: One line naming the layer and the reason, before anything is registered (a half-built
                adapter would make every later kernel refresh, e.g. at ``.to()``, raise).
        """
        if config.kernel_impl == "triton" and getattr(self.get_base_layer().weight, "quant_state", None) is not None:
            why_not = self._w4a16_unfit()
            if why_not:
                raise self._fused_refusal(why_not)
        super().update_layer(adapter_name, config, **kwargs)

    def _w4a16_unfit(self, dtype: torch.dtype | None = None) -> str:
        """Why the fused kernels cannot take this layer, ``""`` when they can (one rule, fit.py; docs/kernels.md).

        Args:
            dtype: The compute dtype (default: the layer's ``compute_dtype``; when that is unset the forward computes
                in the activations' dtype, so only the weight's rules are judged here and the dtype per forward).
        """
        base = self.get_base_layer()
        state = base.weight.quant_state
        return w4a16_unfit(dtype or base.compute_dtype or HALF_DTYPES[-1], tuple(state.shape), state)

    def _fused_refusal(self, why_not: str) -> ValueError:
        """The one-line error for ``kernel_impl='triton'`` on a layer the fused kernels do not take."""
        where = f"layer {self._layer_name!r}" if getattr(self, "_layer_name", "") else "this layer"
        return ValueError(f"kernel_impl='triton' forces the fused NF4 kernel, which cannot run {where}: {why_not} "
                          "(kernel_impl='auto' runs it unfused: rotation, then bitsandbytes' matmul)")

    def _plan_kernels(self, adapter_name: str) -> KernelPlan:
        """The linear layer's plan plus up to how many tokens this adapter runs the fused 4-bit kernel.

        Args:
            adapter_name: Name of the adapter.
        """
        plan = super()._plan_kernels(adapter_name)
        impl = plan.settings.impl
        weight = self.get_base_layer().weight
        if impl == "torch" or getattr(weight, "quant_state", None) is None:
            return plan
        if impl == "triton":  # (update_layer refused the layers it cannot take; _fused_adapter checks each forward)
            return plan._replace(fused_max_tokens=FUSE_ALWAYS)
        if self._w4a16_unfit() or choose_impl(impl, "nf4_rotate_matmul", weight) != "triton":
            return plan
        return plan._replace(fused_max_tokens=dispatch_table.fused_nf4_max_tokens(weight.device))

    def _fused_adapter(self, x: torch.Tensor) -> str | None:
        """The adapter to run through the fused rotate + 4-bit matmul kernel, or ``None`` for the unfused path.

        Raises:
            ValueError: When ``kernel_impl='triton'`` forces the fused kernel on a layer or compute it does not take
                (a layer without ``compute_dtype`` computes in the activations' dtype, known only here).
        """
        active = [a for a in self.active_adapters if a in self.oftv2_Q]
        if len(active) != 1:
            return None
        max_tokens = self.kernel_plan(active[0]).fused_max_tokens
        if max_tokens == 0:
            return None
        base = self.get_base_layer()
        if getattr(base.weight, "quant_state", None) is None or is_repacked(base):
            return None
        compute = base.compute_dtype or x.dtype
        if max_tokens == FUSE_ALWAYS:  # forced, at any size: the whole rule again, so that the error names this layer
            why_not = self._w4a16_unfit(compute)
            if why_not:
                raise self._fused_refusal(why_not)
            return active[0]
        # (The plan judged the rest of the rule.)
        if compute not in HALF_DTYPES or x.numel() > max_tokens * x.shape[-1]:
            return None
        return active[0]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = None if self.disable_adapters or self.merged else self._fused_adapter(x)
        if name is None:
            base = self.base_layer
            if args or kwargs or not cpu_kernel_scrambles(base, x) or base is not self.get_base_layer():
                return super().forward(x, *args, **kwargs)
            return _stored_weight_forward(base, x if self.adapters_bypassed() else self.rotate_input(x))
        base = self.get_base_layer()
        compute = base.compute_dtype or x.dtype
        bias = None if base.bias is None else base.bias.to(compute)
        rotation = self.forward_rotation(name)
        # The plan chose the fused kernel: "triton", resolved already (no dispatch in the forward).
        y = ops.nf4_rotate_matmul(x.to(compute), rotation, base.weight, base.weight.quant_state, bias, impl="triton")
        return y.to(x.dtype)


class _StoredWeightLinear(torch.autograd.Function):
    """``x deq(W)ᵀ + b`` with ``deq(W)`` decoded from the stored format; decoded again in the backward (not kept)."""

    @staticmethod
    def forward(ctx, x, weight, quant_state, bias):
        ctx.save_for_backward(weight)
        ctx.quant_state = quant_state
        return torch.nn.functional.linear(x, ops.dequantize_4bit(weight, quant_state, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.saved_tensors[0]
        grad_x = grad @ ops.dequantize_4bit(weight, ctx.quant_state, grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias


def _stored_weight_forward(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' ``Linear4bit.forward`` (compute dtype, bias cast, output dtype) on the stored weight.

    Args:
        base: A ``Linear4bit`` for which :func:`peftplug.quantized_layout.cpu_kernel_scrambles` holds; x: its
            (rotated) input.
    """
    if not getattr(base, "compute_type_is_set", True):  # as bitsandbytes: the first input sets an unset dtype
        base.set_compute_type(x)
        base.compute_type_is_set = True
    compute = base.compute_dtype or x.dtype
    bias = None if base.bias is None else base.bias.to(compute)
    return _StoredWeightLinear.apply(x.to(compute), base.weight.data, base.weight.quant_state, bias).to(x.dtype)


class Linear8bitLt(_QuantizedOFTv2):
    """OFTv2 around bitsandbytes ``Linear8bitLt`` (LLM.int8()).

    Args:
        base_layer: The ``Linear8bitLt``.
        adapter_name: Name of the first adapter.
        config: Its configuration.
        **kwargs: ``layer_name`` for error messages.
    """

    def _get_base_weight(self) -> torch.Tensor:
        return dequantize_8bit_weight(self.get_base_layer())

    def _set_base_weight(self, weight: torch.Tensor) -> None:
        requantize_8bit_weight(self.get_base_layer(), weight)


def _base_of(target: nn.Module) -> nn.Module:
    return target.get_base_layer() if isinstance(target, BaseTunerLayer) else target


def _dispatcher(bnb_class: str, layer_cls: type) -> Any:
    def dispatch(target: nn.Module, adapter_name: str, config: OFTv2Config, **kwargs) -> nn.Module | None:
        cls = _loaded_bnb_class(bnb_class)
        if cls is None or not isinstance(_base_of(target), cls):
            return None
        return layer_cls(target, adapter_name, config, **kwargs)

    dispatch.__doc__ = f"""Wraps bitsandbytes ``{bnb_class}`` layers in :class:`{layer_cls.__name__}`; ``None`` for others.

    Args:
        target: The module to adapt.
        adapter_name: Name of the adapter.
        config: Its configuration.
        **kwargs: Passed to the layer.
    """
    return dispatch


dispatch_bnb_4bit = _dispatcher("Linear4bit", Linear4bit)
dispatch_bnb_8bit = _dispatcher("Linear8bitLt", Linear8bitLt)

# Tried by oftv2.model.dispatchers() before the default (nn.Linear / Conv1D) dispatcher.
DISPATCHERS = [dispatch_bnb_8bit, dispatch_bnb_4bit]


def _parent_and_name(root: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    parent_name, _, child = qualified.rpartition(".")
    return (root.get_submodule(parent_name) if parent_name else root), child


def _unquantized_dtype(model: nn.Module, adapter_prefix: str) -> torch.dtype:
    """The floating dtype holding most elements among ``model``'s parameters that are neither quantized nor adapter
    weights: the dtype the model was loaded in, which its 8-bit layers were quantized from.

    ``Linear8bitLt`` keeps no record of that dtype (unlike a 4-bit layer's quantization state), and its forward
    returns the input's dtype, so the layers around it (embeddings, norms, head) run in this dtype and an exported
    layer must match them.

    Args:
        model: The model being exported.
        adapter_prefix: The tuner's parameter prefix (``oftv2_``); adapter weights may be kept in another dtype.
    """
    counts: dict[torch.dtype, int] = {}
    for name, param in model.named_parameters():
        # int8 / packed 4-bit weights are not floating; the class test also skips them before quantization.
        if (not param.is_floating_point() or adapter_prefix in name
                or type(param).__name__ in ("Int8Params", "Params4bit")):
            continue
        counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    # A model with nothing else in floating point (not seen with transformers' loaders): LLM.int8()'s usual dtype.
    return max(counts, key=counts.__getitem__) if counts else torch.float16


def _dense_linear(base: nn.Module, weight: torch.Tensor, dtype: torch.dtype | None,
                  default_8bit: torch.dtype) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` (``out × in``) and ``base``'s bias.

    Args:
        base: The quantized layer being replaced.
        weight: Its full-precision weight (adapters folded in or not).
        dtype: Output dtype; default: the 4-bit state's dtype, ``default_8bit`` for 8-bit layers.
        default_8bit: The default for 8-bit layers (see :func:`_unquantized_dtype`).
    """
    state = getattr(base.weight, "quant_state", None)
    out_dtype = dtype or (state.dtype if state is not None else default_8bit)
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=base.bias is not None, device=weight.device,
                      dtype=out_dtype)
    with torch.no_grad():
        dense.weight.copy_(weight.to(out_dtype))
        if base.bias is not None:
            dense.bias.copy_(base.bias.to(out_dtype))
    return dense


def merge_and_export_full_precision(peft_model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Folds the active OFTv2 adapters into full-precision weights and returns the plain base model.

    Quantized layers become ``nn.Linear`` holding ``deq(W) Rᵀ`` (no requantization, hence no merge drift; an
    adapter already merged into the quantized weight is exported as it is now, not folded in twice); the rest goes
    through PEFT's ``merge_and_unload`` (unquantized OFTv2 layers merged, ``modules_to_save`` copies unwrapped).
    The model's quantization markers are cleared so that ``save_pretrained`` writes an ordinary checkpoint.

    Args:
        peft_model: A ``PeftModel`` (or the ``OFTv2Model`` tuner) with OFTv2 adapters.
        dtype: Weight dtype of the exported quantized layers (default: the dtype the base was quantized from: a
            4-bit layer's quantization-state dtype; for 8-bit layers, which keep no record of it, the dtype of the
            model's other floating parameters, so the export runs with them).

    Returns:
        The underlying transformers model, adapters removed. ``peft_model`` must not be used afterwards.
    """
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(peft_model, PeftModel):
        tuner = peft_model.base_model
    elif isinstance(peft_model, BaseTuner):
        tuner = peft_model
    else:
        raise TypeError(f"expected a PeftModel or an OFTv2Model, got {type(peft_model).__name__}")
    quantized = tuple(c for c in map(_loaded_bnb_class, ("Linear4bit", "Linear8bitLt")) if c is not None)
    # Before any layer is replaced: afterwards the exported layers themselves would be counted.
    default_8bit = _unquantized_dtype(tuner.model, tuner.prefix)
    for name, module in list(tuner.model.named_modules()):
        if isinstance(module, _QuantizedOFTv2):
            base = module.get_base_layer()
            pending = [a for a in module.active_adapters if a not in module.merged_adapters]
            with torch.no_grad():
                weight = module.full_precision_weight(pending)
        elif quantized and isinstance(module, quantized) and not name.endswith("base_layer"):
            # A quantized layer no adapter targets: dequantized too, so the export holds no bnb layer at all.
            base = module
            is_4bit = getattr(base.weight, "quant_state", None) is not None
            weight = dequantize_4bit_weight(base) if is_4bit else dequantize_8bit_weight(base)
        else:
            continue
        parent, child = _parent_and_name(tuner.model, name)
        setattr(parent, child, _dense_linear(base, weight, dtype, default_8bit))
    model = tuner.merge_and_unload()
    for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized"):
        if getattr(model, attr, False):
            setattr(model, attr, False)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    return model
