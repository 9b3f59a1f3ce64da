"""One spelling for the flags of every ``peftplug`` subcommand: words joined by ``_`` (``--max_new_tokens``), as
LightningCLI spells its own (``--ckpt_path``, ``--print_config``, ``--trainer.max_steps``); the hyphenated
spelling (``--max-new-tokens``) is accepted too, as an alias that help does not list.

Imports nothing of the project, so that the method packages' command-line modules may use it.
"""

from __future__ import annotations

import argparse


def underscore_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Shows every long flag of ``parser`` (and its subcommands' parsers) with ``_`` and accepts it with ``-`` too.

    Args:
        parser: A built ``argparse`` parser.

    Returns:
        The same parser.
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases of a subcommand share its parser
                underscore_flags(sub)
            continue
        shown = []
        for option in action.option_strings:
            if not option.startswith("--"):
                shown.append(option)
                continue
            words = option[2:]
            for spelling in ("--" + words.replace("-", "_"), "--" + words.replace("_", "-")):
                parser._option_string_actions.setdefault(spelling, action)
            shown.append("--" + words.replace("-", "_"))
        action.option_strings = list(dict.fromkeys(shown))
    return parser


__all__ = ["underscore_flags"]
