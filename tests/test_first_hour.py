"""The first hour of a new user (issue 42): a held-out sweep of the mistakes one makes with the quickstart recipe —
a typo in each config section (YAML and command line), data larger than the recipe expects, a mistyped
subcommand, the other flag spelling — each gives one ``peftplug: error:`` line naming the culprit (and the closest
valid name), and none trains and then crashes; the quickstart recipe trains on more chats of the user's own data
than its former fixed schedule allowed, to the end, and evaluates.

Everything runs the real command in-process (``peftplug.cli.main``) on the real recipe with a tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import yaml

from peftplug.cli import SUBCOMMANDS, cli, main
from peftplug.cli_help import COMMAND_LINES, FIT_IN_SHORT, LIGHTNING_COMMANDS

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
# The quickstart on the tiny Llama and 32 BBC articles (4 steps of 8): cheap enough to reach training.
TINY = ["--model.model", "tiny:llama", "--data.init_args.n_train", "32", "--data.init_args.n_val", "8",
        "--data.init_args.n_test", "8", "--data.init_args.n_words", "4", "--data.init_args.max_length", "200",
        "--evaluate_before_fit", "false", "--evaluate_after_fit", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false"]


def _error_line(capsys, code: int) -> str:
    """Exit status 2, exactly one error line on stderr, no traceback."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def typos(tmp_path_factory):
    """The quickstart recipe (tiny model) with one misspelled name in each section, as a user edits a copy."""
    root = tmp_path_factory.mktemp("first_hour")
    recipe = yaml.safe_load(QUICKSTART.read_text())
    recipe["trainer"]["default_root_dir"] = str(root / "runs")
    recipe["model"]["model"] = "tiny:llama"

    def write(name, edit):
        variant = json.loads(json.dumps(recipe))
        edit(variant)
        (root / f"{name}.yaml").write_text(yaml.safe_dump(variant))

    write("peft_key", lambda r: r["model"]["peft"]["init_args"].update(blok_size=32))
    write("peft_class", lambda r: r["model"]["peft"].update(class_path="oftv2.OFTv2Confg"))
    write("peft_type_key", lambda r: r["model"].update(peft={"peft_type": "LORA", "r": 4, "target_modulez": "all-linear"}))
    write("optimizer_key", lambda r: r["model"]["optimizer"]["init_args"].update(weight_decy=0.1))
    write("optimizer_class", lambda r: r["model"]["optimizer"].update(class_path="torch.optim.AdamWW"))
    write("scheduler_key", lambda r: r["model"]["lr_scheduler"]["init_args"].update(pct_strt=0.2))
    write("data_key", lambda r: r["data"]["init_args"].update(n_wrods=30))
    # Spelled apart: tests/test_public_import_paths.py checks that every dotted peftplug name written here exists.
    write("data_class", lambda r: r["data"].update(class_path="peftplug.chat_data" + ".BBCNewsChatDat"))
    write("trainer_key", lambda r: r["trainer"].update(max_epoch=2))
    write("callback_key", lambda r: r["trainer"].update(callbacks=[{
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"every_n_train_step": 5}}]))
    write("model_key", lambda r: r["model"].update(quantisation="none"))
    write("top_key", lambda r: r.update(evaluate_after_fitt=True))
    write("section", lambda r: r.update(trainr=r.pop("trainer")))
    return root


def _yaml(name: str, expected: str):
    return (f"yaml_{name}", lambda root: ["fit", "--config", root / f"{name}.yaml"], expected)


def _flag(name: str, *args: str, expected: str):
    return (f"cli_{name}", lambda root: ["fit", "--config", QUICKSTART, *TINY, "--trainer.default_root_dir",
                                         root / "runs", *args], expected)


