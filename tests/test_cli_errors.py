"""Bad input at the command line (issue #17): exit status 2 and one ``<prog>: error:`` line that names the field or
file, no traceback; ``--debug`` / ``PEFTPLUG_DEBUG=1`` add the traceback; other exceptions keep theirs.

Every case runs the real command in-process on tiny models: LightningCLI, jsonargparse, PEFT and torch raise what
they raise for that input, and the test checks what the user sees.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import zipfile
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
import yaml

from peftplug.checkpoints import check_adapter_dir, load_checkpoint_module, read_checkpoint
from peftplug.cli import condense_argument_error, main
from peftplug.errors import CheckpointError, DataError, MissingFileError, run_command

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(12)]


def _recipe(root: Path, peft: dict, **data: str) -> Path:
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 1, "accelerator": "cpu", "devices": 1, "default_root_dir": str(root / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 1,
                    "enable_model_summary": False, "logger": False},
        "model": {"model": "tiny:llama", "peft": peft,
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}},
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(root / "train.jsonl"), "prompt_column": "prompt",
                               "response_column": "response", "batch_size": 4, **data}},
    }
    path = root / f"{peft.get('peft_type') or peft['class_path'].rsplit('.', 1)[-1]}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Recipes, good and bad data files, a real checkpoint from `peftplug fit` and bad checkpoints derived from it."""
    root = tmp_path_factory.mktemp("cli_errors")
    lines = [json.dumps(r) for r in ROWS]
    (root / "train.jsonl").write_text("\n".join(lines))
    (root / "truncated.jsonl").write_text("\n".join(lines[:4] + [lines[4][:15]] + lines[5:]))
    (root / "extra_field.csv").write_text("prompt,response\na,b\nc,d,e\n")
    for name, bad_turns in BAD_CONVERSATIONS.items():  # conversational files whose third row is malformed
        good = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                for i in range(12)]
        good[2] = {"messages": bad_turns}
        (root / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in good))
    lora = _recipe(root, {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"],
                          "init_lora_weights": False})
    oft = _recipe(root, {"class_path": "oftv2.OFTv2Config",
                         "init_args": {"block_size": 8, "target_modules": ["q_proj", "v_proj"]}})
    assert main(["fit", "--config", str(lora)]) == 0
    ckpt = next((root / "runs").rglob("*.ckpt"))

    bad = root / "bad"
    bad.mkdir()
    (bad / "list.yaml").write_text("- trainer\n- model\n")
    (bad / "binary.yaml").write_bytes(b"PK\x03\x04\x00\xff\xfe")
    (bad / "broken.yaml").write_text("trainer: [1,\n model: 2\n")
    (root / "notes").mkdir()
    (root / "notes" / "thesis.tex").write_text("months of work")
    (root / "train.txt").write_text("plain text")
    (bad / "garbage.ckpt").write_text("garbage\n")
    data = ckpt.read_bytes()
    (bad / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    with zipfile.ZipFile(bad / "foreign_zip.ckpt", "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")
    saved = torch.load(ckpt, weights_only=True)
    variants = {
        "not_peftplug.ckpt": lambda c: c.pop("peftplug"),
        "other_rank.ckpt": lambda c: c["hyper_parameters"]["peft"].update(r=8),
        "other_adapter.ckpt": lambda c: c["hyper_parameters"].update(
            peft={"peft_type": "OFTV2", "block_size": 8, "target_modules": ["q_proj", "v_proj"]}),
        "other_model.ckpt": lambda c: c["hyper_parameters"].update(model="tiny:gpt2"),
        "pickled_object.ckpt": lambda c: c["hyper_parameters"].update(extra=zipfile.ZipInfo("x")),
    }
    for name, edit in variants.items():
        variant = copy.deepcopy(saved)
        edit(variant)
        torch.save(variant, bad / name)
    return {"root": root, "lora": lora, "oft": oft, "ckpt": ckpt, "bad": bad}


# Issue 30: malformed rows of a `messages` file (tests/test_chat_messages.py has every case in Python).
BAD_CONVERSATIONS = {
    "unknown_role": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}],
    "no_assistant": [{"role": "user", "content": "q"}],
    "int_content": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}],
    "tool_turn": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"},
                  {"role": "assistant", "content": "a"}],
    "list_content": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                     {"role": "assistant", "content": "a"}],
}


