"""One run of the SmolLM2 prompt-classification benchmark (zero-shot, zeroth-order or first-order), cached on disk.

A run is a :class:`RunSpec`; its optimizer an entry of :data:`OPTIMIZERS` (adding an optimizer to the grid is
one entry there: how to build it, what a step costs in forward passes, whether it is zeroth-order). Its result is
one JSON file ``benchmarks/helene/results/helene_llm/runs/<run_id>.json`` (committed), written atomically when the
run has finished. The JSON records the exact settings, the git commit the run started at, per-step training loss
and timings, validation curves and the final test accuracy. An interrupted zeroth-order run resumes from its
journal (``partial/<run_id>.json``, see :mod:`benchmarks.helene.smollm2.journal`); any other interrupted run
starts again. Training goes through :class:`peftplug.lightning.PeftModule` with ``task="prompt_cls"`` and
Lightning (manual optimization for the zeroth-order optimizers). Peak memory and step-time measurements:
:mod:`benchmarks.helene.smollm2.measure`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks.common.device import lightning_device, resolve_device
from benchmarks.common.pages import read_json, write_json
from benchmarks.common.paths import SCRATCH as SCRATCH_ROOT
from benchmarks.common.paths import data_dir, results_dir
from benchmarks.common.provenance import git_commit, peak_rss_mib
from benchmarks.helene.smollm2.journal import (
    FLUSH_EVERY,
    ReplayMismatch,
    journaled,
    load_partial,
    partial_path,
    same_point,
)

MODEL = "smollm2-135m-instruct"
#: Results are committed (small JSONs): runs/ is scratch that a fresh checkout does not have, and the grid spans
#: sessions -- a cache kept there was lost once with every sweep in it (see ``PINNED_LR`` in grid.py).
CACHE = results_dir("helene") / "helene_llm"
RUNS = CACHE / "runs"
#: Journals of unfinished zeroth-order runs (committed at a stop, so the next session resumes them).
PARTIAL = CACHE / "partial"
#: Lightning's own logs and checkpoints: scratch, never committed.
SCRATCH = SCRATCH_ROOT / "helene_llm"
#: The code a run depends on: a result records the commit, ``+dirty`` when these had uncommitted changes.
CODE = ("helene", "peftplug", "benchmarks/common", "benchmarks/helene")
#: Where runs execute: "cpu" (this machine) or "cuda" (a lent GPU). Not part of a run's identity -- the protocol is
#: the same -- but recorded in every result (``device``), since the z draws (and so the numbers) differ by device.
DEVICE = os.environ.get("PEFTPLUG_BENCH_DEVICE", "cpu")


def set_device(device: str) -> None:
    """Selects where runs execute (a ``--device`` value: ``cpu``, ``cuda`` or ``auto``)."""
    global DEVICE
    device = resolve_device(device)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device: this benchmark runs on cpu or cuda (the current device), got {device!r}")
    DEVICE = device


def device_name() -> str:
    """What the runs executed on, for the result files."""
    return f"cuda: {torch.cuda.get_device_name()}" if DEVICE == "cuda" else f"cpu: {torch.get_num_threads()} threads"


def measurement_file(kind: str, mode: str | None = None) -> str:
    """File name of a memory or speed measurement: ``memory_<mode>.json`` / ``speed.json`` on CPU, with ``cuda_``
    after the kind on a GPU (the two are different questions: RSS on CPU, allocated device memory on a GPU)."""
    parts = [kind] + (["cuda"] if DEVICE == "cuda" else []) + ([mode] if mode else [])
    return "_".join(parts) + ".json"

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Optimizer:
    """One optimizer of the grid: how it is built and what one of its steps costs.

    Args:
        label: Its name on the page.
        make: ``make(spec, wrap)`` -> the optimizer callable PeftModule calls with the trainable (name, parameter)
            pairs; ``wrap`` turns a zeroth-order optimizer class into its journaled subclass (identity without a
            journal, see :func:`optimizer_factory`).
        forwards_per_step: Forward passes over a training batch per step (2 for two-point SPSA, N + 1 for FZOO's N
            perturbations, 1 for AdamW plus its backward; a mean where steps differ, 2.1 for a centre pass every 10th
            step). A planning number (run lengths, plots of the grid): the equal-forward-pass comparison
            (:mod:`benchmarks.helene.smollm2.budget`) counts the optimizer's own ``forward_passes`` instead.
        zeroth_order: Trains every parameter without a backward, resumable from a journal; ``False``: first-order.
        peft: The adapter it trains (a PEFT config dict), or ``None`` for every parameter.
        quantization: The base model's quantization (``PeftModule(quantization=...)``): ``none`` or ``nf4``.
    """

    label: str
    make: Callable
    forwards_per_step: float
    zeroth_order: bool = True
    peft: dict | None = None
    quantization: str = "none"


def _zosgd(spec, wrap, **extra):
    from helene import ZOSGD

    return partial(wrap(ZOSGD), lr=spec.lr, eps=spec.eps, seed=spec.split_seed, **extra)


def _zoadam(spec, wrap):
    from helene import ZOAdam

    return partial(wrap(ZOAdam), lr=spec.lr, eps=spec.eps, seed=spec.split_seed)


def _helene(spec, wrap, hessian, **extra):
    from helene import Helene

    # Defaults of helene.Helene (β 0.9/0.99, γ 1, λ 1 per tensor, k 10, T = 10% of the run), A-GNB scaled by the
    # batch size; the ablation only swaps the estimator (``extra``: the preconditioner switches).
    extra.setdefault("preconditioner", "hessian")  # the paper's, unless a method names another
    return partial(wrap(Helene), lr=spec.lr, eps=spec.eps, layerwise="tensor", batch_size=spec.batch_size,
                   hessian=hessian, seed=spec.split_seed, **extra)


def _fzoo(spec, wrap, n_probes):
    from helene import FZOO

    # The authors' Rademacher probes; every other argument at FZOO's defaults.
    return partial(wrap(FZOO), lr=spec.lr, eps=spec.eps, n_probes=n_probes, seed=spec.split_seed)


def _adamw(spec, wrap):
    return partial(torch.optim.AdamW, lr=spec.lr, weight_decay=0.0)


#: The optimizers of the grid, by method name. "helene_anneal" = HELENE with no Hessian (h ≡ 0, so the denominator
#: is γ·λ = 1): MeZO plus annealed momentum — the ablation the reviews point at. "mezo_rademacher" = MeZO with
#: z = ±1 instead of N(0, I) (a follow-up: its draws cost a fraction of the Gaussian's, see helene.zo).
OPTIMIZERS: dict[str, Optimizer] = {
    "mezo": Optimizer("MeZO (ZO-SGD)", _zosgd, 2),
    "helene": Optimizer("HELENE", partial(_helene, hessian="agnb"), 2),
    "helene_anneal": Optimizer("HELENE anneal only", partial(_helene, hessian="none"), 2),
    "zoadam": Optimizer("ZO-Adam", _zoadam, 2),
    "adamw_lora": Optimizer("AdamW LoRA r=8", _adamw, 1, zeroth_order=False,
                            peft={"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                                  "target_modules": LORA_TARGETS}),
    "mezo_rademacher": Optimizer("MeZO, Rademacher z (follow-up)", partial(_zosgd, perturbation="rademacher"), 2),
}
#: The optimizers the equal-forward-pass comparison adds (:mod:`benchmarks.helene.smollm2.budget`, issue 27).
#: "helene_scalar": momentum over the square root of one EMA of c² (``preconditioner="scalar"``), "_bc" with Adam's
#: bias correction of that EMA (the ablation); "hizoo": the paper's HELENE with HiZOO's three-point curvature
#: estimate (a third forward on each refresh step, every 10th).
OPTIMIZERS.update({
    "fzoo4": Optimizer("FZOO N=4", partial(_fzoo, n_probes=4), 5),
    "fzoo8": Optimizer("FZOO N=8", partial(_fzoo, n_probes=8), 9),
    "helene_scalar": Optimizer("HELENE scalar preconditioner",
                               partial(_helene, hessian=None, preconditioner="scalar"), 2),
    "helene_scalar_bc": Optimizer("HELENE scalar, bias-corrected",
                                  partial(_helene, hessian=None, preconditioner="scalar", bias_correction=True), 2),
    "hizoo": Optimizer("HELENE + HiZOO curvature", partial(_helene, hessian="curvature"), 2.1),
})
#: OFTv2 (block 32, every linear layer of the decoder) on an nf4 base: zeroth-order finetuning at 4-bit inference
#: memory. One entry per zeroth-order optimizer above, so that whichever wins the comparison can run on nf4.
OFTV2_B32 = {"peft_type": "OFTV2", "block_size": 32, "target_modules": LORA_TARGETS}
OPTIMIZERS.update({
    f"{name}_nf4": Optimizer(f"{OPTIMIZERS[name].label}, nf4 + OFTv2 b32", OPTIMIZERS[name].make,
                             OPTIMIZERS[name].forwards_per_step, peft=OFTV2_B32, quantization="nf4")
    for name in ("mezo", "mezo_rademacher", "zoadam", "fzoo4", "fzoo8", "helene_scalar", "helene_scalar_bc", "hizoo")
})
METHODS = ("zeroshot", *OPTIMIZERS)
ZO_METHODS = tuple(name for name, opt in OPTIMIZERS.items() if opt.zeroth_order)


@dataclass(frozen=True)
class RunSpec:
    """The exact settings of one run.

    Args:
        task: Prompt task (``sst2``, ``rte``, ...).
        split_seed: k-shot split seed (also the optimizer's and the shuffle's seed).
        method: One of :data:`METHODS`.
        lr: Learning rate (0 for zero-shot).
        steps: Optimizer steps (0 for zero-shot).
        purpose: ``main`` (the grid) or ``sweep`` (lr selection).
        k: Shots per class.
        batch_size: Training batch size (16 = the whole 32-example k=16 binary set in 2 steps).
        eps: Zeroth-order perturbation scale.
        fmt: Prompt rendering, ``plain`` or ``chat``.
        max_test: Test examples used at most (fixed subset, the same for every run).
        eval_every: Validation (the split's dev set) every this many steps.
        max_length: Prompt tokens at most (the first field — sentence or premise — is cut from its end).
    """

    task: str
    split_seed: int
    method: str
    lr: float = 0.0
    steps: int = 0
    purpose: str = "main"
    k: int = 16
    batch_size: int = 16
    eps: float = 1e-3
    fmt: str = "plain"
    max_test: int = 500
    eval_every: int = 25
    max_length: int = 256

    @property
    def run_id(self) -> str:
        """File name of the run's result."""
        base = f"{self.task}_k{self.k}_s{self.split_seed}_{self.method}_{self.fmt}"
        if self.max_length != 256:
            base += f"_L{self.max_length}"
        if self.method == "zeroshot":
            return f"{base}_t{self.max_test}"
        return f"{base}_lr{self.lr:g}_n{self.steps}_b{self.batch_size}_t{self.max_test}_{self.purpose}"


def result_path(spec: RunSpec) -> Path:
    """Where the result JSON of ``spec`` lives."""
    return RUNS / f"{spec.run_id}.json"


def load_result(spec: RunSpec) -> dict | None:
    """The cached result of ``spec``, or ``None`` when it has not finished."""
    return read_json(result_path(spec))


def _write_json(path: Path, data: dict) -> None:
    # A temporary name of its own per writer: two processes finishing the same run never share one.
    write_json(path, data)


def _git_commit() -> str:
    return git_commit(CODE)


def cuda_memory() -> dict:
    """Peak CUDA memory allocated by this process (empty on CPU): the GPU counterpart of the peak RSS."""
    if DEVICE != "cuda":
        return {}
    return {"peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20}


# ------------------------------------------------------------------------------------------------- building
def optimizer_factory(spec: RunSpec, journal: list[list[float]] | None = None):
    """The optimizer callable PeftModule calls with the trainable (name, parameter) pairs.

    Args:
        spec: The run.
        journal: For a zeroth-order run, the closure values per step so far; the optimizer replays them and
            appends the new ones (:func:`benchmarks.helene.smollm2.journal.journaled`). ``None``: no journal.

    Raises:
        ValueError: For a method that is not in :data:`OPTIMIZERS`.
    """
    if spec.method not in OPTIMIZERS:
        raise ValueError(f"method: no optimizer {spec.method!r}; known: {', '.join(OPTIMIZERS)}")

    def wrap(cls):
        return cls if journal is None else journaled(cls, journal)

    return OPTIMIZERS[spec.method].make(spec, wrap)


def build(spec: RunSpec, journal: list[list[float]] | None = None):
    """(PeftModule, PromptClassificationData) of a run (``journal``: see :func:`optimizer_factory`)."""
    from peftplug.lightning import PeftModule

    torch.manual_seed(spec.split_seed)  # LoRA's init draws from the global RNG
    entry = OPTIMIZERS.get(spec.method)
    peft = entry.peft if entry is not None else None
    optimizer = None if spec.method == "zeroshot" else optimizer_factory(spec, journal)
    module = PeftModule(MODEL, task="prompt_cls", peft=peft, optimizer=optimizer,
                        quantization=entry.quantization if entry is not None else "none")
    return module, data_module(spec, module.tokenizer)


def data_module(spec: RunSpec, tokenizer):
    """The PromptClassificationData of a run (not set up), with ``tokenizer``.

    Args:
        spec: The run.
        tokenizer: The model's tokenizer.
    """
    from peftplug.prompt_cls import PromptClassificationData

    data = PromptClassificationData(spec.task, data_dir=str(data_dir()), k=spec.k, split_seed=spec.split_seed,
                                    format=spec.fmt, max_test=spec.max_test, max_length=spec.max_length,
                                    batch_size=spec.batch_size,
                                    eval_batch_size=32, seed=spec.split_seed)
    data.tokenizer = tokenizer
    return data


class _Recorder:
    """Lightning callback: per-step loss and wall time, decoder-forward time, validation points.

    Args:
        module: The PeftModule being trained.
        resumed: The journal being replayed (its ``steps`` and ``val`` rows stand for the replayed steps, whose
            own timings are a replay's), or ``None``.
        flush: Called after every :data:`FLUSH_EVERY`-th new step (writes the journal).
    """

    def __init__(self, module, resumed: dict | None = None, flush=None) -> None:
        import lightning as L

        class Callback(L.Callback):
            pass

        self.steps: list[dict] = list(resumed["steps"]) if resumed else []
        self.val: list[dict] = list(resumed["val"]) if resumed else []
        self.replayed = len(self.steps)
        self._t0 = 0.0
        self._fwd = 0.0
        recorder = self

        lm = module.model.get_base_model() if hasattr(module.model, "get_base_model") else module.model
        decoder = lm.get_decoder()
        starts: list[float] = []
        decoder.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

        def post(*_):
            recorder._fwd += time.perf_counter() - starts.pop()

        decoder.register_forward_hook(post)

        def on_train_batch_start(cb, trainer, pl_module, batch, batch_idx):
            recorder._fwd = 0.0
            recorder._t0 = time.perf_counter()

        def on_train_batch_end(cb, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step <= recorder.replayed:
                return  # a replayed step: its row is on record
            loss = trainer.callback_metrics.get("train_loss")
            recorder.steps.append({
                "step": trainer.global_step, "loss": None if loss is None else float(loss),
                "time": time.perf_counter() - recorder._t0, "forward_time": recorder._fwd,
                "tokens": int(batch["attention_mask"].sum()), "width": int(batch["input_ids"].shape[1]),
            })
            if flush is not None and trainer.global_step % FLUSH_EVERY == 0:
                flush()

        def on_validation_end(cb, trainer, pl_module):
            # After the module's epoch-end hook has logged val_acc (callback epoch-end hooks run before it).
            m = trainer.callback_metrics
            if "val_acc" not in m:
                return
            point = {"step": trainer.global_step, "acc": float(m["val_acc"]), "loss": float(m["val_loss"])}
            on_record = [v for v in recorder.val if v["step"] == point["step"]]
            if not on_record:
                recorder.val.append(point)
            elif not same_point(on_record[0], point):
                raise ReplayMismatch(f"validation at step {point['step']}: replayed {point}, on record "
                                     f"{on_record[0]}")

        Callback.on_train_batch_start = on_train_batch_start
        Callback.on_train_batch_end = on_train_batch_end
        Callback.on_validation_end = on_validation_end
        self.callback = Callback()


def _trainer(spec: RunSpec, callbacks: list):
    import lightning as L

    return L.Trainer(
        **lightning_device(DEVICE), max_steps=max(spec.steps, 1), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        val_check_interval=spec.eval_every, check_val_every_n_epoch=None, callbacks=callbacks,
        default_root_dir=str(SCRATCH / "lightning"),
    )


class RunHooks:
    """What a study built on these runs changes about one; the grid's runs use this class as it is.

    :func:`execute` asks it for the run's identity (name, settings, result and journal files), for Lightning
    callbacks of its own (e.g. test points at fixed forward-pass budgets and a stop rule), and for fields it adds to
    the journal and to the result. The equal-forward-pass comparison subclasses it
    (:class:`benchmarks.helene.smollm2.budget_run.BudgetHooks`).

    Args:
        spec: The run's settings as :func:`build` takes them.
    """

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    @property
    def run_id(self) -> str:
        """The run's name (its files are named after it)."""
        return self.spec.run_id

    def settings(self) -> dict:
        """The settings a journal must match to be replayed (and the result's ``spec``)."""
        return asdict(self.spec)

    def result_path(self) -> Path:
        """Where the finished run's result goes."""
        return result_path(self.spec)

    def partial_path(self) -> Path:
        """Where the journal of the unfinished run goes."""
        return partial_path(PARTIAL, self.spec.run_id)

    def callbacks(self, module, data, recorder: _Recorder, flush: Callable[[], None] | None) -> list:
        """Lightning callbacks to add after the recorder's (``flush`` writes the journal, ``None`` without one).

        Args:
            module: The PeftModule.
            data: Its data module (set up).
            recorder: The run's :class:`_Recorder`.
            flush: Writes the journal now.
        """
        return []

    def resume(self, resumed: dict | None) -> None:
        """Takes back what :meth:`fields` wrote into a journal that is being replayed (``None``: a fresh run).

        Args:
            resumed: The journal, or ``None``.
        """

    def fields(self) -> dict:
        """Fields added to the journal and to the result."""
        return {}


def execute(spec: RunSpec, hooks: RunHooks | None = None) -> dict:
    """Runs ``spec`` and writes its result JSON (returns it).

    A zeroth-order run with a journal on disk (an earlier process was stopped mid-run) replays it and goes on
    from where it stopped; a replay that does not reproduce its validation points starts the run over.

    Args:
        spec: The run.
        hooks: What a study changes about the run (default: the grid's run, :class:`RunHooks`).
    """
    hooks = hooks or RunHooks(spec)
    path = hooks.partial_path()
    resumed = load_partial(path, hooks.settings(), DEVICE) if spec.method in ZO_METHODS else None
    if resumed is not None:
        print(f"resuming {hooks.run_id} at step {len(resumed['steps'])} (replaying its journal)", flush=True)
    try:
        return _execute(spec, resumed, hooks)
    except ReplayMismatch as err:
        print(f"replay of {hooks.run_id} failed ({err}): starting it over", flush=True)
        path.unlink(missing_ok=True)
        return _execute(spec, None, hooks)


def _execute(spec: RunSpec, resumed: dict | None, hooks: RunHooks) -> dict:
    import lightning as L

    L.seed_everything(spec.split_seed, verbose=False)
    started = time.time()
    # The code the run executes is the code at its start (a commit made while it runs is not in it).
    segment = {"commit": _git_commit(), "from_step": len(resumed["steps"]) if resumed else 0, "started": started}
    segments = (resumed["segments"] if resumed else []) + [segment]
    journal = list(resumed["journal"]) if resumed else ([] if spec.method in ZO_METHODS else None)
    path = hooks.partial_path()
    hooks.resume(resumed)
    module, data = build(spec, journal)
    data.setup()

    def flush() -> None:
        if len(journal) != len(recorder.steps):  # they grow together; a mismatch would resume wrongly
            return
        segment["seconds"] = time.time() - started
        _write_json(path, {"spec": hooks.settings(), "run_id": hooks.run_id, "device": DEVICE, "segments": segments,
                           "journal": journal, "steps": recorder.steps, "val": recorder.val, **hooks.fields()})

    recorder = _Recorder(module, resumed, flush if journal is not None else None)
    trainer = _trainer(spec, [recorder.callback, *hooks.callbacks(module, data, recorder,
                                                                   flush if journal is not None else None)])
    trainer.validate(module, datamodule=data, verbose=False)  # step-0 point of the curve
    if spec.steps > 0:
        trainer.fit(module, datamodule=data)
    [test] = trainer.test(module, datamodule=data, verbose=False)
    segment["seconds"] = time.time() - started
    opt = trainer.optimizers[0] if trainer.optimizers else None
    result = {
        "spec": hooks.settings(), "run_id": hooks.run_id, "commit": segments[0]["commit"], "model": MODEL,
        "threads": torch.get_num_threads(), "device": device_name(),
        # The first process's start (journals of commit e4ca7ea have no "started": estimated from the seconds).
        "started": segments[0].get("started", started - sum(s["seconds"] for s in segments[:-1])),
        "seconds": sum(s["seconds"] for s in segments),
        "test_acc": test["test_acc"], "test_loss": test["test_loss"], "n_test": len(data.splits["test"]),
        "label_words": list(data.words), "label_word_ids": data.label_word_ids, "template": data.template,
        "token_lengths": data.token_lengths(), "steps": recorder.steps, "val": recorder.val,
        "nonfinite_steps": module.nonfinite_steps,
        "optimizer": None if opt is None else {"class": type(opt).__name__, **{
            k: v for k, v in opt.param_groups[0].items() if isinstance(v, (int, float, str, tuple))}},
        "trainable": sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        "peak_rss_mib": peak_rss_mib(), "loadavg": os.getloadavg(), **cuda_memory(),
    }
    if journal is not None:
        # Each step's closure values (L+, L−; L0 where needed): the projected gradient c = (L+ − L−)/2ε per step,
        # from which e.g. HELENE's Hessian EMA can be followed (see helene_llm_report).
        result["closure_values"] = journal
    if len(segments) > 1:
        # Resumed: each process's commit, first step and seconds (a replay's seconds are perturbation passes).
        result["segments"] = segments
    result.update(hooks.fields())
    _write_json(hooks.result_path(), result)
    path.unlink(missing_ok=True)
    return result
