"""What the overhead study counts and how it times: ATen ops and kernel calls from ``torch.profiler``, dynamo's graph
and graph-break counters, and process-CPU timing of a repeated call.

On a GPU an adapter's step is launch-bound when its kernels are small (``../shared/gpu/2026-12-04-h200/``: OFTv2's
kernels keep an H200 busy 73.5 ms of a 140 ms step); the CPU side of that cost is the number of ops dispatched and
the Python run between them. On a CPU at tiny widths the arithmetic is negligible, so the time of a layer's forward +
backward *is* that framework cost, and the ops the profiler records are the calls a GPU would launch.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

#: ATen ops that only make a view, allocate or read metadata (``to`` and ``contiguous`` when they have nothing to do:
#: when they copy, the nested ``copy_`` counts): on a GPU they launch no kernel, so they are not counted as kernel
#: calls (they still cost dispatcher time, which the ``aten`` count includes).
VIEW_OPS = frozenset({
    "alias", "as_strided", "detach", "expand", "expand_as", "lift_fresh", "narrow", "permute", "reshape",
    "resolve_conj", "resolve_neg", "select", "slice", "split", "split_with_sizes", "squeeze", "t", "transpose",
    "unbind", "unflatten", "unsqueeze", "view", "view_as", "_reshape_alias", "_unsafe_view", "chunk", "flatten",
    "empty", "empty_like", "empty_strided", "zeros_like", "ones_like", "contiguous", "size", "stride", "numel",
    "is_nonzero", "item", "_local_scalar_dense", "diagonal", "movedim", "matrix_H", "mT", "adjoint", "conj",
    "unfold", "new_empty", "new_empty_strided", "resize_", "to", "_has_compatible_shallow_copy_type",
})

#: Profiler events of Inductor's generated CPU kernels (recorded only with ``cpp.enable_kernel_profile``, named like
#: ``graph_0_cpp_fused_add_2``) and of its Triton kernels.
COMPILED_KERNEL_MARKS = ("cpp_fused", "cpp_CppMicroGemm", "triton_")


def is_compiled_kernel(name: str) -> bool:
    """Whether a profiler event is a kernel Inductor generated (see :data:`COMPILED_KERNEL_MARKS`).

    Args:
        name: The event's name.
    """
    return any(mark in name for mark in COMPILED_KERNEL_MARKS)


def _kernel_calls(events) -> list:
    """The calls that compute, one per kernel a GPU would launch: a computing ATen call (one outside
    :data:`VIEW_OPS`) counts once, whatever it runs inside (``aten::linear`` -> ``matmul`` -> ``mm`` is one call;
    ``sum`` filling its output first is one), unless the calls inside it compute twice or more (a composite op:
    then those count); views count what they run inside (a ``reshape`` that copies); Inductor's generated kernels
    count once each."""

    def computes(event) -> bool:
        return event.name.startswith("aten::") and event.name[len("aten::"):] not in VIEW_OPS

    def kernels(event) -> list:
        if is_compiled_kernel(event.name):
            return [event]
        inner = [k for child in event.cpu_children for k in kernels(child)]
        return [event] if computes(event) and len(inner) < 2 else inner

    return [k for event in events if event.cpu_parent is None for k in kernels(event)]


def _profile(run: Callable[[], object]):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return prof.events()


def count_ops(run: Callable[[], object]) -> dict[str, int]:
    """Profiles one call of ``run`` and counts what it dispatched.

    Args:
        run: One forward + backward (or training step); called once, on the CPU profiler.

    Returns:
        ``aten``: every ATen op call, nested ones included (what the dispatcher handled); ``aten_top``: ATen calls
        not inside another ATen call (what Python or the autograd engine asked for); ``kernels``: the calls that
        compute (see :func:`_kernel_calls`): on a GPU each would be a kernel launch; ``autograd_nodes``: backward
        nodes the autograd engine ran.
    """
    events = _profile(run)
    aten = [e for e in events if e.name.startswith("aten::")]

    def inside_aten(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return True
            parent = parent.cpu_parent
        return False

    return {
        "aten": len(aten),
        "aten_top": sum(not inside_aten(e) for e in aten),
        "kernels": len(_kernel_calls(events)),
        "autograd_nodes": sum(e.name.startswith("autograd::engine::evaluate_function:") for e in events),
    }


def top_kernels(run: Callable[[], object], n: int = 12) -> list[tuple[str, int]]:
    """The ``n`` most frequent kernel calls (:func:`_kernel_calls`) of one call of ``run``, for the page.

    Args:
        run: One forward + backward.
        n: How many names to return.
    """
    names = Counter("(compiled kernel)" if is_compiled_kernel(e.name) else e.name
                    for e in _kernel_calls(_profile(run)))
    return names.most_common(n)


def cpu_seconds(run: Callable[[], object], iters: int) -> float:
    """Process CPU seconds of ``iters`` calls of ``run`` (one torch thread: CPU time is the work done, wall time on
    shared cores is mostly waiting for a core).

    Args:
        run: The call to time.
        iters: How many calls.
    """
    start = time.process_time()
    for _ in range(iters):
        run()
    return time.process_time() - start


def dynamo_stats() -> dict:
    """Dynamo's counters since the last :func:`reset_dynamo_stats`: graphs compiled, graph breaks (count and the
    most frequent reasons) and recompilations."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(breaks.values())),
        "break_reasons": [reason.splitlines()[0][:160] for reason, _ in Counter(breaks).most_common(3)],
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
    }


def reset_dynamo_stats() -> None:
    """Clears dynamo's counters (not its caches: models compiled before keep their compiled code)."""
    from torch._dynamo.utils import counters

    counters.clear()
