"""The ``peftplug`` command: a LightningCLI (``fit``, ``validate``, ``test``, ``predict``) plus the subcommands of
:data:`SUBCOMMANDS` (``export``, ``steering``, ``generate``, ``chat``).

Examples::

    peftplug fit --config recipes/quickstart.yaml
    peftplug fit --config recipes/quickstart.yaml --print_config
    peftplug export --ckpt_path runs/quickstart/.../last.ckpt --output adapter/ [--merge]   # peftplug.export_cli
    peftplug steering ...            # delegated to steering.cli

Errors caused by input (a wrong setting, path, data file, checkpoint) print as one line ``peftplug: error: ...``
and exit with status 2; ``--debug`` (anywhere on the line) or ``PEFTPLUG_DEBUG=1`` adds the traceback. Settings
that fail while the config is turned into objects (a ``PeftConfig``'s validation, an optimizer's argument checks,
a layer that rejects its adapter settings) are reported with the config field they come from, e.g.
``model.peft.init_args.neumann_terms: ...``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from peftplug.cli_help import FIT_IN_SHORT, LIGHTNING_COMMANDS, overview, unknown_command
from peftplug.config_errors import (  # condense_argument_error, config_field: re-exported, their historical home
    ConfigFieldInstantiator,
    _exception_chain,
    _section_of,
    check_root_dir,
    class_path_error,
    condense_argument_error,
    config_field,
    config_paths,
    explain_bare_class_name,
    read_yaml_mapping,
    required_hint,
)
from peftplug.config_names import (
    check_init_args,
    check_peft_spec,
    check_peft_type_of_class,
    given_peft_class_path,
    import_class,
    suggest,
)
from peftplug.errors import ConfigError, PeftplugError, one_line, run_command

# Recipes may name the method packages' configs and optimizers by class_path: they are imported (their PEFT types
# registered) before parsing. `METHOD_PACKAGES` and `import_method_packages` are re-exported here, their historical
# home, through `__getattr__` below: importing them imports PEFT (seconds), which `peftplug --help` does not need.
_LAZY_EXPORTS = {"METHOD_PACKAGES": "peftplug.methods", "import_method_packages": "peftplug.methods"}


def __getattr__(name: str) -> Any:
    """The re-exports of :data:`_LAZY_EXPORTS`, imported on first use."""
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

DEFAULT_ROOT_DIR = "runs"

# Subcommands besides LightningCLI's, as "module:function" taking the arguments after the subcommand and returning
# the exit status. Imported only when used, so that a missing one says so in one line and `--help` stays fast.
SUBCOMMANDS: dict[str, str] = {
    "export": "peftplug.export_cli:export_main",
    "steering": "steering.cli:main",
    "generate": "peftplug.generate_cli:generate_main",
    "chat": "peftplug.generate_cli:chat_main",
    "pct": "prompt_transfer.cli:main",
    "kshot": "peftplug.data.lmbff_cli:main",
}


def _peft_type_of(class_path: str) -> str:
    """The ``peft_type`` of a PEFT config class named by its class path (the path itself if unknown).

    Args:
        class_path: E.g. ``"oftv2.OFTv2Config"``.
    """
    try:
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

        cls = import_class(class_path, "model.peft")
    except (ConfigError, ImportError):  # (a bad path is reported by the config checks; here it is only shown)
        return class_path
    found = next((t for t, c in PEFT_TYPE_TO_CONFIG_MAPPING.items() if c is cls), None)
    return class_path if found is None else str(getattr(found, "value", found))


def _comparable(flat: dict[str, Any]) -> dict[str, Any]:
    """:func:`_flat` model settings with ``model.peft`` in one form: a recipe's ``class_path``/``init_args`` as the
    checkpoint's plain dict (``peft.peft_type``, ``peft.<field>``), so that a replaced adapter is seen.

    Args:
        flat: Flattened model settings.
    """
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key == "peft.class_path":
            out["peft.peft_type"] = _peft_type_of(str(value))
        elif key.startswith("peft.init_args."):
            if key != "peft.init_args.peft_type" or value is not None:  # (None there: set by the class)
                out["peft." + key.removeprefix("peft.init_args.")] = value
        else:
            out[key] = value
    if "peft.peft_type" in out:
        raw = out["peft.peft_type"]
        out["peft.peft_type"] = str(getattr(raw, "value", raw))
    return out


def _flat(section: Any, prefix: str = "") -> dict[str, Any]:
    """A config section (jsonargparse Namespace or dict) as ``{"a.b.c": value}``.

    Args:
        section: The section (``None``: empty).
        prefix: Key prefix of ``section``.
    """
    if section is None:
        return {}
    items = section.as_dict() if hasattr(section, "as_dict") else section
    if not isinstance(items, dict):
        return {prefix.rstrip("."): items}
    flat: dict[str, Any] = {}
    for key, value in items.items():
        if isinstance(value, dict) or hasattr(value, "as_dict"):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _cli_classes():
    """Builds the CLI classes (imports Lightning; kept out of module import so ``--help`` of export is fast)."""
    from jsonargparse import ArgumentError
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
    from lightning.pytorch.utilities import rank_zero_warn

    from peftplug.checkpoint_io import install_atomic_checkpoint_io
    from peftplug.interrupt import GracefulInterrupt
    from peftplug.lightning import PeftModule
    from peftplug.predictions import check_predict_output, check_runs_batches, predict_and_emit
    from peftplug.trainer_checks import check_trainer_settings, check_trainer_values

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
        ``--evaluate_before_fit true`` and ``--evaluate_after_fit true``: it then tests on the held-out split before
        and after training and prints ``held-out <metric> before: <value>`` and ``held-out <metric>: <value>``
        as the last lines.
        """

        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("trainer_defaults", {"default_root_dir": DEFAULT_ROOT_DIR})
            kwargs.setdefault("save_config_callback", SafeSaveConfigCallback)
            kwargs.setdefault("save_config_kwargs", {"overwrite": True})
            # Parse errors raise (instead of printing usage and exiting) so that they become one ConfigError line.
            kwargs["parser_kwargs"] = {"exit_on_error": False, **(kwargs.get("parser_kwargs") or {})}
            # Only the subcommand named first gets a parser: each costs ~0.1 s of signature introspection (Trainer,
            # PeftModule, data module), and a run uses one. `peftplug --help` or an unknown name builds all four.
            args = kwargs.get("args")
            argv = sys.argv[1:] if args is None else args
            everything = type(self).subcommands()
            if kwargs.get("run", True) and isinstance(argv, list) and argv and argv[0] in everything:
                self.subcommands = lambda: {argv[0]: everything[argv[0]]}
            try:
                super().__init__(PeftModule, LightningDataModule, subclass_mode_data=True, **kwargs)
            except ArgumentError as err:  # the misspelled name, if that is it, with the closest valid one
                message = explain_bare_class_name(suggest(condense_argument_error(str(err)), *self._names()))
                raise ConfigError(required_hint(message, argv if isinstance(argv, list) else [])) from err

        def _names(self) -> tuple[list[str], list[str]]:
            """The setting keys and option strings of the parser and its subcommands' (for suggestions)."""
            parsers = [getattr(self, "parser", None)]
            action = getattr(parsers[0], "_subcommands_action", None)
            parsers += list(getattr(action, "_name_parser_map", {}).values())
            actions = [a for p in parsers if p is not None for a in p._actions]
            return [a.dest for a in actions], [o for a in actions for o in a.option_strings]

        def _parse_ckpt_path(self) -> None:
            """Checks ``--ckpt_path`` before Lightning reads the hyperparameters from it.

            Lightning's own loads use ``weights_only=True``; the allowlist of peftplug checkpoints is registered so
            that they (and resuming from them) accept exactly what our checkpoints hold.
            """
            import torch

            from peftplug.checkpoints import (
                check_resumable,
                find_best_checkpoint,
                read_checkpoint,
                safe_globals,
            )
            from peftplug.resume import find_last_checkpoint

            torch.serialization.add_safe_globals(safe_globals())
            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if ckpt_path in ("last", "best"):
                # Lightning's "last" looks only in the new logger version's (empty) folder, and its "best" only at
                # the trainer that has just run fit (none, in a process of its own): find them in the run's files.
                root = self.config[subcommand].trainer.get("default_root_dir") or DEFAULT_ROOT_DIR
                find = find_last_checkpoint if ckpt_path == "last" else find_best_checkpoint
                ckpt_path = str(find(root))
                self.config[subcommand].ckpt_path = ckpt_path
                print(f"peftplug: {'resuming from' if subcommand == 'fit' else 'checkpoint'} {ckpt_path}",
                      file=sys.stderr, flush=True)
            if ckpt_path:  # "hpc"/"registry" too: no such file here, one line
                checkpoint = read_checkpoint(ckpt_path, mmap=True)
                if subcommand == "fit":
                    check_resumable(checkpoint, ckpt_path)
                if self.config[subcommand].get("weights_only", False) is None:
                    self.config[subcommand].weights_only = True  # what read_checkpoint just loaded it with
            before = _comparable(_flat(self.config[subcommand].get("model"))) if subcommand else {}
            super()._parse_ckpt_path()
            # Lightning's convention: the checkpoint's model settings replace the config's, so that the recipe alone
            # resumes a run that had --model.* flags. A setting that the checkpoint changes is said, not silent.
            after = _comparable(_flat(self.config[subcommand].get("model"))) if subcommand else {}
            changed = [f"model.{k}: {before[k]!r} -> {after[k]!r}" for k in sorted(before)
                       if k in after and before[k] != after[k] and before[k] is not None]
            if changed:
                shown = "; ".join(changed[:6]) + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
                print(f"peftplug: --ckpt_path: the checkpoint's model settings replace the config's: {shown}",
                      file=sys.stderr, flush=True)

        def parse_arguments(self, parser: Any, args: Any) -> None:
            """Parses the arguments, remembering the command-line ones for :meth:`before_instantiate_classes`.

            Args:
                parser: The parser.
                args: Arguments (a list), or a dict/Namespace of settings.
            """
            self.given_args = list(sys.argv[1:] if args is None else args if isinstance(args, (list, tuple)) else [])
            printing = [a for a in self.given_args if a.split("=", 1)[0] == "--print_config"]
            if printing:
                # jsonargparse prints before it validates: parse and check without the flag first, so that what
                # --print_config prints is a valid config (a template without required settings still prints).
                try:
                    self._parse(parser, [a for a in self.given_args if a not in printing])
                except ArgumentError as err:
                    if "required" not in str(err):
                        raise
                else:
                    self.subcommand = self.config.get("subcommand")  # what LightningCLI sets after parsing
                    self._check_peft()
            self._parse(parser, args)
            self.subcommand = self.config.get("subcommand")  # (LightningCLI sets it after this; seeds before the check)
            check_trainer_values(*(self._get(self.config, k, default=None) for k in ("trainer", "seed_everything")))

        def _parse(self, parser: Any, args: Any) -> None:
            """LightningCLI's parsing; a class path that cannot be imported is one line naming its field.

            jsonargparse reports most of them as an ``ArgumentError``, but one that replaces the class of an earlier
            config (a second ``--config``, ``--model.peft.class_path X`` over a recipe's) fails inside its merge as
            a bare ``ValueError``/``AttributeError``/``ImportError``.
            """
            try:
                super().parse_arguments(parser, args)
            except (ValueError, AttributeError, ImportError) as err:
                if isinstance(err, PeftplugError):
                    raise
                given = self.given_args
                culprit = class_path_error(given, [read_yaml_mapping(p) for p in config_paths(given)])
                if culprit is None:
                    raise
                raise culprit from err

        def _check_peft(self) -> None:
            """Reports a misspelled key in ``model.peft`` (YAML or command line) or an override whose value does
            not fit the field's type, in one line naming it.

            ``model.peft`` is typed ``PeftConfig | dict | None``: when the value fails the PEFT config class,
            jsonargparse falls back to ``dict`` — the recipe's dict with the typo in it, or, for a command-line
            ``--model.peft.init_args.X V``, ``{X: V}`` with the class_path dropped.
            """
            model = self._get(self.config, "model", default=None)
            peft = model.get("peft") if model is not None else None
            given = getattr(self, "given_args", [])
            overridden = any(a.startswith("--model.peft.init_args.") for a in given)
            if overridden and isinstance(peft, dict) and peft and not {"class_path", "peft_type"} & set(peft):
                key, value = next(iter(peft.items()))
                class_path = given_peft_class_path(given)
                if class_path:
                    check_init_args(import_class(class_path, "model.peft.class_path"), [key], "model.peft.init_args")
                raise ConfigError(f"model.peft.init_args.{key}: {value!r} does not fit the type of this field of "
                                  "the PEFT config class")
            check_peft_spec(peft)
            check_peft_type_of_class(peft.as_dict() if hasattr(peft, "as_dict") else peft)

        def before_instantiate_classes(self) -> None:
            """Builds every configured class except model and data (Lightning's) through ConfigFieldInstantiator;
            first refuses a ``trainer.default_root_dir`` that cannot be written (before the model loads)."""
            self._check_peft()
            section = self.subcommand
            config = (lambda: self.config[section]) if section else (lambda: self.config)
            check_root_dir(self._get(config(), "trainer", default=None), DEFAULT_ROOT_DIR)
            self.parser.add_instantiator(ConfigFieldInstantiator(config), object, subclasses=True)

        def instantiate_classes(self) -> None:
            """Instantiates model, data and trainer; a settings error names its config field.

            A ``ValueError`` (or ``MisconfigurationException``) raised while the config is turned into objects is a
            settings error: the message gets the field it is about (``model.peft.init_args.block_size: ...``).
            A :class:`PeftplugError` raised inside (maybe wrapped by jsonargparse's union handling) keeps its own
            message.
            """
            from lightning.fabric.utilities.exceptions import MisconfigurationException

            try:
                super().instantiate_classes()
            except (ValueError, MisconfigurationException) as err:
                ours = next((e for e in _exception_chain(err) if isinstance(e, PeftplugError)), None)
                if ours is err:
                    raise
                if ours is not None:
                    raise ours  # keeps its own cause (the constructor's error) for --debug
                message = str(err)
                config = self.config[self.subcommand] if self.subcommand else self.config
                field = config_field(config, message, _section_of(err) or "")
                raise ConfigError(f"{field}: {one_line(message)}" if field else one_line(message)) from err

        def add_arguments_to_parser(self, parser: Any) -> None:
            """Adds ``--evaluate_before_fit`` and ``--evaluate_after_fit``.

            Args:
                parser: The subcommand parser.
            """
            parser.add_argument(
                "--evaluate_before_fit", type=bool, default=False,
                help="Before fit, test on the held-out split (the untrained adapter: zero-shot for most adapters); "
                     "printed as 'held-out <metric> before: <value>' next to the after-fit line.",
            )
            parser.add_argument(
                "--evaluate_after_fit", type=bool, default=False,
                help="After fit, test on the held-out split and print 'held-out <metric>: <value>' last.",
            )
            parser.add_argument(
                "--predictions_file", type=str | None, default=None,
                help="predict: write the predictions to this file (JSON Lines, atomically) instead of stdout.",
            )

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            """Checks the device settings, adds a Rich progress bar (unless the config has one or disables it) and
            :class:`peftplug.interrupt.GracefulInterrupt`, and makes checkpoint writes atomic.

            Args:
                **kwargs: Passed to the Trainer.
            """
            config = self._get(self.config_init, "trainer", default={}) or {}
            check_trainer_settings(*(config.get(k, d) for k, d in (
                ("accelerator", "auto"), ("strategy", "auto"), ("devices", "auto"), ("max_steps", -1),
                ("max_epochs", None), ("num_nodes", None))))
            callbacks = config.get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            if config.get("enable_progress_bar", True) is not False and not any(
                isinstance(c, ProgressBar) for c in callbacks
            ):
                callbacks.append(RichProgressBar())
            if not any(isinstance(c, GracefulInterrupt) for c in callbacks):
                callbacks.append(GracefulInterrupt())
            trainer = super().instantiate_trainer(callbacks=callbacks, **kwargs)
            install_atomic_checkpoint_io(trainer)
            return trainer

        def interrupted_by(self) -> int | None:
            """The signal that stopped ``fit`` at a batch boundary (a checkpoint was written), or ``None``."""
            trainer = getattr(self, "trainer", None)
            stops = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, GracefulInterrupt)]
            return next((c.signal_received for c in stops if c.signal_received is not None), None)

        @staticmethod
        def _held_out_line(result: tuple[str, float | None], when: str = "") -> str:
            """The printed line of a held-out result from :meth:`_held_out` (``when``: ``" before"`` or empty)."""
            name, value = result
            if value is None:
                return f"held-out evaluation{when}: 0 examples counted (no held-out row has a target token)"
            return f"held-out {name}{when}: {value:.3f}"

        def _held_out(self) -> tuple[str, float | None] | None:
            """Tests on the held-out split; ``(metric name, value)`` on rank 0, else ``None``."""
            results = self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
            if not self.trainer.is_global_zero or not results:
                return None
            metrics = results[0]
            if "test_acc" in metrics:
                return "accuracy", float(metrics["test_acc"])
            if "test_ppl" in metrics:
                return "perplexity", float(metrics["test_ppl"])
            if "test_loss" not in metrics:
                # PeftModule logs nothing when no example had a target token: say so rather than print nothing.
                return "evaluation", None
            return None

        def before_validate(self) -> None:
            """Refuses a validate that would run no batch (:func:`peftplug.predictions.check_runs_batches`)."""
            check_runs_batches(self.trainer, "validate")

        def before_test(self) -> None:
            """Refuses a test that would run no batch (:func:`peftplug.predictions.check_runs_batches`)."""
            check_runs_batches(self.trainer, "test")

        def before_predict(self) -> None:
            """Refuses a predict that would run no batch or could not write its predictions, before it runs."""
            check_runs_batches(self.trainer, "predict")
            check_predict_output(self.trainer, self._get(self.config, "predictions_file", default=None))

        def predict(self, **kwargs: Any) -> None:
            """Lightning's predict, whose predictions are then printed or written (:mod:`peftplug.predictions`).

            Args:
                **kwargs: Passed to ``Trainer.predict``.
            """
            path = self._get(self.config, "predictions_file", default=None)
            predict_and_emit(self.trainer, kwargs, self.datamodule, path)

        def before_fit(self) -> None:
            """Tests on the held-out split first when ``--evaluate_before_fit`` is set (reported after fit)."""
            self._before = None
            if self._get(self.config, "evaluate_before_fit", default=False):
                self._before = self._held_out()
                if self._before is not None and not self._get(self.config, "evaluate_after_fit", default=False):
                    print(self._held_out_line(self._before, " before"), flush=True)

        def after_fit(self) -> None:
            """Tests on the held-out split and prints the metric when ``--evaluate_after_fit`` is set; with
            ``--evaluate_before_fit`` the line before it gives the value measured before training."""
            if not self._get(self.config, "evaluate_after_fit", default=False) or self.interrupted_by() is not None:
                return  # an interrupted run is evaluated when it has finished
            after = self._held_out()
            before = getattr(self, "_before", None)
            if before is not None:
                print(self._held_out_line(before, " before"), flush=True)
            if after is not None:
                print(self._held_out_line(after), flush=True)

    return PeftCLI


