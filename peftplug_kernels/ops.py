"""Public entry points of the kernels package, with implementation dispatch.

``impl="auto"`` runs the kernel the per-device dispatch table chooses (:mod:`peftplug_kernels.dispatch_table`:
Triton where a GPU measurement showed it faster and the tensors are on CUDA with Triton installed, the pure torch
reference otherwise); ``"torch"`` and ``"triton"`` force one. ``"triton"`` on CPU works only in interpreter mode
(``TRITON_INTERPRET=1`` set before the first kernel import). Kernel modules are imported lazily, on first use, so
importing this module never imports Triton.

Dispatch once, not per call: callers that run an op on every forward (OFTv2 layers) call :func:`resolve_impl` once
per device and pass the resolved ``"torch"``/``"triton"``. With a resolved impl the ops do no availability check
under ``torch.compile`` and one set lookup in eager mode (CUDA; on CPU the interpreter check runs, tests only), and
everything they run traces with ``torch.compile(fullgraph=True)``: the Triton path goes through the custom ops of
:mod:`peftplug_kernels.library`.
"""

from __future__ import annotations

import torch

from peftplug_kernels import dispatch_table, library
from peftplug_kernels._function_guards import call_without_autocast
from peftplug_kernels._triton_available import triton_available, triton_usable
from peftplug_kernels.block_rotate import reference as _rotate_ref
from peftplug_kernels.cayley_neumann import reference as _cn_ref
from peftplug_kernels.cayley_rotate import function as _lean
from peftplug_kernels.cayley_rotate import reference as _cr_ref
from peftplug_kernels.nf4_dequantize import reference as _deq_ref
from peftplug_kernels.nf4_rotate_matmul import reference as _nf4_ref
from peftplug_kernels.nf4_rotate_matmul.fit import w4a16_unfit

IMPLS = ("auto", "torch", "triton")
# Largest rotation blocks the register-resident Cayley–Neumann kernel handles.
CN_TRITON_MAX_BLOCK = 64
# Kernel sub-package -> op name in the dispatch table, where they differ.
_TABLE_OP = {"nf4_dequantize": "dequantize_4bit"}
# (op, on CUDA) pairs whose forced Triton kernel was found runnable: checked once, not per call. CUDA only: on CPU
# runnability depends on TRITON_INTERPRET, which tests change at run time. Keyed by ``is_cuda``, not the device
# type: ``tensor.device`` builds a device object (~0.7 µs a call on our CPU), ``is_cuda`` does not.
_TRITON_OK: set[tuple[str, bool]] = set()


def cn_kernel_fits(form: str, block_size: int) -> bool:
    """Whether the Triton Cayley–Neumann kernel takes this form and block size (the exact form needs a solve).

    Args:
        form: ``"cayley_neumann"``, ``"cayley"`` or ``"peft_cn"``.
        block_size: b.
    """
    return form != "cayley" and 2 <= block_size <= CN_TRITON_MAX_BLOCK


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def resolve_impl(impl: str, *tensors: torch.Tensor, op: str = "block_rotate") -> str:
    """Chooses ``"torch"`` or ``"triton"`` for ``impl`` given the tensors an op will read.

    Call it once per layer and device (build or move time) and pass the result to the op on every call.

    Args:
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.
        *tensors: The op's inputs (their device decides ``"auto"``).
        op: Kernel sub-package whose Triton module would run (checked for interpreter mode on CPU).

    Raises:
        ValueError: For an unknown ``impl``.
        RuntimeError: If ``impl="triton"`` is forced where the kernel cannot run (says why).
    """
    _check_impl(impl)
    if impl == "torch":
        return "torch"
    # The kernels compute in fp32 (fp16/bf16/fp32 in): an fp64 tensor gets the torch path, or an error when forced.
    fp64 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tensors)
    if impl == "auto":
        devices = [t.device for t in tensors if isinstance(t, torch.Tensor)]
        if fp64 or not devices or not all(d.type == "cuda" for d in devices) or not triton_available():
            return "torch"
        return dispatch_table.kernel_choice(_TABLE_OP.get(op, op), devices[0])
    if fp64:
        raise RuntimeError("impl='triton' cannot run here: the Triton kernels compute in fp32 and take fp16, bf16 or "
                           "fp32 tensors, got float64 (impl='auto' runs the torch path for it)")
    ok, why = triton_usable(op, *tensors)
    if not ok:
        raise RuntimeError(f"impl='triton' cannot run here: {why}")
    if all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)):
        _TRITON_OK.add((op, True))
    return "triton"


