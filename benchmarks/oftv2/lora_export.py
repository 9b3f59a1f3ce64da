"""OFTv2 → LoRA export for serving, measured on the quickstart's trained SmolLM2 adapter, rank by rank.

Checkpoint: the one ``peftplug fit --config recipes/quickstart.yaml`` writes (SmolLM2-135M-Instruct, OFTv2 block 32
on every linear layer, BBC News topic answering). For each LoRA rank R (default 16, 64, 128 and ``full``):

1. **Held-out accuracy.** ``oftv2.export_lora`` writes a standard PEFT LoRA folder; a fresh full-precision base
   (loaded by name as the checkpoint's own base is, and checked equal to it) gets it with plain
   ``peft.PeftModel.from_pretrained`` and is tested with ``peftplug fit``'s post-fit evaluation (``Trainer.test``
   of a :class:`peftplug.lightning.PeftModule` on the checkpoint's own data module: greedy answers on the held-out
   articles, :mod:`peftplug.answers`). The OFTv2 adapter is tested the same way in the same run.
2. **Logit error** against the OFTv2 adapter on the same held-out prompts (every unpadded prompt position, the
   whole vocabulary): ``oftv2.measure_lora_export``, with its top-1 agreement.
3. **Size on disk** of each adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, fp32), and the
   OFTv2 adapter's (``save_pretrained``).
4. **Spectrum** of every layer's ``ΔW = W Rᵀ − W`` (``oftv2.lora_export.delta_weight``): the share of
   ``‖ΔW‖_F²`` that the top R singular values carry (what rank-R truncation keeps), the ranks that carry 90 % and
   99 % of it, and ``‖ΔW‖_F / ‖W‖_F``.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.oftv2.lora_export`` (1347 s on one core; peak RSS
16 GiB, most of it ``measure_lora_export`` holding every prompt's float64 logits and their differences) writes
``benchmarks/oftv2/results/lora_export.json``, the page ``docs/benchmarks/oftv2_lora_export.md`` and the table in
docs/oftv2.md's "Serving as LoRA" section; ``--report`` renders both from the committed result; ``--out PAGE`` is a
trial run (page and result beside it; docs/oftv2.md only with ``--doc``).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.pages import (
    outputs,
    render_results,
    require_results,
    rewrite_marked_section,
    write_json,
    write_page,
)
from benchmarks.common.paths import DOCS, REPO, SCRATCH, results_dir
from benchmarks.common.provenance import provenance, provenance_line

PAGE = DOCS / "oftv2_lora_export.md"
DOC = REPO / "docs" / "oftv2.md"
DOC_SECTION = "oftv2-lora-export"
RESULTS = results_dir("oftv2") / "lora_export.json"
CKPT = SCRATCH / "quickstart" / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=48.ckpt"
WORK = SCRATCH / "lora_export"
RANKS = ("16", "64", "128", "full")
#: The issue's goal: the smallest R whose held-out accuracy is at most this far below the OFTv2 adapter's.
TOLERANCE = 0.01
#: Shares of ‖ΔW‖_F² whose rank the spectrum table reports.
ENERGY_LEVELS = (0.9, 0.99)
TITLE = "# OFTv2 → LoRA export: accuracy, logit error, size and spectrum per rank"


def parse_rank(text: str) -> int | str:
    """A rank from the command line: a positive integer or ``full``.

    Args:
        text: The argument.

    Raises:
        ValueError: Naming ``--ranks`` and the accepted values.
    """
    if text == "full":
        return "full"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"--ranks takes positive integers or 'full'; got {text!r}")


def data_module(hparams: dict):
    """The checkpoint's own data module, rebuilt from its recorded hyperparameters (``_class_path`` + arguments).

    Args:
        hparams: The checkpoint's ``datamodule_hyper_parameters``.
    """
    if not hparams or "_class_path" not in hparams:
        raise ValueError("the checkpoint records no data module (datamodule_hyper_parameters); it needs one "
                         "with a held-out split, e.g. recipes/quickstart.yaml's")
    module_name, _, class_name = hparams["_class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**{k: v for k, v in hparams.items() if not k.startswith("_")})


def held_out_accuracy(module, data) -> tuple[float, float]:
    """``(test_acc, seconds)``: ``peftplug fit``'s post-fit evaluation (``Trainer.test`` on the held-out split).

    Args:
        module: A :class:`peftplug.lightning.PeftModule`.
        data: The data module.
    """
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    return float(metrics["test_acc"]), time.perf_counter() - start


def folder_mib(folder: Path) -> float:
    """Size of the files in an adapter folder, in MiB.

    Args:
        folder: The folder.
    """
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20


def _check_same_base(base: torch.nn.Module, peft_model) -> None:
    """Raises unless ``base`` holds exactly the OFTv2 model's base weights (the LoRA must sit on the same base)."""
    adapted = {k.replace(".base_layer.", "."): v for k, v in peft_model.get_base_model().state_dict().items()
               if "oftv2_" not in k}
    for name, tensor in base.state_dict().items():
        if name not in adapted or not torch.equal(adapted[name], tensor):
            raise RuntimeError(f"the reloaded base differs from the checkpoint's at {name!r}")


