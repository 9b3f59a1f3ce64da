"""Which kernel ``impl="auto"`` runs, per device kind, each choice with the measurement it came from.

``auto`` must never choose a kernel a measurement showed slower. This table is the one place that says what auto
chooses: :func:`kernel_choice` (``"torch"`` or ``"triton"`` per op) and :func:`fused_nf4_max_tokens` (up to how
many tokens a QOFT layer under ``kernel_impl="auto"`` runs the fused rotate + 4-bit matmul kernel; 0 = never).
Forcing ``impl="triton"`` / ``kernel_impl="triton"`` still runs the Triton (and fused NF4) kernels whatever the
table says. :func:`set_choice` and :func:`set_fused_nf4_max_tokens` override an entry (e.g. after a measurement on
another GPU); an unknown op, kernel or device kind raises a ``ValueError`` naming the accepted ones.

Device kinds: ``"cuda:sm_XY"`` for a CUDA device of compute capability X.Y when the table has it, else ``"cuda"``;
``"cpu"`` for the CPU and every other device type (Triton runs there only in interpreter mode, for tests).
"""

from __future__ import annotations

import dataclasses

import torch

OPS = ("block_rotate", "cayley_neumann", "dequantize_4bit", "nf4_rotate_matmul")
KERNELS = ("torch", "triton")

_H200 = "../shared/gpu/2026-12-04-h200/README.md + gpu_results.json (one H200, bf16, 2026-12-04)"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One op's kernel under ``auto`` and why.

    Attributes:
        kernel: One of :data:`KERNELS`.
        evidence: The measurement (numbers, source file, date) or reasoning it rests on.
    """

    kernel: str
    evidence: str


@dataclasses.dataclass(frozen=True)
class DeviceEntry:
    """What ``auto`` does on one device kind.

    Attributes:
        choices: Op name (one of :data:`OPS`) → :class:`Choice`.
        fused_nf4_max_tokens: Largest token count for which ``auto`` runs the fused NF4 kernel (0 = never).
        fused_evidence: The measurement behind ``fused_nf4_max_tokens``.
    """

    choices: dict[str, Choice]
    fused_nf4_max_tokens: int
    fused_evidence: str


_NO_TRITON = "Triton runs on this device only in interpreter mode (numpy per program): tests only, never fast"
_CPU = DeviceEntry(
    choices={op: Choice("torch", _NO_TRITON) for op in OPS},
    fused_nf4_max_tokens=0,
    fused_evidence=_NO_TRITON,
)

_SM90 = DeviceEntry(
    choices={
        "block_rotate": Choice("triton", (
            f"{_H200}: 4096 tokens x 4096, b=32: Triton 0.141 / 0.683 ms fwd / fwd+bwd vs torch einsum 0.223 / 0.592 "
            "(the isolated backward is slower), but the 1.1B training step with every op on Triton takes 139.7 ms "
            "and 10.32 GiB against 212.6 ms and 14.87 GiB with every op on torch (the reference saves an fp32 copy "
            "of each adapted input). Chosen for the step. Since 2026-12-05 the torch path of a layer is one autograd "
            "Function for series and rotation (16 kernel calls forward + backward where that step's made ~37, and "
            "no fp32 copy of the input), not yet timed on a GPU: the step benchmark's table-check row "
            "(kernel_impl=torch vs auto) says whether both entries should flip to torch")),
        "cayley_neumann": Choice("triton", (
            f"{_H200}: 128 blocks of 32: Triton 0.058 / 0.270 ms fwd / fwd+bwd vs torch 0.160 / 0.898 (the composed "
            "reference; see block_rotate for the one-Function torch path that has replaced it in OFTv2 layers)")),
        "dequantize_4bit": Choice("triton", (
            f"{_H200}: 4096 x 4096 NF4: Triton 0.140 ms vs bitsandbytes 0.131; the torch reference (the other "
            "choice of this op) holds ~19 bytes per element, the kernel writes 2")),
        "nf4_rotate_matmul": Choice("torch", (
            f"{_H200}: the fused kernel is slower than rotate + bitsandbytes at every size (fwd 16 tokens 0.46 vs "
            "0.26 ms, 4096 tokens 11.8 vs 0.41; fwd+bwd 1024 tokens 3.99 vs 1.25); unfused under auto")),
    },
    fused_nf4_max_tokens=0,
    fused_evidence=(f"{_H200}: fused rotate + NF4 matmul slower than rotate + bitsandbytes at 16, 256, 1024 and 4096 "
                    "tokens (fwd+bwd 1.47 / 1.54 / 3.99 / 12.57 ms vs 1.45 / 1.39 / 1.25 / 1.47): never fuse"),
)

# Other CUDA GPUs: nothing measured yet; the H200's choices are the best evidence there is.
_CUDA = DeviceEntry(
    choices={op: Choice(c.kernel, "not measured on this architecture; the H200's choice: " + c.evidence)
             for op, c in _SM90.choices.items()},
    fused_nf4_max_tokens=0,
    fused_evidence="not measured on this architecture; the H200's: " + _SM90.fused_evidence,
)

TABLE: dict[str, DeviceEntry] = {"cuda:sm_90": _SM90, "cuda": _CUDA, "cpu": _CPU}

# Bumped by every change to TABLE through the setters below: an OFTv2 layer's kernel plan records the generation it
# was resolved under and rebuilds itself when it differs (no refresh_kernels() call needed after a change).
_generation = 0


def generation() -> int:
    """How many times :data:`TABLE` has been changed through :func:`set_choice`, :func:`set_fused_nf4_max_tokens`
    or :func:`add_device_kind` in this process."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1