def cli(args: Sequence[str] | None = None, run: bool = True, **kwargs: Any) -> Any:
    """Builds (and by default runs) the LightningCLI.

    Args:
        args: Command-line arguments (default: ``sys.argv[1:]``), e.g. ``["fit", "--config", "r.yaml"]``.
        run: Run the subcommand; with ``False`` only parse and instantiate (``args`` then has no subcommand).
        **kwargs: Passed to ``LightningCLI``.
    """
    from peftplug.methods import import_method_packages

    import_method_packages()
    # jsonargparse passes an empty LoftQConfig for LoraConfig.loftq_config, which makes PEFT warn needlessly.
    warnings.filterwarnings("ignore", message=".*loftq_config.*")
    # main() always passes the arguments explicitly, which LightningCLI warns about when sys.argv also has some.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file "Loading weights" bars would bury the training progress bar
    return _cli_classes()(args=list(args) if args is not None else None, run=run, **kwargs)


def check_config_files(argv: Sequence[str]) -> None:
    """Refuses a ``--config`` file that is not a YAML mapping (a checkpoint, a binary file, a list) or is another
    program's recipe (prompt transfer's multi-source ``sources:``), naming it.

    jsonargparse reports a missing file itself; a binary one ends in a ``UnicodeDecodeError`` traceback there.

    Args:
        argv: The LightningCLI arguments.
    """
    import yaml

    for name in config_paths(argv):
        path = Path(name).expanduser()
        if path.is_dir():
            raise ConfigError(f"--config {name!r} is a directory; expected a YAML recipe file")
        if not path.is_file():
            continue
        try:
            content = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"--config {name!r} is not a text file (byte {err.object[err.start]:#04x} at offset "
                              f"{err.start}); expected a YAML recipe") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"--config {name!r} is not valid YAML{where} "
                              f"({getattr(err, 'problem', None) or one_line(err, 160)})") from None
        if content is not None and not isinstance(content, dict):
            raise ConfigError(f"--config {name!r} holds a YAML {type(content).__name__}; expected a recipe mapping "
                              "(trainer:, model:, data:)")
        if isinstance(content, dict) and "sources" in content and "data" not in content:
            raise ConfigError(f"--config {name!r} is a multi-source prompt-transfer recipe (it lists `sources:`), "
                              f"not a `peftplug {argv[0] if argv else 'fit'}` recipe; run it with "
                              f"`peftplug pct train-sources --config {name}`")