def spectrum(peft_model, ranks: list) -> list[dict]:
    """Per OFTv2 layer: shape, ``‖ΔW‖_F / ‖W‖_F``, the share of ``‖ΔW‖_F²`` in the top R singular values for each
    rank, and the ranks that reach :data:`ENERGY_LEVELS` of it.

    Args:
        peft_model: The ``PeftModel`` holding the OFTv2 adapter ``default``.
        ranks: The measured ranks (``full`` is left out: it keeps everything).
    """
    from oftv2.lora_export import delta_weight, oftv2_layers

    rows = []
    for path, layer in oftv2_layers(peft_model):
        with torch.no_grad():
            weight = layer._get_base_weight().double()
            delta = delta_weight(layer, "default", weight)
            energy = torch.linalg.svdvals(delta).square()
        share = (energy.cumsum(0) / energy.sum()).tolist()
        rows.append({
            "module": path, "shape": list(delta.shape), "full_rank": len(share),
            "relative_norm": float(delta.norm() / weight.norm()),
            "energy": {str(r): share[min(r, len(share)) - 1] for r in ranks if r != "full"},
            "rank_for": {str(level): next(i + 1 for i, s in enumerate(share) if s >= level - 1e-12)
                         for level in ENERGY_LEVELS},
        })
    return rows


def measure(ckpt: Path, ranks: list, work: Path) -> dict:
    """Every number of the page, for one checkpoint (see the module docstring).

    Args:
        ckpt: A ``peftplug fit`` checkpoint of an OFTv2 adapter on a causal LM with chat data.
        ranks: LoRA ranks (ints and/or ``"full"``).
        work: Scratch folder for the adapter folders (emptied first, removed at the end).
    """
    from peft import PeftModel

    import oftv2
    from peftplug.checkpoints import load_checkpoint_module, read_checkpoint
    from peftplug.lightning import PeftModule
    from peftplug.loading import load_model

    start = time.perf_counter()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = data_module(read_checkpoint(ckpt, mmap=True).get("datamodule_hyper_parameters"))
    oft = load_checkpoint_module(ckpt)
    hp = oft.hparams
    oft_acc, oft_eval_s = held_out_accuracy(oft, data)  # also sets the data module up
    oft.model.save_pretrained(work / "oftv2")
    record = {"checkpoint": str(ckpt.relative_to(REPO) if ckpt.is_relative_to(REPO) else ckpt),
              "model": hp["model"], "peft": {k: hp["peft"].get(k) for k in ("peft_type", "block_size",
                                                                             "orthogonalization", "neumann_terms",
                                                                             "target_modules")},
              "n_test": len(data.test_dataloader().dataset),
              "oftv2": {"accuracy": oft_acc, "eval_s": oft_eval_s, "size_mib": folder_mib(work / "oftv2"),
                        "parameters": sum(p.numel() for n, p in oft.model.named_parameters() if "oftv2_" in n)}}

    tick = time.perf_counter()
    record["spectrum"] = spectrum(oft.model, ranks)
    record["spectrum_s"] = time.perf_counter() - tick
    tick = time.perf_counter()
    prompts = [{"input_ids": b["gen_input_ids"], "attention_mask": b["gen_attention_mask"]}
               for b in data.test_dataloader()]
    errors = {str(row["rank"]): row for row in oftv2.measure_lora_export(oft.model, prompts, ranks)}
    record["logit_s"] = time.perf_counter() - tick
    del prompts

    record["ranks"] = []
    for rank in ranks:
        tick = time.perf_counter()
        folder = work / f"lora_r{rank}"
        export = oftv2.export_lora(oft.model, folder, rank=rank)
        base = load_model(hp["model"], hp["task"], "none", hp["dtype"], pad_token_id=oft.tokenizer.pad_token_id)
        _check_same_base(base, oft.model)
        lora = PeftModel.from_pretrained(base, folder)
        if lora.peft_config["default"].peft_type.value != "LORA":
            raise RuntimeError(f"{folder} did not load as a PEFT LoRA adapter")
        module = PeftModule(lora, task=hp["task"], tokenizer=hp["model"], max_new_tokens=hp["max_new_tokens"])
        accuracy, eval_s = held_out_accuracy(module, data)
        row = errors[str(rank)]
        record["ranks"].append({
            "rank": rank, "r": export.config.r, "accuracy": accuracy, "eval_s": eval_s,
            "size_mib": folder_mib(folder), "parameters": export.num_parameters,
            "max_abs_logit_error": row["max_abs_logit_error"], "mean_abs_logit_error": row["mean_abs_logit_error"],
            "top1_agreement": row["top1_agreement"], "max_dropped": row["max_dropped"],
            "mean_dropped": statistics.fmean(export.dropped.values()), "seconds": time.perf_counter() - tick,
        })
        print(f"R={rank}: accuracy {accuracy:.3f} (OFTv2 {oft_acc:.3f}), max |Δlogit| "
              f"{row['max_abs_logit_error']:.3g}, {record['ranks'][-1]['size_mib']:.1f} MiB", flush=True)
        del module, lora, base
        shutil.rmtree(folder)
    shutil.rmtree(work)
    record["seconds"] = time.perf_counter() - start
    return record