def _chat(name: str):
    """`peftplug fit` with ChatData on one of the malformed conversational files."""
    return lambda f: ["fit", "--config", f["lora"], "--data.class_path", "peftplug.data.ChatData",
                      "--data.init_args.train_file", f["root"] / f"{name}.jsonl",
                      "--data.init_args.validation_file", f["root"] / f"{name}.jsonl"]


def _export_lora_ckpt(*extra: str):
    """`peftplug export` of the fixture's trained LoRA checkpoint with ``extra`` arguments."""
    return lambda f: ["export", "--ckpt_path", f["ckpt"], "--output", f["root"] / "o", *extra]


def _error_line(capsys, code: int, prog: str = "peftplug") -> str:
    """Exit status 2, exactly one error line on stderr, no traceback (warnings and logs may precede it)."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _export(name: str):
    """The arguments of `peftplug export` on one of the bad checkpoints."""
    return lambda f: ["export", "--ckpt_path", f["bad"] / name, "--output", f["root"] / "o"]


# (id, arguments given the files fixture, what the error line must contain)
CASES = [
    ("unknown_model", lambda f: ["fit", "--config", f["lora"], "--model.model", "/no/such/model"],
     "model '/no/such/model' not found"),
    ("unknown_quantization", lambda f: ["fit", "--config", f["lora"], "--model.quantization", "nf3"],
     "quantization must be one of none, nf4, fp4, int8; got 'nf3'"),
    ("unknown_target_modules", lambda f: ["fit", "--config", f["lora"], "--model.peft",
                                          '{"peft_type": "LORA", "target_modules": ["query"]}'],
     "match no module of the model; modules with weights are named: down_proj, embed_tokens"),
    ("missing_data_file", lambda f: ["fit", "--config", f["lora"], "--data.init_args.train_file", "/no/such.jsonl"],
     "data file '/no/such.jsonl' does not exist"),
    ("block_size_not_dividing", lambda f: ["fit", "--config", f["oft"], "--model.peft.init_args.block_size", "7"],
     "model.peft.init_args.block_size: block_size=7 does not divide the input width 64"),
    ("neumann_terms_out_of_range", lambda f: ["fit", "--config", f["oft"], "--model.peft.init_args.neumann_terms",
                                              "0"],
     "model.peft.init_args.neumann_terms: `neumann_terms` must be an integer in [2, 64]"),
    ("block_size_wrong_type", lambda f: ["fit", "--config", f["oft"], "--model.peft.init_args.block_size", "abc"],
     "model.peft.init_args.block_size: 'abc' does not fit the type"),
    ("negative_lr", lambda f: ["fit", "--config", f["lora"], "--model.optimizer.init_args.lr", "-1"],
     "model.optimizer.init_args.lr: Invalid learning rate: -1.0"),
    ("negative_momentum", lambda f: ["fit", "--config", f["lora"], "--model.optimizer", "torch.optim.SGD",
                                     "--model.optimizer.init_args.momentum", "-0.5"],
     "model.optimizer.init_args.momentum: Invalid momentum value: -0.5"),
    ("scheduler_without_class", lambda f: ["fit", "--config", f["lora"], "--model.lr_scheduler.init_args.gamma",
                                           "0.5"],
     "model.lr_scheduler: Option 'gamma' is not accepted (no class_path is set for model.lr_scheduler)"),
    ("scheduler_choice", lambda f: ["fit", "--config", f["lora"], "--model.lr_scheduler",
                                    "torch.optim.lr_scheduler.ReduceLROnPlateau",
                                    "--model.lr_scheduler.init_args.mode", "sideways"],
     "model.lr_scheduler.init_args.mode: expected one of 'min', 'max'. Got value: sideways"),
    ("optimizer_unknown_option", lambda f: ["fit", "--config", f["lora"], "--model.optimizer.init_args.foo", "1"],
     "model.optimizer: Option 'foo' is not accepted by torch.optim.AdamW"),
    ("callback_argument", lambda f: ["fit", "--config", f["lora"], "--trainer.callbacks+=ModelCheckpoint",
                                     "--trainer.callbacks.mode", "sideways"],
     "trainer.callbacks[0].init_args.mode: `mode` can be min, max but got sideways"),
    ("trainer_type", lambda f: ["fit", "--config", f["lora"], "--trainer.max_steps", "many"],
     "trainer.max_steps: expected int. Got value: many"),
    ("data_type", lambda f: ["fit", "--config", f["lora"], "--data.init_args.batch_size", "four"],
     "data.init_args.batch_size: expected int"),
    ("unknown_peft_class", lambda f: ["fit", "--config", f["oft"], "--model.peft", "oftv2.NoSuchConfig"],
     "model.peft: class_path 'oftv2.NoSuchConfig': module 'oftv2' has no attribute 'NoSuchConfig'"),
    ("unknown_key", lambda f: ["fit", "--config", f["lora"], "--model.no_such_key", "1"],
     "unrecognized arguments: --model.no_such_key 1"),
    ("missing_config", lambda f: ["fit", "--config", f["root"] / "no_such.yaml"], "no_such.yaml"),
    ("truncated_jsonl", lambda f: ["fit", "--config", f["lora"], "--data.init_args.train_file",
                                   f["root"] / "truncated.jsonl"],
     "truncated.jsonl': line 5, column 12: not valid JSON"),
    ("csv_extra_field", lambda f: ["fit", "--config", f["lora"], "--data.init_args.train_file",
                                   f["root"] / "extra_field.csv"],
     "extra_field.csv': line 3: 3 fields, the header has 2 (prompt, response)"),
    ("missing_column", lambda f: ["fit", "--config", f["lora"], "--data.init_args.prompt_column", "question"],
     "has no column 'question'; its columns are: prompt, response"),
    ("export_garbage", _export("garbage.ckpt"),
     "garbage.ckpt' is not a PyTorch checkpoint; expected a .ckpt file written by `peftplug fit`"),
    ("export_truncated", _export("truncated.ckpt"),
     "truncated.ckpt' is truncated or damaged"),
    ("export_foreign_zip", _export("foreign_zip.ckpt"),
     "foreign_zip.ckpt' is a zip archive but not a PyTorch checkpoint"),
    ("export_not_peftplug", _export("not_peftplug.ckpt"),
     "not_peftplug.ckpt' is a Lightning checkpoint but not a peftplug adapter checkpoint"),
    ("export_pickled_object", _export("pickled_object.ckpt"),
     "contains Python objects that peftplug does not unpickle (zipfile.ZipInfo)"),
    ("export_other_rank", _export("other_rank.ckpt"),
     ("other_rank.ckpt' (model 'tiny:llama' with adapter LORA): checkpoint does not fit this model/adapter: "
      "shape mismatches")),
    ("export_other_adapter", _export("other_adapter.ckpt"),
     "(model 'tiny:llama' with adapter OFTV2): checkpoint does not fit this model/adapter: unknown keys"),
    ("export_other_model", _export("other_model.ckpt"),
     "(model 'tiny:gpt2' with adapter LORA): peft.target_modules ['q_proj', 'v_proj'] match no module"),
    ("export_directory", lambda f: ["export", "--ckpt_path", f["root"], "--output", f["root"] / "o"],
     "is a directory; expected a .ckpt file"),
    ("fit_resume_from_garbage", lambda f: ["fit", "--config", f["lora"], "--ckpt_path", f["bad"] / "garbage.ckpt"],
     "garbage.ckpt' is not a PyTorch checkpoint"),
    # Issue 29: accelerators, strategies and devices this machine does not have (CPU-only here) ...
    ("accelerator_tpu", lambda f: ["fit", "--config", f["lora"], "--trainer.accelerator", "tpu"],
     "trainer.accelerator: 'tpu' is not available on this machine (it needs a TPU and torch_xla); available: cpu"),
    ("accelerator_mps", lambda f: ["fit", "--config", f["lora"], "--trainer.accelerator", "mps"],
     "trainer.accelerator: 'mps' is not available on this machine (it needs Apple silicon (MPS)); available: cpu"),
    ("accelerator_cuda", lambda f: ["fit", "--config", f["lora"], "--trainer.accelerator", "cuda"],
     "trainer.accelerator: 'cuda' is not available on this machine (no CUDA device is visible); available: cpu"),
    ("accelerator_gpu", lambda f: ["fit", "--config", f["lora"], "--trainer.accelerator", "gpu"],
     "trainer.accelerator: 'gpu' is not available on this machine (it needs CUDA or Apple MPS"),
    ("accelerator_unknown", lambda f: ["fit", "--config", f["lora"], "--trainer.accelerator", "quantum"],
     "trainer.accelerator: 'quantum' is not an accelerator; accepted: auto, gpu, cpu, cuda, mps, tpu"),
    ("strategy_fsdp_on_cpu", lambda f: ["fit", "--config", f["lora"], "--trainer.strategy", "fsdp"],
     ("trainer.strategy: 'fsdp' (Lightning's FSDP strategy) needs CUDA and the accelerator here is cpu; to shard "
     "with FSDP2 use strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy}")),
    ("strategy_deepspeed_missing", lambda f: ["fit", "--config", f["lora"], "--trainer.strategy", "deepspeed"],
     "trainer.strategy: 'deepspeed' needs the deepspeed package, which is not installed"),
    ("strategy_unknown", lambda f: ["fit", "--config", f["lora"], "--trainer.strategy", "teleport"],
     "trainer.strategy: You selected an invalid strategy name: `strategy='teleport'`"),
    ("devices_more_than_cores", lambda f: ["fit", "--config", f["lora"], "--trainer.devices", "4096"],
     "trainer.devices: 4096 requested but this machine has"),
    ("devices_zero", lambda f: ["fit", "--config", f["lora"], "--trainer.devices", "0"],
     "trainer.devices must be >= 1, -1 (all) or 'auto'; got 0"),
    ("devices_indices_on_cpu", lambda f: ["fit", "--config", f["lora"], "--trainer.devices", "[0, 1]"],
     "trainer.devices: [0, 1] are device indices, which the cpu accelerator does not have"),
    # ... sizes that are zero or negative, and a learning rate that trains nothing ...
    ("batch_size_zero", lambda f: ["fit", "--config", f["lora"], "--data.init_args.batch_size", "0"],
     "data.batch_size must be >= 1; got 0"),
    ("eval_batch_size_zero", lambda f: ["fit", "--config", f["lora"], "--data.init_args.eval_batch_size", "0"],
     "data.eval_batch_size must be >= 1 (or null for batch_size); got 0"),
    ("max_length_negative", lambda f: ["fit", "--config", f["lora"], "--data.init_args.max_length", "-3"],
     "data.max_length must be >= 1; got -3"),
    ("val_fraction_outside", lambda f: ["fit", "--config", f["lora"], "--data.init_args.val_fraction", "1.5"],
     "data.val_fraction must be in (0, 1); got 1.5"),
    ("max_steps_zero", lambda f: ["fit", "--config", f["lora"], "--trainer.max_steps", "0"],
     "trainer.max_steps must be >= 1, or -1 for no step limit; got 0"),
    ("max_steps_negative", lambda f: ["fit", "--config", f["lora"], "--trainer.max_steps", "-5"],
     "trainer.max_steps must be >= 1, or -1 for no step limit; got -5"),
    ("max_epochs_zero", lambda f: ["fit", "--config", f["lora"], "--trainer.max_epochs", "0"],
     "trainer.max_epochs must be >= 1, or -1 for no epoch limit; got 0"),
    ("lr_zero", lambda f: ["fit", "--config", f["lora"], "--model.optimizer.init_args.lr", "0"],
     "model.optimizer.init_args.lr must be > 0; got 0.0 (a zero learning rate trains nothing)"),
    # ... missing or foreign files ...
    ("config_is_a_list", lambda f: ["fit", "--config", f["bad"] / "list.yaml"],
     "list.yaml' holds a YAML list; expected a recipe mapping (trainer:, model:, data:)"),
    ("config_is_binary", lambda f: ["fit", "--config", f["bad"] / "binary.yaml"],
     "binary.yaml' is not a text file (byte 0xff at offset 5); expected a YAML recipe"),
    ("config_is_broken_yaml", lambda f: ["fit", "--config", f["bad"] / "broken.yaml"],
     "broken.yaml' is not valid YAML at line 3, column 1"),
    ("config_is_a_folder", lambda f: ["fit", "--config", f["bad"]], "is a directory; expected a YAML recipe file"),
    ("train_file_foreign_extension", lambda f: ["fit", "--config", f["lora"], "--data.init_args.train_file",
                                                f["root"] / "train.txt"],
     "data file 'train.txt': the extension must be one of .json, .jsonl, .csv, .tsv, .parquet"),
    ("fit_resume_missing", lambda f: ["fit", "--config", f["lora"], "--ckpt_path", f["root"] / "none.ckpt"],
     "none.ckpt' does not exist"),
    ("fit_resume_last_without_checkpoints", lambda f: ["fit", "--config", f["lora"], "--ckpt_path", "last",
                                                       "--trainer.default_root_dir", f["root"] / "fresh"],
     "ckpt_path: 'last' found no checkpoint under trainer.default_root_dir"),
    # ... an export onto a folder that holds files (refused before anything is loaded or touched) ...
    ("export_onto_a_file", lambda f: ["export", "--ckpt_path", f["ckpt"], "--output", f["root"] / "train.jsonl"],
     "train.jsonl' is a file; give a folder to write (nothing was touched)"),
    ("export_onto_a_full_folder", lambda f: ["export", "--ckpt_path", f["ckpt"], "--output", f["root"] / "notes"],
     "notes' exists and is not empty; use --overwrite to replace an earlier export"),
    ("export_overwrite_foreign_folder", lambda f: ["export", "--ckpt_path", f["ckpt"], "--output",
                                                   f["root"] / "notes", "--overwrite"],
     ("notes' holds files but is not an adapter or model folder (no adapter_config.json or config.json); "
     "--overwrite replaces only earlier exports (nothing was touched)")),
    # ... and generate / chat with bad arguments.
    ("generate_max_new_tokens_zero", lambda f: ["generate", "--ckpt_path", f["ckpt"], "--prompt", "hi",
                                                "--max_new_tokens", "0"], "--max_new_tokens must be >= 1; got 0"),
    ("generate_negative_temperature", lambda f: ["generate", "--model", "tiny:llama", "--prompt", "hi",
                                                 "--temperature", "-1"],
     "--temperature must be 0 (greedy) or a finite number >= 1e-05 (sampling); got -1.0"),
    ("generate_missing_checkpoint", lambda f: ["generate", "--ckpt_path", f["root"] / "none.ckpt", "--prompt", "hi"],
     "none.ckpt' does not exist"),
    ("generate_unknown_model", lambda f: ["generate", "--model", "/no/such/model", "--prompt", "hi"],
     "model '/no/such/model' not found"),
    ("chat_max_new_tokens_negative", lambda f: ["chat", "--model", "tiny:llama", "--max_new_tokens", "-1"],
     "--max_new_tokens must be >= 1; got -1"),
    # Issue 30: conversational rows that cannot be trained on name their file and row ...
    ("messages_unknown_role", _chat("unknown_role"),
     "unknown_role.jsonl' row 3 (train split): turn 2 has unknown role 'bot'; accepted: system, user, assistant"),
    ("messages_no_assistant", _chat("no_assistant"), "no_assistant.jsonl' row 3 (train split): no assistant turn"),
    ("messages_int_content", _chat("int_content"),
     "int_content.jsonl' row 3 (train split): turn 1's content is int, expected a string"),
    ("messages_tool_turn", _chat("tool_turn"),
     "tool_turn.jsonl' row 3 (train split): turn 2 is a tool turn (role 'tool'): tool turns are not supported"),
    ("messages_list_content", _chat("list_content"),
     "list_content.jsonl' row 3 (train split): turn 1's content is a list (content parts); only string content"),
    # ... and export --as_lora (given here as --as-lora, the accepted alias) refuses what it cannot convert, before
    # writing anything.
    ("export_as_lora_of_lora", _export_lora_ckpt("--as-lora", "--rank", "4"),
     "--as_lora converts OFTv2 adapters only; this checkpoint's adapter is LORA (export it without --as_lora"),
    ("export_as_lora_rank_word", _export_lora_ckpt("--as-lora", "--rank", "big"),
     "--rank must be a positive integer or 'full'; got 'big'"),
    ("export_as_lora_rank_zero", _export_lora_ckpt("--as-lora", "--rank", "0"),
     "--rank must be a positive integer or 'full'; got '0'"),
    ("export_as_lora_without_rank", _export_lora_ckpt("--as-lora"), "--as_lora needs --rank R: a positive integer"),
    ("export_rank_without_as_lora", _export_lora_ckpt("--rank", "8"),
     "--rank is the LoRA rank of --as_lora; add --as_lora (or drop --rank)"),
    ("export_as_lora_with_merge", _export_lora_ckpt("--as-lora", "--rank", "8", "--merge"),
     "--as_lora and --merge exclude each other"),
]


@pytest.mark.parametrize("make_args, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_culprit(files, capsys, make_args, expected):
    line = _error_line(capsys, main([str(a) for a in make_args(files)]))
    assert expected in line, line


def test_refused_export_touches_nothing(files, capsys):
    before = {p: p.read_bytes() for p in (files["root"] / "notes").rglob("*")}
    for extra in ([], ["--overwrite"]):
        _error_line(capsys, main(["export", "--ckpt_path", str(files["ckpt"]), "--output",
                                  str(files["root"] / "notes"), *extra]))
    assert {p: p.read_bytes() for p in (files["root"] / "notes").rglob("*")} == before
    assert not [p for p in files["root"].iterdir() if p.name.startswith(".notes")]  # no staging folder left


def test_argparse_usage_errors_of_generate_exit_2(files, capsys):
    """Missing/conflicting sources are argparse usage errors: status 2 and argparse's own one line."""
    for args in (["generate", "--prompt", "hi"],
                 ["generate", "--model", "tiny:llama", "--ckpt_path", str(files["ckpt"]), "--prompt", "hi"]):
        with pytest.raises(SystemExit) as done:
            main(args)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "peftplug generate: error: " in err and "Traceback" not in err