def _resolved(impl: str, op: str, *tensors: torch.Tensor) -> str:
    """``resolve_impl`` without its checks for an already-resolved ``impl`` (the per-call hot path)."""
    if impl == "torch":
        return impl
    # Every tensor on CUDA, not only the first: a CPU rotation or bias beside CUDA activations must still get
    # resolve_impl's error, not a kernel launched on a host pointer.
    if impl == "triton" and (torch.compiler.is_compiling()
                             or ((op, True) in _TRITON_OK and all(t.is_cuda for t in tensors))):
        return impl
    return resolve_impl(impl, *tensors, op=op)


def cayley_neumann(
    q_vec: torch.Tensor, block_size: int, terms: int = 5, form: str = "cayley_neumann", impl: str = "auto"
) -> torch.Tensor:
    """Triangle vectors ``[n_blocks, b(b-1)/2]`` -> rotation blocks ``[n_blocks, b, b]``.

    The exact ``"cayley"`` form needs a linear solve and always runs the reference (``impl="triton"`` with it is
    an error); the two Neumann forms have a fused kernel for blocks up to :data:`CN_TRITON_MAX_BLOCK`.

    Args:
        q_vec: Strict-upper-triangle entries of each block's skew-symmetric Q.
        block_size: b.
        terms: Series length n (highest power n - 1) for the Neumann forms.
        form: ``"cayley_neumann"`` (Taylor), ``"cayley"`` (exact) or ``"peft_cn"`` (PEFT's product form).
        impl: See module docstring.
    """
    if form not in _cn_ref.FORMS:
        raise ValueError(f"form must be one of {_cn_ref.FORMS}, got {form!r}")
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    if q_vec.dim() != 2 or q_vec.shape[-1] != _cn_ref.triangle_size(block_size):
        raise ValueError(
            f"q_vec must be [n_blocks, {_cn_ref.triangle_size(block_size)}] for block_size {block_size}, "
            f"got {tuple(q_vec.shape)}"
        )
    kernel_fits = cn_kernel_fits(form, block_size)
    if impl == "triton" and not kernel_fits:
        raise ValueError(
            f"the Triton Cayley-Neumann kernel supports forms 'cayley_neumann'/'peft_cn' and block_size in "
            f"[2, {CN_TRITON_MAX_BLOCK}]; got form={form!r}, block_size={block_size}"
        )
    if kernel_fits and _resolved(impl, "cayley_neumann", q_vec) == "triton":
        return library.cayley_neumann(q_vec, block_size, terms, form)
    _check_impl(impl)
    return call_without_autocast(q_vec.device.type, _cn_ref.cayley_neumann, q_vec, block_size, terms=terms, form=form)


def _check_rotation(width: int, rotation: torch.Tensor) -> None:
    shape = rotation.shape  # read once: every attribute access costs on the per-call path
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ValueError(f"rotation must be [n_blocks, b, b], got {tuple(shape)}")
    n_blocks, b = shape[0], shape[1]
    if b < 1:  # (a [n, 0, 0] rotation was a ZeroDivisionError from the modulo below)
        raise ValueError(f"rotation blocks must be at least 1 x 1, got {tuple(shape)}")
    if width % b != 0:
        raise ValueError(f"input width {width} is not a multiple of the block size {b}")
    # ``!=`` twice, not ``not in (1, width // b)``: dynamo evaluates ``in`` over a tuple holding a symbolic width as
    # False, which refused every valid input under torch.compile(dynamic=True) (block_rotate/reference.py too).
    if n_blocks != 1 and n_blocks != width // b:
        raise ValueError(f"{n_blocks} rotation blocks do not fit input width {width} with block size {b}")