def goal_rank(record: dict) -> dict | None:
    """The smallest measured rank whose held-out accuracy is at least the OFTv2 adapter's minus :data:`TOLERANCE`.

    Args:
        record: A result record.
    """
    oft = record["oftv2"]["accuracy"]
    # Rounded: accuracies are multiples of 1/n_test, and 0.96 - 0.01 must admit 0.95.
    return next((row for row in record["ranks"] if round(row["accuracy"] - (oft - TOLERANCE), 9) >= 0), None)


def _mean_energy(record: dict, rank: str, module: str | None = None) -> tuple[float, float]:
    shares = [layer["energy"][rank] for layer in record["spectrum"]
              if module is None or layer["module"].rsplit(".", 1)[-1] == module]
    return statistics.fmean(shares), min(shares)


def rank_table(record: dict) -> list[str]:
    """The per-rank table (shared by the page and docs/oftv2.md), goal line included.

    Args:
        record: A result record.
    """
    oft = record["oftv2"]
    lines = [("| adapter | r | held-out acc. | Δ acc. | max \\|Δlogit\\| | mean \\|Δlogit\\| | top-1 agree | "
             "top-R energy (mean / min layer) | size (MiB) | × OFTv2 size |"),
             "|---|---|---|---|---|---|---|---|---|---|",
             (f"| OFTv2 b={record['peft']['block_size']} (reference) | — | {oft['accuracy']:.3f} | — | 0 | 0 | 1 | — | "
             f"{oft['size_mib']:.2f} | 1 |")]
    for row in record["ranks"]:
        rank = str(row["rank"])
        energy = (f"{_mean_energy(record, rank)[0]:.3f} / {_mean_energy(record, rank)[1]:.3f}"
                  if rank != "full" else "1 / 1")
        lines.append(f"| LoRA R={rank} | {row['r']} | {row['accuracy']:.3f} | {row['accuracy'] - oft['accuracy']:+.3f} | "
                     f"{row['max_abs_logit_error']:.3g} | {row['mean_abs_logit_error']:.3g} | "
                     f"{row['top1_agreement']:.4f} | {energy} | {row['size_mib']:.2f} | "
                     f"{row['size_mib'] / oft['size_mib']:.1f} |")
    goal = goal_rank(record)
    verdict = (f"**R = {goal['rank']}** ({goal['accuracy']:.3f} vs {oft['accuracy']:.3f}, "
               f"{goal['size_mib']:.1f} MiB)" if goal else "none of the measured ranks")
    truncated = [row["rank"] for row in record["ranks"] if row["rank"] != "full"]
    if goal and goal["rank"] == "full" and truncated:
        verdict += (f"; no truncated rank measured keeps it, and ranks between {max(truncated)} and full were not "
                    "measured")
    return lines + ["", (f"Goal (smallest measured R within {TOLERANCE} of the OFTv2 adapter's held-out accuracy): "
                        f"{verdict}.")]