def test_debug_shows_the_traceback(files, capsys, monkeypatch):
    args = ["export", "--ckpt_path", str(files["bad"] / "garbage.ckpt"), "--output", str(files["root"] / "o")]
    assert main([*args, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "CheckpointError" in err and err.rstrip().splitlines()[-1].startswith(
        "peftplug: error: ")
    monkeypatch.setenv("PEFTPLUG_DEBUG", "1")
    assert main(["fit", "--config", str(files["oft"]), "--model.peft.init_args.neumann_terms", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "__post_init__" in err  # the chain reaches the config's own check


def test_unknown_exceptions_keep_their_traceback():
    def buggy(argv):
        raise ZeroDivisionError("a bug, not an input error")

    with pytest.raises(ZeroDivisionError):
        run_command("peftplug", buggy, [])


def test_output_into_a_closed_pipe_ends_quietly(run_fresh):
    # `peftplug fit --help | head`: the reader leaves while the help is being written. A fresh process, since the
    # boundary points the process's stdout at /dev/null.
    proc = run_fresh("""
        import os, sys
        from peftplug.errors import run_command

        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has gone
        os.dup2(write_end, sys.stdout.fileno())

        def long_help(argv):
            for _ in range(10_000):
                print("option " * 20)

        print("status", run_command("peftplug", long_help, []), file=sys.stderr)
    """)
    assert proc.stderr.strip() == "status 141", proc.stderr


def test_help_and_unavailable_subcommand(capsys, monkeypatch):
    import peftplug.cli as cli_module

    for name in cli_module.SUBCOMMANDS:  # every installed subcommand is reached through the table
        if importlib.util.find_spec(cli_module.SUBCOMMANDS[name].partition(":")[0]) is None:
            continue
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        usage = capsys.readouterr().out.split("\n")[0]  # pct and kshot keep their `python -m` program names
        module = cli_module.SUBCOMMANDS[name].partition(":")[0]
        assert done.value.code == 0 and (f"usage: peftplug {name}" in usage or f"python -m {module}" in usage)

    monkeypatch.setitem(cli_module.SUBCOMMANDS, "dream", "peftplug.no_such_module:main")
    line = _error_line(capsys, main(["dream", "--x"]))
    assert line == "peftplug: error: `peftplug dream` is not available: peftplug.no_such_module is not installed"


# ---------------------------------------------------------------- the Python API raises the same messages
def test_checkpoint_api(files):
    module = load_checkpoint_module(files["ckpt"])
    saved = torch.load(files["ckpt"], weights_only=True)["state_dict"]
    assert saved and all(torch.equal(module.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint"):
        read_checkpoint(files["bad"] / "garbage.ckpt")
    with pytest.raises(MissingFileError, match="does not exist"):
        read_checkpoint(files["root"] / "none.ckpt")


def test_checkpoint_with_peft_enums_loads_weights_only(files, tmp_path):
    """A module built in Python may keep PEFT's TaskType in hyper_parameters: it is on the allowlist."""
    from peft.utils.peft_types import TaskType

    saved = torch.load(files["ckpt"], weights_only=True)
    saved["hyper_parameters"]["peft"]["task_type"] = TaskType.CAUSAL_LM
    torch.save(saved, tmp_path / "enum.ckpt")
    module = load_checkpoint_module(tmp_path / "enum.ckpt")
    assert module.peft_config.task_type == TaskType.CAUSAL_LM


def test_check_adapter_dir(files, tmp_path):
    module = load_checkpoint_module(files["ckpt"])
    good = module.export(tmp_path / "adapter")
    assert check_adapter_dir(good) == good
    weights = (good / "adapter_model.safetensors").read_bytes()
    cases = {
        "no_config": ({"adapter_model.safetensors": weights}, "has no adapter_config.json"),
        "no_weights": ({"adapter_config.json": '{"peft_type": "LORA"}'}, "has no adapter_model.safetensors"),
        "truncated": ({"adapter_config.json": '{"peft_type": "LORA"}',
                       "adapter_model.safetensors": weights[:-10]}, "truncated: the header promises"),
        "header_only": ({"adapter_config.json": '{"peft_type": "LORA"}',
                         "adapter_model.safetensors": weights[:6]}, "shorter than a safetensors header"),
        "bad_json": ({"adapter_config.json": '{"peft_type": ', "adapter_model.safetensors": weights},
                     "is not valid JSON"),
    }
    for name, (content, expected) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        for file, data in content.items():
            (folder / file).write_bytes(data if isinstance(data, bytes) else data.encode())
        with pytest.raises(CheckpointError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            check_adapter_dir(folder)
    with pytest.raises(MissingFileError):
        check_adapter_dir(tmp_path / "missing")


def test_read_table_names_the_bad_line(tmp_path):
    from peftplug.data import read_table

    cases = {
        "rows.jsonl": ('{"a": 1}\n[1, 2]\n', "line 2: expected a JSON object per line, got list"),
        "doc.json": ('[{"a": 1},\n {"a": }]\n', "line 2, column 8: not valid JSON (Expecting value)"),
        # (A .tsv is read as GLUE writes it, a quote being text: tests/test_data_review3_files.py.)
        "quote.csv": ('a,b\n1,"x\n', "the row starting at line 2: unexpected end of data (an unclosed quote?)"),
        "latin.csv": ("a\ncaf\xe9\n", "line 2: not UTF-8 text (byte 0xe9)"),
    }
    for name, (content, expected) in cases.items():
        path = tmp_path / name
        path.write_bytes(content.encode("latin-1"))
        with pytest.raises(DataError) as raised:
            read_table(str(path), ["a"])
        assert str(raised.value) == f"data file {str(path)!r}: {expected}"


def test_read_table_refuses_a_column_named_twice(tmp_path):
    # pandas renames the second copy (response.1) and the first was read, silently.
    from peftplug.data import read_table

    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("prompt\tresponse\tresponse\nhi\ta\tb\n")
    with pytest.raises(DataError) as raised:
        read_table(str(tsv), ["prompt", "response"], text_columns=["response"])
    assert str(raised.value) == (f"data file {str(tsv)!r}: the header names column 'response' 2 times (fields 2, 3); "
                                 "rename or remove the extra ones (only the first would be read)")
    # A repeated column that is not read does not matter.
    csv_file = tmp_path / "notes.csv"
    csv_file.write_text("\ufeffprompt,note,note,response\nhi,x,y,a\n", encoding="utf-8")
    assert read_table(str(csv_file), ["prompt", "response"]) == {"prompt": ["hi"], "response": ["a"]}


def test_steering_adapter_folder_is_checked(files, capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    args = ["steering", "generate", "--model", "tiny:llama", "--adapter", f"{tmp_path / 'empty'}:2", "--prompt",
            "hi", "--max-new-tokens", "2"]
    assert f"adapter folder {str(tmp_path / 'empty')!r} has no adapter_config.json" in _error_line(
        capsys, main(args))


def test_prompt_transfer_cli_errors_are_one_line(files, capsys, tmp_path):
    from prompt_transfer.cli import PROG
    from prompt_transfer.cli import main as pct_main

    module = load_checkpoint_module(files["ckpt"])
    lora = module.export(tmp_path / "lora")
    (tmp_path / "broken").mkdir()
    line = _error_line(capsys, pct_main(["decompose", str(tmp_path / "broken"), "--out", str(tmp_path / "d")]), PROG)
    assert "broken' has no adapter_config.json" in line
    line = _error_line(capsys, pct_main(["decompose", str(lora), "--out", str(tmp_path / "d")]), PROG)
    assert f"source adapter {str(lora)!r}: " in line and "not PROMPT_TUNING/PCT" in line
    line = _error_line(capsys, pct_main(["export", str(lora), str(tmp_path / "plain")]), PROG)
    assert "adapter, not PCT" in line


def test_condense_keeps_the_field_and_drops_the_dumps():
    message = (
        'Parser key "data":\n  Does not validate against any of the Union subtypes\n  Subtypes: [A, B]\n'
        "  Errors:\n    - Problem with given class_path 'peftplug.data.CausalLMData':\n"
        '        Parser key "batch_size":\n          Expected a <class \'int\'>. Got value: x\n'
        "    - Expected a <class 'NoneType'>\n  Given value type: <class 'NestedArg'>\n  Given value: NestedArg(...)"
    )
    assert condense_argument_error(message) == "data.init_args.batch_size: expected int. Got value: x"