def _check_packed(weight: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Refuses a packed 4-bit weight with fewer bytes than ``shape`` needs (two codes per byte).

    The Triton kernels index the packed bytes from ``quant_state.shape`` without bounds, so a weight that does not
    belong to the state (another layer's, a shard) read past its end silently, where the torch path raised.

    Args:
        weight: The packed weight (``Params4bit`` data, any ``quant_storage`` dtype).
        shape: ``(out, in)`` of its quant state.

    Raises:
        ValueError: When the weight holds fewer bytes than ``shape`` needs.
    """
    needed = (shape[0] * shape[1] + 1) // 2
    held = weight.numel() * weight.element_size()  # any quant_storage dtype: its bytes
    if held < needed:
        raise ValueError(f"weight holds {held} packed bytes, but quant_state.shape {tuple(shape)} needs {needed} "
                         "(a 4-bit weight with another layer's quant state?)")


def block_rotate(x: torch.Tensor, rotation: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x' = x R block-wise over the last dimension of ``x``.

    Args:
        x: ``[..., n_blocks * b]``.
        rotation: ``[n_blocks, b, b]`` or ``[1, b, b]`` (shared block).
        impl: See module docstring.
    """
    _check_rotation(x.shape[-1], rotation)
    if _resolved(impl, "block_rotate", x, rotation) == "triton":
        return library.block_rotate(x, rotation)
    return call_without_autocast(x.device.type, _rotate_ref.block_rotate, x, rotation)


def cayley_rotate(
    x: torch.Tensor,
    q_vec: torch.Tensor,
    block_size: int,
    terms: int = 5,
    form: str = "cayley_neumann",
    keep: torch.Tensor | None = None,
    cayley_impl: str = "auto",
    rotate_impl: str = "auto",
) -> torch.Tensor:
    """``x R`` block-wise, ``R`` the rotation blocks of the triangles ``q_vec``: an OFTv2 layer's input rotation.

    With both implementations ``"torch"`` and a form :func:`peftplug_kernels.cayley_rotate.function.supports`
    (the default Taylor form, 2–5 terms), one autograd Function computes the series and the rotation in 6 kernel
    calls forward and 8 backward; otherwise :func:`cayley_neumann` and :func:`block_rotate` run one after the other
    (the Triton kernels, or the references).

    Args:
        x: ``[..., n_blocks · b]``.
        q_vec: ``[n_blocks, b(b-1)/2]`` triangles, or ``[1, b(b-1)/2]`` for a block shared across the width.
        block_size: b.
        terms: Series length n of the Neumann forms.
        form: ``"cayley_neumann"``, ``"cayley"`` or ``"peft_cn"``.
        keep: ``None``, or a ``[n_blocks, 1, 1]`` 0/1 mask in ``q_vec``'s dtype (block dropout: 0 means ``R = I``).
        cayley_impl: Implementation of the series (see module docstring).
        rotate_impl: Implementation of the rotation.

    Raises:
        ValueError: When the blocks do not tile the width, or ``keep`` is not ``[n_blocks, 1, 1]``.
    """
    width = x.shape[-1]
    rows = q_vec.shape[0]
    # (block_size < 1 first: a 0 was a ZeroDivisionError from the modulo. No ``in``: see _check_rotation.)
    if block_size < 1 or width % block_size != 0 or (rows != 1 and rows != width // block_size):
        raise ValueError(
            f"{rows} blocks of size {block_size} do not fit input width {width} (rows must be 1 or width / block_size)"
        )
    # A [n_blocks] mask broadcast over the blocks' last dimension instead (silently wrong when n_blocks == b).
    if keep is not None and (keep.dim() != 3 or keep.shape[0] != width // block_size or keep.shape[1] != 1
                             or keep.shape[2] != 1):
        raise ValueError(f"keep must be None or a [{width // block_size}, 1, 1] 0/1 mask (one per block of the "
                         f"width), got {tuple(keep.shape)}")
    # (A 1-wide block has no triangle, R = I: the composed references handle it, the Function's tables do not.)
    if cayley_impl == "torch" and rotate_impl == "torch" and _lean.supports(form, terms) and block_size >= 2:
        if q_vec.dim() != 2 or q_vec.shape[-1] != _cn_ref.triangle_size(block_size):
            raise ValueError(
                f"q_vec must be [n_blocks, {_cn_ref.triangle_size(block_size)}] for block_size {block_size}, "
                f"got {tuple(q_vec.shape)}"
            )
        return _lean.CayleyRotateFunction.apply(x, q_vec, block_size, terms, keep)
    rotation = cayley_neumann(q_vec, block_size, terms=terms, form=form, impl=cayley_impl)
    return block_rotate(x, _cr_ref.drop_blocks(rotation, keep, width // block_size), impl=rotate_impl)


def nf4_rotate_matmul(
    x: torch.Tensor,
    rotation: torch.Tensor,
    weight: torch.Tensor,
    quant_state,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """y = (x R) deq(W)ᵀ + bias for a bitsandbytes 4-bit (NF4 or FP4) weight, rotation fused in the GEMM.

    Args:
        x: ``[..., in]`` activations.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` blocks.
        weight: Packed 4-bit weight (``Linear4bit.weight``) of an ``out × in`` matrix.
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute; bitsandbytes is not imported here).
        bias: Optional ``[out]`` bias.
        impl: See module docstring.

    Returns:
        ``[..., out]`` in ``x``'s dtype.

    Raises:
        ValueError: For a state, rotation, bias or packed weight that does not fit ``x`` and each other, or
            ``impl="triton"`` on a layer the fused kernels do not take (``fit.w4a16_unfit``).
    """
    shape = tuple(quant_state.shape)
    if len(shape) != 2 or shape[1] != x.shape[-1]:
        raise ValueError(f"quant_state.shape {shape} does not match input width {x.shape[-1]}")
    _check_rotation(x.shape[-1], rotation)
    _check_packed(weight, shape)
    # The kernels read bias[:out] unchecked: a shorter bias read past its end, where the torch path raised.
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != shape[0]):
        raise ValueError(f"bias must be None or [{shape[0]}] (one per output feature), got {tuple(bias.shape)}")
    tensors = (x, rotation, weight) + (() if bias is None else (bias,))
    # One rule for the fused kernels (fit.py; tabled in docs/kernels.md): auto leaves the other layers unfused,
    # forcing the fused kernel there is a one-line error.
    why_not = w4a16_unfit(x.dtype, shape, quant_state)
    if why_not and impl == "triton":
        raise ValueError(f"the fused NF4 kernel cannot run this layer: {why_not}")
    fused = not why_not and _resolved(impl, "nf4_rotate_matmul", *tensors) == "triton"
    if fused and impl == "auto":
        # The table chose the fused kernel for this device: only up to its measured token threshold.
        fused = x.numel() <= dispatch_table.fused_nf4_max_tokens(x.device) * x.shape[-1]
    if fused:
        return library.nf4_rotate_matmul(x, rotation, weight, quant_state, bias)
    _check_impl(impl)
    if impl == "torch":
        return _nf4_ref.nf4_rotate_matmul(x, rotation, weight, quant_state, bias)
    # Unfused under auto: the reference's composition (rotate, dequantize, matmul), each piece on its own best kernel.
    return _nf4_ref.nf4_rotate_matmul(
        x, rotation, weight, quant_state, bias,
        rotate=lambda x_, r_: block_rotate(x_, r_, impl="auto"),
        dequantize=lambda w_, s_, dtype: dequantize_4bit(w_, s_, dtype, impl="auto"),
    )


def dequantize_4bit(weight: torch.Tensor, quant_state, dtype: torch.dtype | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """deq(W) of a bitsandbytes 4-bit (NF4 or FP4) weight, with or without double quantization.

    Not differentiable (the codes are frozen). The Triton kernel writes only the output (2 bytes per element in
    half precision); the torch reference holds ≈19 bytes per element at its peak.

    Args:
        weight: Packed 4-bit weight (``Linear4bit.weight``).
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute).
        dtype: Output dtype; the state's dtype by default.
        impl: See module docstring.

    Returns:
        ``quant_state.shape`` tensor.
    """
    if len(tuple(quant_state.shape)) != 2:
        raise ValueError(f"quant_state.shape must be (out, in), got {tuple(quant_state.shape)}")
    _check_packed(weight, tuple(quant_state.shape))
    if _resolved(impl, "nf4_dequantize", weight) == "triton":
        return library.dequantize_4bit(weight, quant_state, dtype)
    return _deq_ref.dequantize_4bit(weight, quant_state, dtype)