def lightning_main(argv: Sequence[str]) -> int:
    """LightningCLI's subcommands (``fit``, ``validate``, ``test``, ``predict``).

    Lightning's ``MisconfigurationException`` (e.g. a monitor that is never logged) is a settings error wherever
    it is raised, so it is reported as a :class:`ConfigError`. A run stopped by Ctrl-C or SIGTERM (``fit``: at a
    batch boundary, with a checkpoint, :mod:`peftplug.interrupt`) or aborted by one returns ``128 + signal number``.

    Args:
        argv: The arguments, starting with the subcommand.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from peftplug.interrupt import abort_status
    from peftplug.predictions import check_predictions_flag

    check_config_files(argv)
    check_predictions_flag(argv)  # fit/validate/test would ignore it
    try:
        done = cli(argv)
    except MisconfigurationException as err:
        raise ConfigError(one_line(err)) from err
    except SystemExit as done_help:
        if (aborted := abort_status(done_help)) is not None:  # Lightning's exit(1) after Ctrl-C: 130 (SIGTERM: 143)
            return aborted
        if argv[:1] == ["fit"] and {"-h", "--help"} & set(argv) and done_help.code in (0, None):
            print(f"\n{FIT_IN_SHORT}", flush=True)  # the last screen of a 1,400-line help: what recipes set
        raise
    signum = done.interrupted_by() if argv and argv[0] == "fit" else None
    # The shell's convention for a run ended by a signal (130 for Ctrl-C, 143 for SIGTERM): scripts see that
    # it did not finish, although it stopped cleanly and can resume.
    return 0 if signum is None else 128 + int(signum)


def subcommand(name: str) -> Callable[[list[str]], int]:
    """The function of one of :data:`SUBCOMMANDS`, imported now.

    Args:
        name: A key of :data:`SUBCOMMANDS`.

    Raises:
        ConfigError: If the module providing it is not installed (yet).
    """
    module_name, _, function = SUBCOMMANDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:  # the module exists but one of its own imports is missing: a real failure
            raise
        raise ConfigError(f"`peftplug {name}` is not available: {module_name} is not installed") from None
    return getattr(module, function)


def dispatch(argv: list[str]) -> int:
    """Runs the subcommand named by ``argv[0]``: one of :data:`SUBCOMMANDS`, else LightningCLI's; none or
    ``--help`` prints every subcommand with one line (:mod:`peftplug.cli_help`), an unknown one is an error line
    with the closest name.

    Args:
        argv: Arguments without the program name.
    """
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(SUBCOMMANDS), flush=True)
        return 0 if argv else 2
    if argv[0] in SUBCOMMANDS:
        return int(subcommand(argv[0])(list(argv[1:])) or 0)
    if not argv[0].startswith("-") and argv[0] not in LIGHTNING_COMMANDS:
        raise ConfigError(unknown_command(argv[0], SUBCOMMANDS))
    return lightning_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``peftplug``: every subcommand runs inside one error boundary.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``). ``--debug`` anywhere (or
            ``PEFTPLUG_DEBUG=1``) prints the traceback of an input error too.

    Returns:
        The exit status (0 on success, 2 for an input error, printed as one line ``peftplug: error: ...``).
    """
    return run_command("peftplug", dispatch, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