def spectrum_table(record: dict) -> list[str]:
    """Per module type: mean relative size of ΔW, mean top-R energy, and the ranks reaching 90 % / 99 % of it.

    Args:
        record: A result record.
    """
    ranks = [str(row["rank"]) for row in record["ranks"] if row["rank"] != "full"]
    lines = ["| module | ΔW shape | layers | ‖ΔW‖/‖W‖ (mean) | " + " | ".join(f"top-{r} energy" for r in ranks)
             + " | " + " | ".join(f"rank for {100 * level:g} % (mean, min–max)" for level in ENERGY_LEVELS) + " |",
             "|---" * (4 + len(ranks) + len(ENERGY_LEVELS)) + "|"]
    kinds: dict[str, list[dict]] = {}
    for layer in record["spectrum"]:
        kinds.setdefault(layer["module"].rsplit(".", 1)[-1], []).append(layer)
    for kind, layers in kinds.items():
        shape = "×".join(str(n) for n in layers[0]["shape"])
        cells = [kind, shape, str(len(layers)), f"{statistics.fmean(x['relative_norm'] for x in layers):.4f}"]
        cells += [f"{_mean_energy(record, r, kind)[0]:.3f}" for r in ranks]
        for level in ENERGY_LEVELS:
            needed = [x["rank_for"][str(level)] for x in layers]
            cells.append(f"{statistics.fmean(needed):.0f} of {layers[0]['full_rank']} ({min(needed)}–{max(needed)})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def spectrum_sentence(record: dict) -> str:
    """One sentence comparing the measured top-R energy with what a flat spectrum would put there.

    Args:
        record: A result record.
    """
    parts = []
    for row in record["ranks"]:
        if row["rank"] == "full":
            continue
        rank = str(row["rank"])
        flat = statistics.fmean(min(1.0, row["rank"] / x["full_rank"]) for x in record["spectrum"])
        parts.append(f"R = {rank}: {_mean_energy(record, rank)[0]:.3f} (flat: {flat:.3f})")
    level = str(ENERGY_LEVELS[-1])
    needed = statistics.fmean(x["rank_for"][level] / x["full_rank"] for x in record["spectrum"])
    return (f"OFT's ΔW = W (Rᵀ − I) is generally full rank; here the top R singular values carry, as a mean over "
            f"layers, this share of each layer's ‖ΔW‖² — {'; '.join(parts)} (in brackets: a perfectly flat spectrum, "
            f"R / min(out, in)) — and {100 * float(level):g} % of it takes on average {100 * needed:.0f} % of the "
            "layer's full rank.")


def doc_section(record: dict) -> str:
    """The measured table for docs/oftv2.md's "Serving as LoRA" section.

    Args:
        record: A result record.
    """
    lines = [(f"Measured on the quickstart's adapter (`{record['model']}`, OFTv2 block {record['peft']['block_size']} "
             f"on every linear layer, {record['n_test']} held-out BBC News articles; the LoRA folders loaded with "
             "plain PEFT onto the same fp32 base; logit errors on the same prompts, every position and token; "
             "sizes are fp32 folders on disk):"), "", *rank_table(record), "",
             spectrum_sentence(record) + " Per module type, spectrum and timings: "
             "[benchmarks/oftv2_lora_export.md](benchmarks/oftv2_lora_export.md) "
             "(`python -m benchmarks.oftv2.lora_export`)."]
    return "\n".join(lines)


def render_page(record: dict) -> str:
    """The whole page.

    Args:
        record: A result record.
    """
    oft = record["oftv2"]
    times = ", ".join(f"R={row['rank']} {row['seconds']:.0f} s (its evaluation {row['eval_s']:.0f} s)"
                      for row in record["ranks"])
    lines = [TITLE, "",
             (f"Written by `python -m benchmarks.oftv2.lora_export` from `benchmarks/oftv2/results/lora_export.json`. "
             f"Checkpoint: `{record['checkpoint']}` (`{record['model']}`, {record['peft']['peft_type']} block "
             f"{record['peft']['block_size']}, {record['peft']['orthogonalization']} with "
             f"{record['peft']['neumann_terms']} terms, target `{record['peft']['target_modules']}`: "
             f"{oft['parameters']:,} trainable parameters). For each R, `oftv2.export_lora` writes a PEFT LoRA folder "
             "(`lora_alpha = r`, rank clipped per layer to `min(out, in)`); a fresh fp32 base, checked equal to the "
             "checkpoint's, loads it with plain `PeftModel.from_pretrained`; held-out accuracy is `peftplug fit`'s "
             f"post-fit evaluation (greedy answers on the same {record['n_test']} held-out articles, "
             "`peftplug.answers`), the OFTv2 adapter evaluated the same way in the same run. Logit errors: "
             "`oftv2.measure_lora_export` against the OFTv2 adapter on the held-out prompts (every unpadded position, "
             "the whole vocabulary; top-1 agreement = same argmax token). Energy: the share of `‖ΔW‖_F²` in the top R "
             "singular values of `ΔW = W Rᵀ − W`, i.e. `1 − (relative Frobenius error of the rank-R export)²`."), "",
             provenance_line(record["provenance"]), "",
             "## Per rank", "", *rank_table(record), "",
             "## The spectrum of ΔW, per module type", "", *spectrum_table(record), "",
             spectrum_sentence(record) + " What the truncation costs on the task is the accuracy and logit "
             "columns, not the energy. At full rank the LoRA adapter reproduces the OFTv2 one to float rounding but "
             "holds `Σ k (out + in)` parameters against OFTv2's `in (b − 1) / 2` per layer (the size column).", "",
             (f"Times (one thread): OFTv2 evaluation {oft['eval_s']:.0f} s; spectrum {record['spectrum_s']:.0f} s; "
             f"logit errors, all ranks {record['logit_s']:.0f} s; per rank (export, load, evaluation): {times}; "
             f"total {record['seconds']:.0f} s.")]
    return "\n".join(lines) + "\n"


def write_doc_section(doc: Path, record: dict) -> None:
    """Rewrites the measured table inside docs/oftv2.md's "Serving as LoRA" section (between its markers).

    Args:
        doc: The method page.
        record: A result record.

    Raises:
        ValueError: If ``doc`` has no ``oftv2-lora-export`` section (the table must not land at the page's end).
    """
    rewrite_marked_section(doc, DOC_SECTION, lambda: doc_section(record))


def report(results: Path, page: Path, doc: Path | None = None) -> bool:
    """Renders the page (and the docs/oftv2.md table when ``doc`` exists) from a result file.

    Args:
        results: The JSON that :func:`main` wrote.
        page: The page.
        doc: The method page holding the table, or ``None``; skipped when the file does not exist.

    Returns:
        Whether there was a result file.
    """

    def render(record: dict) -> None:
        write_page(page, render_page(record))
        if doc is not None and doc.is_file():
            write_doc_section(doc, record)

    return render_results(results, render)


def main(argv: list[str] | None = None) -> None:
    """Measures (or with ``--report`` renders) and writes the result, the page and the docs table.

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, default=CKPT, help="a peftplug fit checkpoint of an OFTv2 adapter")
    parser.add_argument("--ranks", nargs="+", default=list(RANKS), help="LoRA ranks: positive integers or 'full'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=WORK, help="scratch folder for the adapter folders")
    parser.add_argument("--out", type=Path, default=None,
                        help="trial page, its result file beside it (default: docs/benchmarks/oftv2_lora_export.md "
                             "with benchmarks/oftv2/results/lora_export.json)")
    parser.add_argument("--doc", type=Path, default=None,
                        help="method page holding the table (default: docs/oftv2.md unless --out is given)")
    parser.add_argument("--report", action="store_true", help="render from the result file; measure nothing")
    args = parser.parse_args(argv)
    page, results = outputs(args.out, PAGE, RESULTS)
    doc = args.doc if args.doc is not None else (DOC if args.out is None else None)
    if args.report:
        require_results(report(results, page, doc), results)
        return
    ranks = [parse_rank(r) for r in args.ranks]
    if not args.ckpt.is_file():
        raise SystemExit(f"no checkpoint at {args.ckpt}: run `make quickstart` first (or pass --ckpt)")
    torch.set_num_threads(args.threads)
    record = measure(args.ckpt, ranks, args.work)
    record["provenance"] = provenance(("benchmarks", "peftplug", "oftv2"))
    write_json(results, record)
    report(results, page, doc)
    print(f"wrote {results}, {page}" + (f", {doc}" if doc else ""))


if __name__ == "__main__":
    main()