_KIND_BY_DEVICE: dict[torch.device, str] = {}


def _check(name: str, value: object, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {accepted}, got {value!r}")


def device_kind(device: torch.device | str) -> str:
    """The table key of ``device``: ``"cuda:sm_XY"`` if the table has that capability, else ``"cuda"``, or ``"cpu"``.

    Args:
        device: A device or its name (``"cuda:0"``, ``"cpu"``).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kind = _KIND_BY_DEVICE.get(device)
    if kind is None:  # cached: the capability query is a driver call, and this runs when layers resolve kernels
        major, minor = torch.cuda.get_device_capability(device)
        kind = f"cuda:sm_{major}{minor}"
        _KIND_BY_DEVICE[device] = kind
    return kind if kind in TABLE else "cuda"


def _entry(device: torch.device | str) -> DeviceEntry:
    return TABLE[device_kind(device)]


def kernel_choice(op: str, device: torch.device | str) -> str:
    """``"torch"`` or ``"triton"``: what ``impl="auto"`` runs for ``op`` on ``device`` (Triton installed or not).

    Args:
        op: One of :data:`OPS`.
        device: Where the op's tensors live.

    Raises:
        ValueError: For an unknown op, or a table entry naming an unknown kernel.
    """
    _check("op", op, OPS)
    choice = _entry(device).choices.get(op)
    if choice is None:  # a hand-built entry that left an op out (KeyError before)
        raise ValueError(f"the dispatch table's entry {device_kind(device)!r} has no choice for op {op!r}; every "
                         f"entry must name one of {KERNELS} for each of {OPS}")
    _check(f"the dispatch table's kernel for {op!r}", choice.kernel, KERNELS)
    return choice.kernel


def fused_nf4_max_tokens(device: torch.device | str) -> int:
    """Up to how many tokens ``kernel_impl="auto"`` runs the fused rotate + 4-bit matmul kernel (0 = never).

    Args:
        device: Where the layer lives.

    Raises:
        ValueError: For a hand-edited entry whose threshold is not an integer >= 0 (a QOFT forward compared tokens
            with it and failed with a TypeError, or fused nothing for a negative one, silently).
    """
    tokens = _entry(device).fused_nf4_max_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"the dispatch table's fused_nf4_max_tokens of {device_kind(device)!r} must be an integer "
                         f">= 0 (0 = never fuse), got {tokens!r}")
    return tokens


def evidence(op: str, device: torch.device | str) -> str:
    """The measurement behind :func:`kernel_choice` (``op="fused_nf4_max_tokens"`` for the threshold's).

    Args:
        op: One of :data:`OPS`, or ``"fused_nf4_max_tokens"``.
        device: A device or its name.
    """
    if op == "fused_nf4_max_tokens":
        return _entry(device).fused_evidence
    _check("op", op, OPS)
    choice = _entry(device).choices.get(op)
    if choice is None:  # a hand-built entry that left an op out, as kernel_choice says
        raise ValueError(f"the dispatch table's entry {device_kind(device)!r} has no choice for op {op!r}")
    return choice.evidence


def _check_kind(kind: str) -> None:
    _check("device kind", kind, tuple(TABLE))


def set_choice(kind: str, op: str, kernel: str, evidence: str) -> None:
    """Overrides what ``auto`` runs for ``op`` on ``kind`` (process-wide; e.g. after measuring another GPU).

    Args:
        kind: A key of :data:`TABLE` (``"cuda:sm_90"``, ``"cuda"``, ``"cpu"``); add a new capability with
            :func:`add_device_kind` first.
        op: One of :data:`OPS`.
        kernel: One of :data:`KERNELS`.
        evidence: The measurement it rests on (source, date).

    Raises:
        ValueError: Naming the accepted values of the wrong argument.
    """
    _check_kind(kind)
    _check("op", op, OPS)
    _check("kernel", kernel, KERNELS)
    entry = TABLE[kind]
    TABLE[kind] = dataclasses.replace(entry, choices={**entry.choices, op: Choice(kernel, evidence)})
    _changed()


def set_fused_nf4_max_tokens(kind: str, tokens: int, evidence: str) -> None:
    """Overrides the fused-NF4 token threshold of ``kind`` (0 = never fuse under ``auto``).

    Args:
        kind: A key of :data:`TABLE`.
        tokens: Non-negative token count.
        evidence: The measurement it rests on.

    Raises:
        ValueError: For an unknown kind or a negative / non-integer threshold.
    """
    _check_kind(kind)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an integer >= 0 (0 = never fuse), got {tokens!r}")
    TABLE[kind] = dataclasses.replace(TABLE[kind], fused_nf4_max_tokens=tokens, fused_evidence=evidence)
    _changed()


def add_device_kind(kind: str, like: str = "cuda") -> None:
    """Adds a ``"cuda:sm_XY"`` kind, starting as a copy of ``like``'s entry (then override it with :func:`set_choice`).

    Args:
        kind: ``"cuda:sm_"`` followed by the compute capability digits, e.g. ``"cuda:sm_80"``.
        like: Existing kind to copy.

    Raises:
        ValueError: For a malformed kind, one already in the table, or an unknown ``like``.
    """
    if not (kind.startswith("cuda:sm_") and kind[len("cuda:sm_"):].isdigit()):
        raise ValueError(f"kind must look like 'cuda:sm_80' (a CUDA compute capability), got {kind!r}")
    _check_kind(like)
    if kind in TABLE:  # ("cuda:sm_90" holds the H200's measurements: copying "cuda" over it dropped them silently)
        raise ValueError(f"device kind {kind!r} is already in the table; override its ops with set_choice")
    TABLE[kind] = TABLE[like]
    _changed()
