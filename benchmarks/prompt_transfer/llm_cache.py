"""Where the SmolLM2 PCT benchmark keeps its runs: the method names, the settings a sensitivity check may vary, and
the cache layout under ``--work`` that :mod:`benchmarks.prompt_transfer.llm` writes and
:mod:`benchmarks.prompt_transfer.llm_report` reads (here, so that neither imports the other)."""

from __future__ import annotations

import os

METHODS = ("PT", "SPoT", "PCT", "PCT w/o contrastive", "PCT w/o attention")
#: The settings a sensitivity check varies, with their defaults (``--lr``, ``--attention-lr``, ``--temperature``) and
#: the short names of the cache folders that hold runs at other values (see :func:`variant_name`).
VARIANT_SETTINGS = {"lr": ("lr", 3e-2), "attention_lr": ("alr", 5e-2), "temperature": ("tau", 0.1)}
#: Which of them each method's training reads (prompt tuning has no attention; ``w/o attention`` averages the
#: sources with fixed weights).
METHOD_SETTINGS = {"PT": ("lr",), "SPoT": ("lr",), "PCT": tuple(VARIANT_SETTINGS),
                   "PCT w/o contrastive": tuple(VARIANT_SETTINGS), "PCT w/o attention": ("lr",)}
#: The section of docs/benchmarks/prompt_transfer.md the SmolLM2 runs own (the MiniLM run owns the rest).
SECTION = "pct-smollm2"
#: The page's first line when it does not exist yet.
TITLE = "# PCT prompt transfer benchmark"


def variant_name(args, method: str) -> str:
    """The cache sub-folder of ``method``'s runs at non-default optimisation settings ("" at the defaults).

    Runs at the default lr, attention lr and temperature live in ``<work>/targets/<target>/<seed>/``; a run at any
    other value of the settings ``method`` uses (:data:`METHOD_SETTINGS`: PT's lr, PCT's temperature) lives in a
    sub-folder named after the values that differ (``lr0.003``, ``tau1``, ``lr0.3_tau1``), so it never overwrites
    or is mistaken for a main run, and a setting the method ignores (PT at ``--temperature 1``) reuses the main run
    instead of repeating it. Other settings (steps, batch, prompt length) are not part of the key: change them with
    a new ``--work``.

    Args:
        args: Parsed arguments.
        method: One of :data:`METHODS`.
    """
    return "_".join(f"{short}{getattr(args, field):.12g}" for field, (short, default) in VARIANT_SETTINGS.items()
                    if field in METHOD_SETTINGS[method] and getattr(args, field) != default)


def variant_settings(args, method: str) -> dict:
    """The values of the :data:`VARIANT_SETTINGS` that ``method`` uses (recorded in each target result)."""
    return {field: getattr(args, field) for field in VARIANT_SETTINGS if field in METHOD_SETTINGS[method]}


def target_folder(args, target: str, seed: int, method: str) -> str:
    """Where ``method``'s (target, seed) runs at ``args``' settings are cached (see :func:`variant_name`)."""
    return os.path.join(args.work, "targets", target, str(seed), variant_name(args, method))


def slug(text: str) -> str:
    """A file-name form of a method name (``PCT w/o attention`` -> ``pct_wo_attention``)."""
    return "".join(c if c.isalnum() else "_" for c in text.lower().replace("w/o", "wo"))
