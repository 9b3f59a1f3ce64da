"""What ``peftplug --help`` shows: every subcommand with one line, the hint for a mistyped one, and the short
overview printed after LightningCLI's (very long) ``peftplug fit --help``.

Kept free of heavy imports: ``peftplug --help`` answers without loading Lightning.
"""

from __future__ import annotations

from peftplug.config_names import closest

# LightningCLI's subcommands, in its order.
LIGHTNING_COMMANDS: dict[str, str] = {
    "fit": "train from a recipe: peftplug fit --config R.yaml (--print_config shows the resolved config)",
    "validate": "run the validation loop of a recipe (--ckpt_path C: on a trained checkpoint)",
    "test": "test on the held-out split (--ckpt_path C)",
    "predict": "predict with a recipe's model (class ids, or generated text for LMs)",
}

# One line per subcommand of peftplug.cli.SUBCOMMANDS (a test checks that both tables name the same commands).
COMMAND_LINES: dict[str, str] = {
    "export": "write a checkpoint's adapter as a PEFT adapter folder (--merge: a merged model; --as_lora: as LoRA)",
    "generate": "answer prompts with a checkpoint's adapter (or a bare --model)",
    "chat": "chat interactively with a checkpoint's adapter (or a bare --model)",
    "steering": "steering vectors: extract, generate, evaluate, import-easyedit, export-easyedit, export-gguf",
    "pct": "prompt transfer (PCT): train-sources, decompose, export",
    "kshot": "write LM-BFF k-shot data folders from the hub copies (network once), for data.source: folder",
}

FIT_IN_SHORT = """\
peftplug fit, in short (every option is listed above; these are the ones recipes set):
  --config R.yaml                     a recipe (recipes/); several merge left to right
  --print_config                      print the resolved config (names and types checked) and exit
  --trainer.max_epochs N | --trainer.max_steps N
                                      the run's length (LR schedules with a null length follow it)
  --trainer.accelerator cpu|gpu --trainer.devices N
  --model.model NAME                  a local folder, tiny:<family>, smollm2-135m-instruct, a hub id
  --model.peft CLASS --model.peft.init_args.KEY V
                                      the adapter: oftv2.OFTv2Config, peft.LoraConfig, ... (null: full finetuning)
  --model.optimizer CLASS --model.optimizer.init_args.lr V
                                      torch.optim.AdamW, helene.FZOO, helene.ZOSGD, ...
  --model.lr_scheduler CLASS | null
  --data CLASS --data.init_args.train_file F
                                      peftplug.data.ChatData, peftplug.data.CausalLMData, ...
  --ckpt_path C | last                resume a run
  --evaluate_before_fit true --evaluate_after_fit true
                                      test on the held-out split before and after training
One class's options: --model.peft.help oftv2.OFTv2Config (or --model.optimizer.help, --data.help). docs/cli.md.
Then: peftplug export | generate | chat --ckpt_path C (every command: peftplug --help)."""


def commands(extra: dict[str, str]) -> dict[str, str]:
    """Every subcommand with its line: LightningCLI's, then ``extra`` (peftplug's own, as in ``SUBCOMMANDS``).

    Args:
        extra: The further subcommands' names (their lines come from :data:`COMMAND_LINES`).
    """
    return {**LIGHTNING_COMMANDS, **{name: COMMAND_LINES.get(name, "") for name in extra}}


def overview(extra: dict[str, str]) -> str:
    """The text of ``peftplug --help``.

    Args:
        extra: peftplug's own subcommands (``peftplug.cli.SUBCOMMANDS``).
    """
    table = commands(extra)
    width = max(map(len, table))
    lines = [
        "usage: peftplug COMMAND [options]   (peftplug COMMAND --help: its options)",
        "",
        "Train and use PEFT adapters (OFTv2, QOFT, LoRA, ...; zeroth-order optimizers; PCT; steering vectors).",
        "",
        "commands:",
        *(f"  {name:<{width}}  {line}" for name, line in table.items()),
        "",
        "Flags are spelled with underscores (--max_new_tokens); the hyphenated spelling is accepted too.",
        "--debug anywhere (or PEFTPLUG_DEBUG=1) adds the traceback to an error line.",
        "Start: peftplug fit --config recipes/quickstart.yaml   (docs/cli.md)",
    ]
    return "\n".join(lines)


def unknown_command(name: str, extra: dict[str, str]) -> str:
    """The error line for a subcommand that does not exist, with the closest one.

    Args:
        name: What was typed.
        extra: peftplug's own subcommands.
    """
    table = commands(extra)
    best = closest(name, table)
    suggestion = f"did you mean {best!r}? " if best else ""
    return f"unknown command {name!r}; {suggestion}commands: {', '.join(table)} (peftplug --help)"


__all__ = ["COMMAND_LINES", "FIT_IN_SHORT", "LIGHTNING_COMMANDS", "commands", "overview", "unknown_command"]
