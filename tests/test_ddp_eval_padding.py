"""Validation metrics under DDP/FSDP2 count every example exactly once.

Lightning's own ``DistributedSampler`` pads an evaluation set to a multiple of the number of ranks by repeating its
first rows, and those repeats used to be counted: 5 validation rows on 2 ranks gave the ``val_loss`` of 6 rows (row 0
twice). The evaluation loaders of :class:`peftplug.data.base.TokenizedDataModule` now shard the data themselves,
padding with masked copies of rows (no loss, no answer) that :class:`peftplug.lightning.PeftModule` does not count.

The 2-process runs are real: two processes forked from a fresh interpreter (tests/gloo_ranks.py), set up the way
``torchrun`` launches them (``LOCAL_RANK`` etc. in the environment, one gloo process group), each running
``trainer.validate`` with ``strategy="ddp"`` (and ``ModelParallelStrategy``, FSDP2) and ``devices=2`` for every data
module in turn, so that the processes start once. Their metrics must equal those of one process on the same data,
and the rows the ranks saw must be the split's rows, each once.
"""

from __future__ import annotations

import json
import os
import warnings

import lightning as L
import pytest
import torch
from gloo_ranks import free_port, run_ranks, torchrun_env
from peft import LoraConfig
from torch.utils.data import DistributedSampler

from peftplug.data import CausalLMData, ChatData, TextClassificationData
from peftplug.data.base import RankPaddedRows
from peftplug.lightning import PeftModule
from peftplug.prompt_cls import PromptClassificationData

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CASES = ("causal_lm", "seq_cls", "chat", "prompt_cls", "fsdp2_causal_lm")
ROWS = 5  # validation rows: odd, so that 2 ranks need a padding row


# ------------------------------------------------------------------------------------------------ the data
def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _chat_answer(root) -> str:
    """What the seeded chat model answers to row 0 greedily: row 0's reference, so that answer accuracy is 1/5 on
    one process and would be 2/6 with row 0 counted twice (the other references never match)."""
    module, data = _case("chat", root)
    data.tokenizer = module.tokenizer
    data.setup()
    batch = data._eval_collate(data.splits["validation"][:1])
    module.eval()
    return module.generate_texts(batch["gen_input_ids"], batch["gen_attention_mask"])[0]


def _write_data(root) -> None:
    """Every case's files under ``root`` (the chat answers after the chat model has answered)."""
    _write(root / "causal.jsonl", [{"prompt": f"{i:02d} plus {i:02d} is", "response": " " + "x" * (1 + 3 * i)}
                                   for i in range(ROWS)])
    _write(root / "cls.jsonl", [{"text": f"film {i} was {'good' if i % 3 else 'bad'}", "label": i % 2}
                                for i in range(ROWS)])
    chat = [{"prompt": f"{i} times {i}?", "response": "zzz"} for i in range(ROWS)]
    _write(root / "chat.jsonl", chat)
    chat[0]["response"] = _chat_answer(root)
    _write(root / "chat.jsonl", chat)
    sst = root / "k-shot" / "SST-2"
    (sst / "16-42").mkdir(parents=True)
    rows = ["sentence\tlabel"] + [f"{'good' if i % 2 else 'bad'} movie {i}\t{i % 2}" for i in range(ROWS)]
    for name in ("16-42/train.tsv", "16-42/dev.tsv", "test.tsv"):
        (sst / name).write_text("\n".join(rows) + "\n")


def _data(name: str, root):
    """The data module of one case, on ``root``'s files."""
    if name in ("causal_lm", "fsdp2_causal_lm"):
        return CausalLMData(train_file=str(root / "causal.jsonl"), validation_file=str(root / "causal.jsonl"),
                            prompt_column="prompt", response_column="response", batch_size=2)
    if name == "seq_cls":
        return TextClassificationData(train_file=str(root / "cls.jsonl"), validation_file=str(root / "cls.jsonl"),
                                      batch_size=2)
    if name == "chat":
        return ChatData(train_file=str(root / "chat.jsonl"), validation_file=str(root / "chat.jsonl"), batch_size=2)
    return PromptClassificationData("sst2", data_dir=str(root), template="{sentence}={answer}",
                                    label_words=["n", "p"], batch_size=2)


def _case(name: str, root):
    """(module, data module) of one case, the module's weights seeded alike in every process."""
    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    if name == "seq_cls":
        module = PeftModule("tiny:bert", task="seq_cls", num_labels=2)
    else:
        module = PeftModule("tiny:llama", task="prompt_cls" if name == "prompt_cls" else "causal_lm", peft=lora,
                            max_new_tokens=6)
    return module, _data(name, root)