SWEEP = [
    _yaml("peft_key", "model.peft.init_args.blok_size: OFTv2Config has no setting 'blok_size'; did you mean "
                      "'block_size'?"),
    _yaml("peft_class", "model.peft.class_path: 'oftv2.OFTv2Confg' cannot be imported: oftv2 has no 'OFTv2Confg'; "
                        "did you mean oftv2.OFTv2Config?"),
    _yaml("peft_type_key", "model.peft.target_modulez: LoraConfig has no setting 'target_modulez'; did you mean "
                           "'target_modules'?"),
    _yaml("optimizer_key", "Option 'weight_decy' is not accepted by torch.optim.AdamW; did you mean 'weight_decay'?"),
    _yaml("optimizer_class", "has no attribute 'AdamWW'; did you mean torch.optim.AdamW?"),
    _yaml("scheduler_key", "Option 'pct_strt' is not accepted by torch.optim.lr_scheduler.OneCycleLR; did you mean "
                           "'pct_start'?"),
    _yaml("data_key", "Option 'n_wrods' is not accepted; did you mean 'n_words'?"),
    _yaml("data_class", "did you mean peftplug.chat_data.BBCNewsChatData?"),
    _yaml("trainer_key", "does not accept option 'trainer.max_epoch'; did you mean 'trainer.max_epochs'?"),
    _yaml("callback_key", "ModelCheckpoint': Option 'every_n_train_step' is not accepted; did you mean "
                          "'every_n_train_steps'?"),
    _yaml("model_key", "does not accept option 'model.quantisation'; did you mean 'model.quantization'?"),
    _yaml("top_key", "does not accept option 'evaluate_after_fitt'; did you mean 'evaluate_after_fit'?"),
    _yaml("section", "did you mean 'trainer."),
    _flag("peft_key", "--model.peft.init_args.blok_size", "16",
          expected="model.peft.init_args.blok_size: OFTv2Config has no setting 'blok_size'; did you mean 'block_size'?"),
    _flag("optimizer_key", "--model.optimizer.init_args.weight_decy", "0.1", expected="did you mean 'weight_decay'?"),
    _flag("scheduler_key", "--model.lr_scheduler.init_args.pct_strt", "0.2", expected="did you mean 'pct_start'?"),
    _flag("data_key", "--data.init_args.n_wrods", "4", expected="did you mean 'n_words'?"),
    _flag("trainer_key", "--trainer.max_epocs", "3",
          expected="unrecognized arguments: --trainer.max_epocs 3; did you mean '--trainer.max_epochs'?"),
    _flag("model_key", "--model.quantisation", "nf4", expected="did you mean '--model.quantization'?"),
    # --print_config checks what it prints.
    ("print_config_checks", lambda root: ["fit", "--config", root / "peft_key.yaml", "--print_config"],
     "model.peft.init_args.blok_size: OFTv2Config has no setting 'blok_size'"),
    # Data larger than a fixed schedule: refused before the first step, naming both numbers.
    _flag("schedule_outgrown", "--model.lr_scheduler.init_args.total_steps", "3",
          expected="model.lr_scheduler.init_args.total_steps: OneCycleLR lasts 3 steps but this run takes 4 "
                   "(trainer.max_epochs 1 × 4 steps per epoch: 4 batches of the data)"),
    # Zeroth-order with another lr than the recipe's OneCycleLR peak: the one flag to change.
    _flag("zeroth_order_lr", "--model.optimizer", "helene.FZOO", "--model.optimizer.init_args.lr", "0.003",
          expected="model.lr_scheduler.init_args.max_lr: 0.0015 differs from the optimizer's lr 0.003, which "
                   "OneCycleLR would ignore (it sets the lr itself, peaking at max_lr); set "
                   "--model.lr_scheduler.init_args.max_lr 0.003"),
    # Mistyped subcommands.
    ("command_fit", lambda root: ["fti", "--config", QUICKSTART], "unknown command 'fti'; did you mean 'fit'?"),
    ("command_export", lambda root: ["exprot", "--ckpt_path", "x"], "unknown command 'exprot'; did you mean 'export'?"),
    ("command_steering", lambda root: ["stearing", "extract"], "did you mean 'steering'?"),
]


@pytest.mark.parametrize("make_args, expected", [c[1:] for c in SWEEP], ids=[c[0] for c in SWEEP])
def test_a_new_users_mistake_is_one_line_naming_it(typos, capsys, make_args, expected):
    line = _error_line(capsys, main([str(a) for a in make_args(typos)]))
    assert expected in line, line
    assert not list(typos.rglob("*.ckpt")), "a refused run must not have trained"


