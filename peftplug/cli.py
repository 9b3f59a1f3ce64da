"""The ``peftplug`` command: a LightningCLI (``fit``, ``validate``, ``test``, ``predict``) plus ``export`` and
``steering``.

Examples::

    peftplug fit --config recipes/quickstart.yaml
    peftplug fit --config recipes/quickstart.yaml --print_config
    peftplug export --ckpt_path runs/quickstart/.../last.ckpt --output adapter/ [--merge]
    peftplug steering ...            # delegated to peftplug.steering_cli

Errors caused by input (a wrong path, column, setting) print as one line ``peftplug: error: ...`` and exit with
status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Packages whose configs/optimizers recipes may name by class_path; imported when present so that their PEFT
# types are registered before a config or checkpoint refers to them.
METHOD_PACKAGES = ("oftv2", "helene", "prompt_transfer", "steering")
DEFAULT_ROOT_DIR = "runs"


def import_method_packages() -> list[str]:
    """Imports the installed method packages (registering their PEFT types); returns the names imported."""
    imported = []
    for name in METHOD_PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
            imported.append(name)
        except ImportError as err:  # an optional dependency of that method is missing: others still work
            warnings.warn(f"peftplug: method package {name!r} could not be imported ({err})", stacklevel=2)
    return imported


def _cli_classes():
    """Builds the CLI classes (imports Lightning; kept out of module import so ``--help`` of export is fast)."""
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
    from lightning.pytorch.utilities import rank_zero_warn

    from peftplug.lightning import PeftModule

    class SafeSaveConfigCallback(SaveConfigCallback):
        """Saves the resolved config into the run's log directory, never over one of the input configs."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            target = (Path(trainer.log_dir or ".") / self.config_filename).resolve()
            inputs = [Path(str(getattr(c, "absolute", c))).resolve() for c in (self.config.get("config") or [])]
            if target in inputs:
                rank_zero_warn(f"not saving the resolved config: {target} is an input config")
                self.already_saved = True
            super().setup(trainer, pl_module, stage)

    class PeftCLI(LightningCLI):
        """LightningCLI over :class:`PeftModule` and any LightningDataModule, with peftplug's defaults.

        Defaults: ``trainer.default_root_dir=runs`` (so the resolved config never lands in the working directory),
        a Rich progress bar, Lightning's default logger (TensorBoard when installed, else CSV). ``fit`` accepts
        ``--evaluate_after_fit true``: it then tests on the held-out split and prints ``held-out <metric>: <value>``
        as the last line.
        """

        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("trainer_defaults", {"default_root_dir": DEFAULT_ROOT_DIR})
            kwargs.setdefault("save_config_callback", SafeSaveConfigCallback)
            kwargs.setdefault("save_config_kwargs", {"overwrite": True})
            super().__init__(PeftModule, LightningDataModule, subclass_mode_data=True, **kwargs)

        def add_arguments_to_parser(self, parser: Any) -> None:
            """Adds ``--evaluate_after_fit``.

            Args:
                parser: The subcommand parser.
            """
            parser.add_argument(
                "--evaluate_after_fit", type=bool, default=False,
                help="After fit, test on the held-out split and print 'held-out <metric>: <value>' last.",
            )

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            """Adds a Rich progress bar unless the config has a progress bar or disables it.

            Args:
                **kwargs: Passed to the Trainer.
            """
            config = self._get(self.config_init, "trainer", default={}) or {}
            callbacks = config.get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            if config.get("enable_progress_bar", True) is not False and not any(
                isinstance(c, ProgressBar) for c in callbacks
            ):
                callbacks.append(RichProgressBar())
            return super().instantiate_trainer(callbacks=callbacks, **kwargs)

        def after_fit(self) -> None:
            """Tests on the held-out split and prints the metric when ``--evaluate_after_fit`` is set."""
            if not self._get(self.config, "evaluate_after_fit", default=False):
                return
            results = self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
            if not self.trainer.is_global_zero or not results:
                return
            metrics = results[0]
            if "test_acc" in metrics:
                print(f"held-out accuracy: {metrics['test_acc']:.3f}", flush=True)
            elif "test_ppl" in metrics:
                print(f"held-out perplexity: {metrics['test_ppl']:.3f}", flush=True)

    return PeftCLI


def cli(args: Sequence[str] | None = None, run: bool = True, **kwargs: Any) -> Any:
    """Builds (and by default runs) the LightningCLI.

    Args:
        args: Command-line arguments (default: ``sys.argv[1:]``), e.g. ``["fit", "--config", "r.yaml"]``.
        run: Run the subcommand; with ``False`` only parse and instantiate (``args`` then has no subcommand).
        **kwargs: Passed to ``LightningCLI``.
    """
    import_method_packages()
    # jsonargparse passes an empty LoftQConfig for LoraConfig.loftq_config, which makes PEFT warn needlessly.
    warnings.filterwarnings("ignore", message=".*loftq_config.*")
    # main() always passes the arguments explicitly, which LightningCLI warns about when sys.argv also has some.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file "Loading weights" bars would bury the training progress bar
    return _cli_classes()(args=list(args) if args is not None else None, run=run, **kwargs)


def export_main(argv: Sequence[str]) -> int:
    """``peftplug export``: writes the adapter (or the merged model) of a peftplug checkpoint.

    Args:
        argv: Arguments after ``export``.
    """
    parser = argparse.ArgumentParser(
        prog="peftplug export",
        description="Write a PEFT adapter directory (default) or a merged full model from a peftplug checkpoint.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by `peftplug fit`")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base (merge_and_unload)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output directory")
    args = parser.parse_args(list(argv))
    from peftplug.checkpoints import load_checkpoint_module

    module = load_checkpoint_module(args.ckpt_path, map_location="cpu")
    path = module.export(args.output, merge=args.merge, overwrite=args.overwrite)
    print(f"wrote {'merged model' if args.merge else 'adapter'} to {path}")
    return 0


def steering_main(argv: Sequence[str]) -> int:
    """``peftplug steering``: delegates to ``peftplug.steering_cli.main``.

    Args:
        argv: Arguments after ``steering``.
    """
    from peftplug.errors import ConfigError

    try:
        module = importlib.import_module("peftplug.steering_cli")
    except ModuleNotFoundError as err:
        if err.name != "peftplug.steering_cli":
            raise
        raise ConfigError("`peftplug steering` is not available: peftplug.steering_cli is not installed") from None
    return int(module.main(list(argv)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``peftplug``.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status (0 on success, 2 for an input error).
    """
    from peftplug.errors import PeftplugError, one_line
    from peftplug.registry import UnregisteredAdapterError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "steering":
            return steering_main(argv[1:])
        if argv and argv[0] == "export":
            return export_main(argv[1:])
        cli(argv)
        return 0
    except (PeftplugError, UnregisteredAdapterError) as err:
        print(f"peftplug: error: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