class SeenRows(L.Callback):
    """Records the rows each validation batch carries with a label (the unpadded ``input_ids``) and the rest."""

    def __init__(self):
        self.rows, self.padding, self.batches = [], 0, 0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.batches += 1
        labels = batch["labels"]
        real = labels != -100 if labels.dim() == 1 else (labels != -100).any(-1)
        for ids, mask, counted in zip(batch["input_ids"], batch["attention_mask"], real.tolist()):
            if counted:
                self.rows.append(ids[mask.bool()].tolist())
            else:
                self.padding += 1


def _validate(module: PeftModule, data: L.LightningDataModule, name: str, devices: int) -> dict:
    """One case's ``trainer.validate``: metrics and the rows seen by this process."""
    if devices == 1:
        strategy = "auto"
    elif name.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo")
    seen = SeenRows()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[seen])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, datamodule=data, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    sync_warnings = [str(w.message) for w in caught if "sync_dist" in str(w.message)]
    return {"metrics": metrics, "rows": seen.rows, "padding": seen.padding, "batches": seen.batches,
            "sync_warnings": sync_warnings}


def _rank_main(rank: int, root: str, port: int) -> None:
    """One of the two processes: the environment ``torchrun`` would give it, then every case in turn."""
    os.environ.update(torchrun_env(rank, port), OMP_NUM_THREADS="1")
    from pathlib import Path

    # Every model is built before the first run starts the process group: transformers' save_pretrained writes
    # no weights on a rank other than 0 then, and the tiny models are built through it (peftplug.loading).
    cases = {name: _case(name, Path(root)) for name in CASES}
    results = {name: _validate(*cases[name], name, devices=2) for name in CASES}
    torch.save(results, Path(root) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, zygote):
    """(one-process results, [rank 0's, rank 1's] results) of every case (two ranks: tests/gloo_ranks.py)."""
    root = tmp_path_factory.mktemp("ddp_eval")
    _write_data(root)
    single = {name: _validate(*_case(name, root), name, devices=1) for name in CASES if not name.startswith("fsdp2")}
    run_ranks(zygote, _rank_main, (str(root), free_port()))
    return single, [torch.load(root / f"rank{r}.pt") for r in (0, 1)]


