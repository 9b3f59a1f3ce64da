"""Regenerates every page of docs/benchmarks/ from the committed results: ``python -m benchmarks.report``.

Each page (or section of a shared page) is rendered by its study's ``report`` function from the raw results under
``benchmarks/<study>/results/``; a section whose study has no committed result file yet is left exactly as it
is, and the command says so (the page itself says why: its raw results were never kept, or were kept only in the
git-ignored ``runs/``). No benchmark runs. ``--check`` regenerates into a scratch copy of the whole ``docs/``
folder (two studies also render a section of a method page beside docs/benchmarks/: docs/oftv2.md, docs/helene.md)
and exits 1 if any page would change, so that ``git diff`` after a plain run and ``--check`` agree.

The HELENE SmolLM2 page reads ``../shared/data`` (``PEFTPLUG_DATA_DIR``) for its majority-class column.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.common.paths import DOCS
from benchmarks.helene.minilm import bench as helene_minilm
from benchmarks.helene.smollm2 import budget_report as helene_budget
from benchmarks.helene.smollm2 import cli as helene_smollm2
from benchmarks.helene.smollm2 import zero_shot
from benchmarks.kernels import compile_check, gpu
from benchmarks.oftv2 import (
    conv,
    cpu,
    decode,
    fsdp2_memory,
    gpu_step_report,
    llm_sft,
    lora_export,
    overhead_report,
    qoft,
)
from benchmarks.prompt_transfer import minilm as pct_minilm
from benchmarks.steering import stories260k

#: Why a section cannot be rendered from the repository at all (its raw results lived in the ignored runs/).
IN_RUNS = "raw results only in the git-ignored runs/ (lost); rerun the study to commit them"
#: A page written by hand from an earlier generated page, not by a script.
RECORD = "a record kept as written (its raw results were lost with runs/); nothing regenerates it"


#: page -> [(section, render into the page under a docs folder (True) or nothing to render from (False), or why
#: nothing can render it)].
PAGES: dict[str, list[tuple[str, Callable[[Path], bool] | str]]] = {
    "oftv2.md": [("oftv2-cpu", lambda d: cpu.report(cpu.RESULTS, d / "oftv2.md")),
                 ("oftv2-conv", lambda d: conv.report(conv.RESULTS, d / "oftv2.md")),
                 ("oftv2-gpu", lambda d: gpu_step_report.report(gpu_step_report.RESULTS, d / "oftv2.md"))],
    "qoft.md": [("qoft-cpu", lambda d: qoft.report(qoft.RESULTS, d / "qoft.md")),
                ("qoft-gpu", lambda d: gpu.report(gpu.RESULTS, d / "qoft.md"))],
    "llm_sft.md": [("page", lambda d: llm_sft.report(d / "llm_sft.md"))],
    # The same result also renders the table in docs/oftv2.md (beside docs/benchmarks/; absent in a --check copy).
    "oftv2_overhead.md": [("page", lambda d: overhead_report.report(overhead_report.RESULTS, d / "oftv2_overhead.md"))],
    "oftv2_decode.md": [("page", lambda d: decode.report(decode.RESULTS, d / "oftv2_decode.md"))],
    "oftv2_lora_export.md": [("page", lambda d: lora_export.report(lora_export.RESULTS, d / "oftv2_lora_export.md",
                                                                   d.parent / "oftv2.md"))],
    "fsdp2_memory.md": [("page", lambda d: fsdp2_memory.report(fsdp2_memory.RESULTS, d / "fsdp2_memory.md"))],
    "kernels_sm90.md": [("page", lambda d: compile_check.report(compile_check.RESULTS, d / "kernels_sm90.md"))],
    "helene.md": [("page", lambda d: helene_minilm.report(helene_minilm.RESULTS, helene_minilm.FULL_RESULTS,
                                                          d / "helene.md"))],
    "helene_llm.md": [("page", lambda d: helene_smollm2.report(d / "helene_llm.md"))],
    "helene_llm_sweep.md": [("page", RECORD)],
    # Also renders the "Beating MeZO" section of docs/helene.md (beside docs/benchmarks/; absent in a --check copy).
    "helene_budget.md": [("page", lambda d: helene_budget.write_report(d / "helene_budget.md", d.parent / "helene.md"))],
    "prompt_cls_zero_shot.md": [("page", lambda d: zero_shot.report(d / "prompt_cls_zero_shot.md"))],
    "prompt_transfer.md": [("MiniLM part", lambda d: pct_minilm.report(pct_minilm.RESULTS, d / "prompt_transfer.md")),
                           ("pct-smollm2", IN_RUNS)],
    "steering.md": [("page", lambda d: stories260k.report(stories260k.RESULTS, d / "steering.md"))],
    "steering_llm.md": [("page", IN_RUNS)],
    "steering_llm_weddings.md": [("page", IN_RUNS)],
    "README.md": [("page", "written by hand: the index of these pages")],
}


def regenerate(docs: Path = DOCS) -> list[str]:
    """Renders every page under ``docs`` from the committed results; returns one line per section.

    Args:
        docs: The pages' folder (a scratch copy for ``--check``).
    """
    lines = []
    for page, sections in PAGES.items():
        for section, render in sections:
            if isinstance(render, str):
                lines.append(f"{page} [{section}]: kept ({render})")
            elif render(docs):
                lines.append(f"{page} [{section}]: regenerated")
            else:
                lines.append(f"{page} [{section}]: kept (no committed result file yet: the page says why)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Regenerates the pages (``--check``: in a scratch copy, and reports which would change).

    Args:
        argv: Command-line arguments.

    Returns:
        0, or 1 when ``--check`` finds a page that would change.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="regenerate into a scratch copy; exit 1 on a change")
    args = parser.parse_args(argv)
    if not args.check:
        print("\n".join(regenerate()))
        return 0
    docs_root = DOCS.parent
    with tempfile.TemporaryDirectory() as tmp:
        # The whole docs/ folder: a copy of docs/benchmarks/ alone has no docs/oftv2.md or docs/helene.md beside it,
        # so the sections rendered there were skipped and a stale one passed the check.
        copy = Path(tmp) / docs_root.name
        shutil.copytree(docs_root, copy)
        print("\n".join(regenerate(copy / DOCS.relative_to(docs_root))))
        changed = [p.relative_to(docs_root).as_posix() for p in sorted(docs_root.rglob("*")) if p.is_file()
                   and (copy / p.relative_to(docs_root)).read_bytes() != p.read_bytes()]
    print("would change: " + (", ".join(changed) if changed else "nothing"))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
