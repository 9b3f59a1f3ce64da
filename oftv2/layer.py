"""OFTv2 tuner layers: rotate the input block-wise, then call the untouched base layer.

Conventions (row vectors, PyTorch weight layout ``W``: out × in, ``y = x Wᵀ + b``):
    forward   ``y = base_layer(x R)`` with ``R`` block-diagonal (``peftplug_kernels.ops.block_rotate``);
    merge     ``W' = W Rᵀ`` (so that ``x' Wᵀ = x (W Rᵀ)ᵀ``);
    unmerge   ``W = W' R⁻ᵀ`` computed with a linear solve, exact even when a truncated Neumann series
              made ``R`` slightly non-orthogonal.
Several active adapters compose as successive rotations in ``active_adapters`` order:
``y = base_layer(x R₁ R₂ … Rₙ)``, hence a merge folds them in as ``W Rₙᵀ … R₁ᵀ``.

This module holds the shared layer state (:class:`OFTv2Layer`) and the ``nn.Linear`` / GPT-2 ``Conv1D`` layer;
``oftv2.conv`` (``nn.Conv2d``) and ``oftv2.embedding`` (``nn.Embedding``, rotation on the output) build on it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from torch import nn

from peftplug.adapter_params import AdapterParameterDict
from peftplug_kernels import dispatch_table, ops
from peftplug_kernels.cayley_neumann.reference import triangle_size
from peftplug_kernels.cayley_rotate.function import compute_dtype
from peftplug_kernels.cayley_rotate.reference import drop_blocks
from peftplug_kernels.cayley_rotate.stacked import rotate_by

from .activation_checkpoint import inside_activation_checkpoint
from .config import OFTv2Config
from .dispatch import KernelPlan, plan_kernels
from .merge_order import merged_weight
from .rotation_cache import cache_usable, cached_rotation
from .rotation_cache import clear as clear_rotation_cache
from .scaling import RotationScale


@dataclass(frozen=True)
class RotationSettings:
    """How one adapter turns its parameters into rotation blocks.

    Args:
        form: ``"cayley_neumann"``, ``"cayley"`` or ``"peft_cn"``.
        terms: Neumann series length.
        dropout: Block-dropout probability (training mode only).
        max_q_norm: Frobenius-norm bound per skew block, or ``None``.
        block_share: Whether one block is shared across the width.
        impl: Kernel implementation (``"auto"``, ``"torch"``, ``"triton"``).
        conv_evaluation: How a ``Conv2d`` layer applies the rotation (``"auto"``, ``"weight"`` or ``"input"``,
            see ``oftv2.conv``); other layer types ignore it.
    """

    form: str
    terms: int
    dropout: float
    max_q_norm: float | None
    block_share: bool
    impl: str
    conv_evaluation: str = "auto"


# Attribute of a layer holding ``{adapter name: rotation blocks}`` while oftv2.stacking's hooks run a forward.
STACKED_ATTR = "_oftv2_stacked"


def valid_block_sizes(width: int) -> list[int]:
    """Block sizes (>= 2) that divide ``width``.

    Args:
        width: A layer's input width.
    """
    return [b for b in range(2, width + 1) if width % b == 0]


def resolve_block_size(
    width: int, block_size: int | None, r: int | None, layer_name: str = "", width_label: str = "input width"
) -> int:
    """The block size a layer of input ``width`` gets from a config's ``block_size`` or ``r``.

    Args:
        width: The layer's input width.
        block_size: Requested block size, or ``None`` when ``r`` is given.
        r: Requested number of blocks, or ``None``.
        layer_name: Used in the error message.
        width_label: What the width is, for the error message (e.g. a conv's flattened filter width).

    Raises:
        ValueError: If the width is not divisible as requested; lists the valid values.
    """
    where = f" of layer {layer_name!r}" if layer_name else ""
    if block_size is not None:
        if width % block_size != 0:
            raise ValueError(
                f"block_size={block_size} does not divide the {width_label} {width}{where}; "
                f"valid block sizes: {valid_block_sizes(width)} (or exclude the layer via exclude_modules)"
            )
        return block_size
    if r is None or width % r != 0 or width // r < 2:
        raise ValueError(
            f"r={r} blocks do not split the {width_label} {width}{where} into equal blocks of size >= 2; "
            f"valid r: {[width // b for b in valid_block_sizes(width)]}"
        )
    return width // r


def rotate_weight(weight: torch.Tensor, rotation: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``W Rᵀ`` block-wise over the last dimension of ``weight`` (differentiable; the weight-centric product).

    ``x (W Rᵀ)ᵀ = (x R) Wᵀ``, so a layer that multiplies by the rotated weight computes what the input-centric
    forward computes.

    Args:
        weight: ``[out, n_blocks * b]``.
        rotation: ``[n_blocks, b, b]`` or ``[1, b, b]`` (shared block).
        impl: Kernel implementation (``"auto"``, ``"torch"``, ``"triton"``).
    """
    # Row i of W Rᵀ is (row i of W) Rᵀ: the block rotation of the rows by the transposed blocks.
    return ops.block_rotate(weight, rotation.transpose(-1, -2), impl=impl)


def series_input(q_param: torch.Tensor, max_q_norm: float | None) -> torch.Tensor:
    """The triangles the series reads: bounded by ``max_q_norm`` (:func:`bound_q`), in fp32 at least.

    Half-precision skew parameters (a bf16 model, or TRL casting a quantized model's adapter to bf16) give the series
    and the rotation in fp32, as the fused kernel computes inside: powers of Q in bf16 lose ~2e-3 per entry, and an
    fp32 rotation is exactly what the saved adapter computes once PEFT reloads it in fp32. Every consumer casts the
    blocks to its own compute dtype.

    Args:
        q_param: An adapter's ``[n_blocks, b(b-1)/2]`` parameter.
        max_q_norm: Its bound, or ``None``.
    """
    q_vec = bound_q(q_param, max_q_norm)
    dtype = compute_dtype(q_vec.dtype)
    return q_vec if q_vec.dtype == dtype else q_vec.to(dtype)


def bound_q(q_vec: torch.Tensor, max_q_norm: float | None) -> torch.Tensor:
    """Rescales each block's triangle so that its skew matrix has Frobenius norm <= ``max_q_norm``.

    Differentiable; blocks inside the bound are unchanged. ``||Q||_2 <= ||Q||_F``, so a bound < 1 keeps the
    Neumann series convergent.

    Args:
        q_vec: ``[n_blocks, b(b-1)/2]`` triangles.
        max_q_norm: The bound, or ``None`` (returns ``q_vec``).
    """
    if max_q_norm is None:
        return q_vec
    # ||Q_i||_F = sqrt(2) ||triangle_i||: each entry appears twice in the skew matrix.
    work = torch.promote_types(q_vec.dtype, torch.float32)
    norms = math.sqrt(2.0) * torch.linalg.vector_norm(q_vec.to(work), dim=-1, keepdim=True)
    scale = torch.clamp(max_q_norm / norms.clamp_min(torch.finfo(torch.float32).tiny), max=1.0)
    return q_vec * scale.to(q_vec.dtype)


class OFTv2Layer(RotationScale, BaseTunerLayer):
    """Adapter state shared by every OFTv2 layer type: per-adapter skew parameters and their settings.

    Subclasses for other base layers (e.g. quantized ones) override :meth:`_get_base_weight` and
    :meth:`_set_base_weight`; merge/unmerge only go through those two.

    Args:
        base_layer: The layer being adapted (``nn.Linear``, GPT-2 ``Conv1D``, or a quantized linear).
        **kwargs: Kept for PEFT compatibility.
    """

    adapter_layer_names: tuple[str, ...] = ("oftv2_Q",)
    other_param_names: tuple[str, ...] = ("oftv2_block_size", "oftv2_n_blocks", "oftv2_settings", "oftv2_dropout")
    # False: R acts on the layer's input and a merge computes W Rᵀ (Linear, Conv). True: R acts on the layer's
    # output rows, y = base(x) R, and a merge computes W R (Embedding, whose weight rows are its outputs).
    rotates_output: bool = False
    # What rotation_width() measures, for error messages.
    width_label: str = "input width"
    # Whether oftv2.stack_rotations hooked the model around this layer (set per layer while its hooks exist).
    oftv2_stacking: bool = False

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        # Strict upper triangles of the skew blocks: [n_blocks (1 if shared), b(b-1)/2] per adapter, named
        # `oftv2_Q.<adapter>.weight` as PEFT's module-based tuners name theirs (see peftplug.adapter_params).
        self.oftv2_Q = AdapterParameterDict()
        self.oftv2_block_size: dict[str, int] = {}
        self.oftv2_n_blocks: dict[str, int] = {}
        self.oftv2_settings: dict[str, RotationSettings] = {}
        # Block dropout as an nn.Dropout whose `p` the forward reads (as LoRA's `lora_dropout`): TRL's `disable_dropout`
        # (DPOTrainer's default) sets p = 0 on every nn.Dropout, and must switch block dropout off too.
        self.oftv2_dropout = nn.ModuleDict()
        # Kernels each adapter runs on its current device (oftv2.dispatch): resolved here and on moves, read by
        # every forward.
        self._oftv2_kernels: dict[str, KernelPlan] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        self.kwargs = kwargs
        in_features, out_features = _get_in_out_features(self.get_base_layer())
        self.in_features = in_features
        self.out_features = out_features

    def update_layer(
        self, adapter_name: str, config: OFTv2Config, inference_mode: bool = False, **kwargs
    ) -> None:
        """Adds (or re-creates) the adapter ``adapter_name`` on this layer.

        Args:
            adapter_name: Name of the adapter.
            config: Its configuration.
            inference_mode: Whether the adapter is frozen.
            **kwargs: ``layer_name`` for error messages.
        """
        width = self.rotation_width()
        b = resolve_block_size(
            width, config.block_size, config.r, kwargs.get("layer_name", ""), width_label=self.width_label
        )
        n_blocks = width // b
        rows = 1 if config.block_share else n_blocks
        self.oftv2_Q[adapter_name] = nn.Parameter(torch.zeros(rows, triangle_size(b)))
        if not config.init_weights:
            with torch.no_grad():
                nn.init.normal_(self.oftv2_Q[adapter_name], mean=0.0, std=0.1)
        self.oftv2_block_size[adapter_name] = b
        self.oftv2_n_blocks[adapter_name] = n_blocks
        self.oftv2_settings[adapter_name] = RotationSettings(
            form=config.orthogonalization,
            terms=config.neumann_terms,
            dropout=float(config.module_dropout),
            max_q_norm=config.max_q_norm,
            block_share=config.block_share,
            impl=config.kernel_impl,
            conv_evaluation=config.conv_evaluation,
        )
        p = float(config.module_dropout)
        self.oftv2_dropout[adapter_name] = nn.Dropout(p) if p > 0 else nn.Identity()
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.refresh_kernels(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def rotation_width(self) -> int:
        """Width of the vectors ``R`` rotates: ``in_features`` here; a conv's flattened filter size in ``oftv2.conv``."""
        return self.in_features

    # ------------------------------------------------------------------------------------------ kernel plans
    def _plan_kernels(self, adapter_name: str) -> KernelPlan:
        """Resolves the kernels of one adapter for its current device (quantized layers add the fused path).

        Args:
            adapter_name: Name of the adapter.
        """
        return plan_kernels(
            self.oftv2_settings[adapter_name], self.oftv2_block_size[adapter_name], self.oftv2_Q[adapter_name]
        )

    def refresh_kernels(self, adapter_name: str | None = None) -> None:
        """Re-resolves the kernel plan of one adapter (default: every adapter of this layer).

        Called when an adapter is created and after the layer moves (``_apply``); :meth:`kernel_plan` also calls it
        after the settings or ``peftplug_kernels.dispatch_table`` changed. Call it by hand only after changing
        something else the dispatch reads (e.g. Triton's availability in a test).

        Args:
            adapter_name: The adapter, or ``None`` for all.
        """
        plans = getattr(self, "_oftv2_kernels", None)
        if plans is None:  # _apply during construction, before the adapter state exists
            return
        if adapter_name is None:
            plans.clear()
        for name in list(self.oftv2_Q) if adapter_name is None else [adapter_name]:
            if name in self.oftv2_Q:
                plans[name] = self._plan_kernels(name)
            else:
                plans.pop(name, None)

    def kernel_plan(self, adapter_name: str) -> KernelPlan:
        """The adapter's resolved kernels; rebuilt only if its settings, its parameters' device or the per-device
        dispatch table changed.

        Three comparisons per call in eager mode; under ``torch.compile`` they are constants at trace time
        (guarded), so the compiled forward holds no dispatch code at all.

        Args:
            adapter_name: Name of the adapter.
        """
        return self.plan_for(adapter_name, self.oftv2_Q[adapter_name])

    def plan_for(self, adapter_name: str, q_param: torch.Tensor) -> KernelPlan:
        """:meth:`kernel_plan` for a caller that holds the adapter's parameter already (the forward fetches it once:
        each parameter lookup through ``nn.Module.__getattr__`` costs about as much as a view op on this path).

        Args:
            adapter_name: Name of the adapter.
            q_param: Its parameter, ``oftv2_Q[adapter_name]``.
        """
        plan = self._oftv2_kernels.get(adapter_name)
        if (
            plan is None
            or plan.settings is not self.oftv2_settings[adapter_name]
            or plan.device != q_param.device
            or plan.table_generation != dispatch_table.generation()
        ):
            # Moved without _apply (e.g. accelerate hooks, load_state_dict(assign=True)), settings replaced, or
            # the table changed (dispatch_table.set_choice after measuring a GPU).
            self.refresh_kernels(adapter_name)
            plan = self._oftv2_kernels[adapter_name]
        return plan

    # ----------------------------------------------------------------------------------------------- rotation
    def effective_q(self, adapter_name: str) -> torch.Tensor:
        """The adapter's triangle parameters after the optional ``max_q_norm`` bound (differentiable).

        Args:
            adapter_name: Name of the adapter.
        """
        return bound_q(self.oftv2_Q[adapter_name], self.oftv2_settings[adapter_name].max_q_norm)

    def _block_keep(self, adapter_name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Block-dropout mask ``[n_blocks, 1, 1]`` (1 keeps a block, 0 replaces it by ``I``), or ``None`` when the
        adapter has no dropout.

        Args:
            adapter_name: Name of the adapter.
            dtype: The mask's dtype (the series').
            device: Its device.
        """
        # The nn.Dropout's p, which TRL's disable_dropout may have set to 0 since (see __init__).
        p = self.oftv2_settings[adapter_name].dropout and float(getattr(self.oftv2_dropout[adapter_name], "p", 0.0))
        if p <= 0.0:
            return None
        drop = torch.rand(self.oftv2_n_blocks[adapter_name], 1, 1, device=device) < p
        return (~drop).to(dtype)

    def get_rotation(self, adapter_name: str, apply_dropout: bool = False) -> torch.Tensor:
        """Rotation blocks of one adapter, ``[n_blocks, b, b]`` (``[1, b, b]`` when shared and not dropped).

        In the skew parameters' dtype, but at least fp32 (fp16/bf16 parameters give fp32 blocks).

        Args:
            adapter_name: Name of the adapter.
            apply_dropout: Apply block dropout (each block replaced by ``I`` with probability ``module_dropout``).
        """
        settings = self.oftv2_settings[adapter_name]
        b = self.oftv2_block_size[adapter_name]
        q_param = self.oftv2_Q[adapter_name]
        q_vec = series_input(q_param, settings.max_q_norm)
        impl = self.plan_for(adapter_name, q_param).cayley
        rotation = ops.cayley_neumann(q_vec, b, terms=settings.terms, form=settings.form, impl=impl)
        if apply_dropout:
            keep = self._block_keep(adapter_name, rotation.dtype, rotation.device)
            rotation = drop_blocks(rotation, keep, self.oftv2_n_blocks[adapter_name])
        return rotation

    def forward_rotation(self, adapter_name: str) -> torch.Tensor:
        """:meth:`get_rotation` as a forward uses it: with block dropout in training, and in eval mode without
        autograd the blocks cached by :mod:`oftv2.rotation_cache`.

        Args:
            adapter_name: Name of the adapter.
        """
        if cache_usable(self):
            q_param = self.oftv2_Q[adapter_name]
            plan = self.plan_for(adapter_name, q_param)
            return cached_rotation(self, adapter_name, q_param, self.oftv2_settings[adapter_name], plan)
        return self.get_rotation(adapter_name, apply_dropout=self.training)

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x R₁ … Rₙ`` over the active adapters of this layer (dropout in training mode).

        Each adapter's series and rotation run as one op (``ops.cayley_rotate``: on the torch path one autograd
        Function with a hand-written backward, the fewest kernel calls per layer), or, when ``oftv2.stacking``
        computed this forward's blocks for the whole model, only the rotation.

        Args:
            x: ``[..., in_features]``.
        """
        # Blocks that oftv2.stacking computed for the whole model in this forward (absent otherwise). The flag is
        # read first so that a compiled graph guards on it: dynamo does not guard module hooks, and a graph traced
        # before stack_rotations (or for another model) must not be reused once the hooks exist.
        stacked = self.__dict__.get(STACKED_ATTR) if self.oftv2_stacking else None
        if stacked and inside_activation_checkpoint(stacked):
            stacked = None
        # Eval mode without autograd (validation, generate): blocks computed once, then only the rotation. (Not for
        # float64 inputs, whose series the Function computes in float64 whatever the parameters' dtype.)
        cached = x.dtype != torch.float64 and cache_usable(self)
        for name in self.active_adapters:
            # (Stacked blocks exist only for adapters with a parameter here: no lookup on that path.)
            rotation = stacked.get(name) if stacked else None
            if rotation is not None and (x.dtype != torch.float64 or rotation.dtype == torch.float64):
                x = rotate_by(x, rotation)
                continue
            q_param = self.oftv2_Q.get(name)
            if q_param is None:
                continue
            settings = self.oftv2_settings[name]
            plan = self.plan_for(name, q_param)
            if cached:
                x = ops.block_rotate(x, cached_rotation(self, name, q_param, settings, plan), impl=plan.rotate)
                continue
            q_vec = series_input(q_param, settings.max_q_norm)
            keep = self._block_keep(name, q_vec.dtype, q_vec.device) if self.training else None
            x = ops.cayley_rotate(
                x, q_vec, self.oftv2_block_size[name], terms=settings.terms, form=settings.form, keep=keep,
                cayley_impl=plan.cayley, rotate_impl=plan.rotate,
            )
        return x

    def adapters_bypassed(self) -> bool:
        """Whether the forward must call the base layer unchanged: adapters disabled (a merged layer is unmerged
        first, as in PEFT) or already merged into the weight."""
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return True
        return self.merged

    # ----------------------------------------------------------------------------------- base weight access
    def _get_base_weight(self) -> torch.Tensor:
        """The base weight as ``out × in`` (a view when possible). Override for quantized bases."""
        weight = self.get_base_layer().weight.data
        return weight.T if getattr(self, "fan_in_fan_out", False) else weight

    def _set_base_weight(self, weight: torch.Tensor) -> None:
        """Writes an ``out × in`` weight back into the base layer in place. Override for quantized bases.

        Args:
            weight: New weight, ``out × in``.
        """
        target = self.get_base_layer().weight
        new = weight.T if getattr(self, "fan_in_fan_out", False) else weight
        with torch.no_grad():
            # In place: keeps the Parameter object (optimizers, tied weights) and its dtype.
            target.data.copy_(new.to(target.dtype))

    def _apply_rotation_to_weight(
        self, weight: torch.Tensor, adapter_name: str, inverse: bool
    ) -> torch.Tensor:
        """``W Rᵀ`` (or the exact ``W R⁻ᵀ`` when ``inverse``), block-wise, in at least fp32.

        For a layer that rotates its output (:attr:`rotates_output`) the rows are multiplied by ``R`` instead
        (``W R``, or ``W R⁻¹``).

        Args:
            weight: ``out × in``.
            adapter_name: Whose rotation.
            inverse: Undo instead of apply.
        """
        b = self.oftv2_block_size[adapter_name]
        n_blocks = self.oftv2_n_blocks[adapter_name]
        work = torch.promote_types(weight.dtype, torch.float32)
        with torch.no_grad():
            rotation = self.get_rotation(adapter_name).to(work).expand(n_blocks, b, b)
            # M: the per-block matrix the weight rows are multiplied by.
            m = rotation if self.rotates_output else rotation.transpose(-1, -2)
            w = weight.to(work).reshape(weight.shape[0], n_blocks, b)
            if not inverse:
                out = torch.einsum("oik,ikc->oic", w, m)
            else:
                # Xᵢ Mᵢ = W'ᵢ  <=>  Mᵢᵀ Xᵢᵀ = W'ᵢᵀ : one solve per block (exact inverse, orthogonal or not).
                out = torch.linalg.solve(m.transpose(-1, -2), w.permute(1, 2, 0)).permute(2, 0, 1)
        return out.reshape(weight.shape)

    # -------------------------------------------------------------------------------------- merge / unmerge
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Folds the adapters into the base weight: ``W ← W Rₙᵀ … R₁ᵀ`` (``W ← W R₁ … Rₙ`` for an output-side layer).

        Args:
            safe_merge: Compute on a copy and raise ``ValueError`` before writing if it is not finite.
            adapter_names: Adapters to merge (default: the active ones); folded in forward (``active_adapters``)
                order whatever order they are listed in, also relative to adapters merged by an earlier call.
        """
        adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.oftv2_Q]
        if not adapter_names:
            return
        # Rotations do not commute: folded in forward order, together with any merged before (oftv2.merge_order).
        weight, order = merged_weight(self, self._get_base_weight(), self.merged_adapters, adapter_names, safe_merge)
        self._set_base_weight(weight)
        self.merged_adapters[:] = order

    def unmerge(self) -> None:
        """Restores the base weight by undoing the merged rotations (exact inverse, last merged first)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        weight = self._get_base_weight()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name in self.oftv2_Q:
                weight = self._apply_rotation_to_weight(weight, name, inverse=True)
        self._set_base_weight(weight)

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The dense block-diagonal ``R`` (in × in) of an adapter (diagnostics; merging never forms it).

        Args:
            adapter_name: Name of the adapter.
        """
        n_blocks = self.oftv2_n_blocks[adapter_name]
        b = self.oftv2_block_size[adapter_name]
        blocks = self.get_rotation(adapter_name).expand(n_blocks, b, b)
        return torch.block_diag(*blocks.unbind(0))


class OFTv2Module(nn.Module, OFTv2Layer):
    """Base of the OFTv2 layer classes: an ``nn.Module`` whose kernel plans follow it to another device.

    ``nn.Module`` precedes :class:`OFTv2Layer` in the method order (PEFT's layout), so ``_apply`` lives here.
    """

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        # .to() / .cuda() / .half() end here: resolve the kernels for the new device now, so that neither eager
        # forwards nor a compiled graph ever resolve them.
        self.refresh_kernels()
        return out

    def train(self, mode: bool = True):
        if mode:  # cached inference rotations live in eval mode only (oftv2.rotation_cache)
            clear_rotation_cache(self)
        return super().train(mode)


class Linear(OFTv2Module):
    """OFTv2 around ``nn.Linear`` or GPT-2 ``Conv1D`` (``fan_in_fan_out=True``: weight stored in × out).

    Args:
        base_layer: The layer to adapt.
        adapter_name: Name of the first adapter.
        config: Its configuration.
        fan_in_fan_out: Whether the base weight is stored ``in × out``.
        **kwargs: ``layer_name`` for error messages.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: OFTv2Config,
        fan_in_fan_out: bool = False,
        **kwargs,
    ) -> None:
        super().__init__()
        OFTv2Layer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = fan_in_fan_out
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, **kwargs)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.adapters_bypassed():
            return self.base_layer(x, *args, **kwargs)
        return self.base_layer(self.rotate_input(x), *args, **kwargs)

    def __repr__(self) -> str:
        return "oftv2." + super().__repr__()


def type_dispatcher(base_type: type, layer_cls: type) -> Callable[..., nn.Module | None]:
    """A dispatcher wrapping layers whose (innermost) base is a ``base_type`` in ``layer_cls``, else ``None``.

    Args:
        base_type: The plain torch layer type, e.g. ``nn.Conv2d``.
        layer_cls: The OFTv2 layer class, called as ``layer_cls(target, adapter_name, config, **kwargs)``.
    """

    def dispatch(target: nn.Module, adapter_name: str, config: OFTv2Config, **kwargs) -> nn.Module | None:
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, base_type):
            return layer_cls(target, adapter_name, config, **kwargs)
        return None

    dispatch.__name__ = dispatch.__qualname__ = f"dispatch_{base_type.__name__.lower()}"
    dispatch.__doc__ = f"Wraps ``{base_type.__name__}`` layers in ``{layer_cls.__name__}``; ``None`` for anything else."
    return dispatch


def dispatch_default(
    target: nn.Module, adapter_name: str, config: OFTv2Config, **kwargs
) -> nn.Module | None:
    """Wraps ``nn.Linear`` and GPT-2 ``Conv1D`` layers; returns ``None`` for anything else.

    Args:
        target: The module to adapt (possibly already a tuner layer of another method).
        adapter_name: Name of the adapter.
        config: Its configuration.
        **kwargs: Passed to the layer.
    """
    from transformers.pytorch_utils import Conv1D

    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, nn.Linear):
        return Linear(target, adapter_name, config, fan_in_fan_out=False, **kwargs)
    if isinstance(base, Conv1D):
        return Linear(target, adapter_name, config, fan_in_fan_out=True, **kwargs)
    return None