# ------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name", CASES)
def test_two_process_validation_equals_one_process(runs, name):
    single, ranks = runs
    reference, ranks = single[name.removeprefix("fsdp2_")], [rank[name] for rank in ranks]
    assert set(reference["metrics"]) >= {"val_loss"}
    for result in ranks:
        assert result["metrics"].keys() == reference["metrics"].keys()
        for key, value in reference["metrics"].items():
            assert result["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # Every rank ran the same number of batches (FSDP2's forward communicates); one row padded the split.
    assert ranks[0]["batches"] == ranks[1]["batches"]
    assert ranks[0]["padding"] + ranks[1]["padding"] == 1
    assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == sorted(reference["rows"])
    assert len(reference["rows"]) == ROWS and reference["padding"] == 0


def test_reduced_metrics_raise_no_sync_dist_warning(runs):
    # The metrics are already reduced across ranks; Lightning (on rank 0) told users to add sync_dist=True to them.
    _, ranks = runs
    assert {name: result["sync_warnings"] for name, result in ranks[0].items() if result["sync_warnings"]} == {}


def test_chat_answer_accuracy_counts_real_answers_only(runs):
    single, ranks = runs
    # Row 0's reference is the model's own answer: 1 of 5. Counting Lightning's repeat of row 0 gave 2 of 6.
    assert single["chat"]["metrics"]["val_acc"] == pytest.approx(1 / ROWS)
    assert ranks[0]["chat"]["metrics"]["val_acc"] == pytest.approx(1 / ROWS)


def _modules(root, tokenizer):
    """Set-up data modules of every kind, on ``root``'s files."""
    modules = [_data(name, root) for name in ("causal_lm", "seq_cls", "chat", "prompt_cls")]
    for data in modules:
        data.tokenizer = tokenizer
        data.setup()
    return modules


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_padded_view_gives_each_row_once_and_masks_the_padding(tmp_path, tokenizer, ranks):
    _write(tmp_path / "causal.jsonl", [{"prompt": f"p{i}", "response": f" r{i}"} for i in range(ROWS)])
    _write(tmp_path / "cls.jsonl", [{"text": f"t{i}", "label": i % 2} for i in range(ROWS)])
    _write(tmp_path / "chat.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(ROWS)])
    sst = tmp_path / "k-shot" / "SST-2" / "16-42"
    sst.mkdir(parents=True)
    for name in ("train.tsv", "dev.tsv", "../test.tsv"):
        (sst / name).write_text("sentence\tlabel\n" + "".join(f"s{i}\t{i % 2}\n" for i in range(ROWS)))
    for data in _modules(tmp_path, tokenizer):
        rows = data.splits["validation"]
        view = RankPaddedRows(rows, ranks, data.padding_row)
        assert len(view) % ranks == 0 and 0 <= len(view) - len(rows) < ranks
        shards = [list(DistributedSampler(view, ranks, r, shuffle=False)) for r in range(ranks)]
        assert len({len(s) for s in shards}) == 1  # the same number of rows, so of batches, on every rank
        assert sorted(i for s in shards for i in s) == list(range(len(view)))  # no repeat left to Lightning
        for index in range(len(view)):
            row = view[index]
            if index < len(rows):
                assert row is rows[index]
                continue
            original = rows[index % len(rows)]
            assert row["input_ids"] == original["input_ids"]  # a copy of the shape of a real row
            labels = row["labels"]
            assert labels == -100 if isinstance(labels, int) else labels == [-100] * len(original["labels"])
            if isinstance(data, ChatData):
                assert row["answer_text"] is None and original["answer_text"] is not None
        # A batch of padding alone collates (the chat answers None, which accuracy skips).
        padding = [view[i] for i in range(len(rows), len(view))] or [data.padding_row(rows[0])]
        collate = data._eval_collate if isinstance(data, ChatData) else data.collate
        batch = collate(padding)
        assert (batch["labels"] == -100).all()
        if isinstance(data, ChatData):
            assert batch["gen_answers"] == [None] * len(padding)


def test_one_process_loaders_are_unchanged(tmp_path, tokenizer):
    _write(tmp_path / "causal.jsonl", [{"prompt": f"p{i}", "response": f" r{i}"} for i in range(ROWS)])
    data = _data("causal_lm", tmp_path)
    data.tokenizer = tokenizer
    data.setup()
    loader = data.val_dataloader()
    assert loader.dataset is data.splits["validation"] and not isinstance(loader.sampler, DistributedSampler)
    assert sum(len(b["input_ids"]) for b in loader) == ROWS


# ------------------------------------------------------------------------------------------------ FSDP2 checkpoints
def test_fsdp2_fit_with_distributed_checkpoints_is_refused_before_training(tmp_path, run_fresh):
    """``save_distributed_checkpoint: true`` (Lightning's default) would write checkpoint folders that peftplug
    cannot resume or export: a fit is refused in one line before any step; ``validate`` writes none and runs.

    In a fresh process: a process group started here (even a 1-rank one) keeps its store's port listening after
    ``destroy_process_group``, and a later multi-process run of this session could then fail with EADDRINUSE."""
    _write(tmp_path / "causal.jsonl", [{"prompt": f"p{i}", "response": f" r{i}"} for i in range(ROWS)])
    out = run_fresh(f"""
        from pathlib import Path

        import lightning as L
        import torch
        from lightning.pytorch.strategies import ModelParallelStrategy
        from peft import LoraConfig

        from peftplug.data import CausalLMData
        from peftplug.errors import ConfigError
        from peftplug.lightning import PeftModule

        root = Path({str(tmp_path)!r})
        torch.manual_seed(0)
        module = PeftModule("tiny:llama", task="causal_lm", peft=LoraConfig(r=4, target_modules=["q_proj"]))
        data = CausalLMData(train_file=str(root / "causal.jsonl"), validation_file=str(root / "causal.jsonl"),
                            prompt_column="prompt", response_column="response", batch_size=2)

        def trainer():
            strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1,
                                             process_group_backend="gloo")
            return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)

        print("VALIDATED", "val_loss" in trainer().validate(module, datamodule=data, verbose=False)[0])
        try:
            trainer().fit(module, datamodule=data)
        except ConfigError as err:
            print("REFUSED", repr(str(err)))
        print("STEP", module.global_step, "CKPTS", len(list(root.rglob("*.ckpt"))))
    """).stdout
    assert "VALIDATED True" in out, out
    refused = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert "\\n" not in refused and "save_distributed_checkpoint: false" in refused, refused
    assert "STEP 0 CKPTS 0" in out, out