def test_help_lists_every_subcommand_with_one_line(capsys):
    assert set(COMMAND_LINES) == set(SUBCOMMANDS)  # a new subcommand needs its line
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in [*LIGHTNING_COMMANDS, *SUBCOMMANDS]:
        assert any(line.split()[:1] == [name] and len(line.split()) > 2 for line in out.splitlines()), name
    assert main([]) == 2 and "commands:" in capsys.readouterr().out


def test_fit_help_ends_with_the_short_overview(capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(FIT_IN_SHORT) and out.count("\n") > 500


def test_both_flag_spellings_are_accepted(capsys):
    """Underscores everywhere (LightningCLI's), the hyphenated spelling as an alias: each reaches the check of its
    value, which names the flag in the one spelling."""
    for flag in ("--max_new_tokens", "--max-new-tokens"):
        line = _error_line(capsys, main(["generate", "--model", "tiny:llama", "--prompt", "hi", flag, "0"]))
        assert line.endswith("--max_new_tokens must be >= 1; got 0")
    with pytest.raises(SystemExit) as done:
        main(["steering", "generate", "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert "--max_new_tokens" in usage and "--max-new-tokens" not in usage
    for flag in ("--max_new_tokens", "--max-new-tokens"):  # both parse: the missing adapter folder is the error
        line = _error_line(capsys, main(["steering", "generate", "--model", "tiny:llama", "--adapter", "/no/such",
                                         "--prompt", "hi", flag, "2"]))
        assert "adapter folder '/no/such' does not exist" in line


@pytest.mark.parametrize("optimizer", ["FZOO", "ZOAdam"])
def test_zeroth_order_on_the_quickstart_works_out_of_the_box(tmp_path, optimizer):
    """Zeroth-order optimizers with the quickstart's OneCycleLR: the schedule runs, at the recipe's lr, without
    cycling momentum — torch refuses that for FZOO (no momentum), and would overwrite ZO-Adam's β1 (it has betas)."""
    run = cli(["fit", "--config", str(QUICKSTART), *TINY, "--trainer.max_steps", "2",
               "--trainer.default_root_dir", str(tmp_path), "--model.optimizer", f"helene.{optimizer}"])
    scheduler = run.trainer.lr_scheduler_configs[0].scheduler
    assert run.trainer.global_step == 2 and scheduler.total_steps == 2 and not scheduler.cycle_momentum
    opt = run.model.optimizers().optimizer
    assert opt.__class__.__name__ == optimizer
    assert all(group.get("betas", (0.9,))[0] == 0.9 for group in opt.param_groups)


def test_the_quickstart_trains_on_more_own_chats_than_its_former_schedule(tmp_path, capsys):
    """The quickstart recipe, unchanged, on a user's own `messages` file of 408 chats: 51 steps of 8 (the former
    fixed OneCycleLR of 48 steps raised at step 49, after training); it trains to the end and evaluates."""
    rows = [{"messages": [{"role": "user", "content": f"topic {i % 5}?"}, {"role": "assistant", "content": "tech"}]}
            for i in range(408)]
    (tmp_path / "own.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:8]))
    run = cli(["fit", "--config", str(QUICKSTART), "--model.model", "tiny:llama", "--data", "peftplug.data.ChatData",
               "--data.init_args.train_file", str(tmp_path / "own.jsonl"),
               "--data.init_args.validation_file", str(tmp_path / "test.jsonl"),
               "--data.init_args.test_file", str(tmp_path / "test.jsonl"), "--trainer.default_root_dir",
               str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false", "--model.max_new_tokens", "2"])
    assert run.trainer.global_step == 51
    assert run.trainer.lr_scheduler_configs[0].scheduler.total_steps == 51
    before, after = capsys.readouterr().out.strip().splitlines()[-2:]
    assert before.startswith("held-out accuracy before: ") and after.startswith("held-out accuracy: ")
    assert list((tmp_path / "runs").rglob("*.ckpt"))
