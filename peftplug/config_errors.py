"""Settings errors of the ``peftplug`` CLI with the config field they come from.

:func:`condense_argument_error` turns jsonargparse's nested, multi-line parse errors into one line with the field
path; :class:`ConfigFieldInstantiator` builds the configured classes and reports a constructor's ``ValueError`` with
the field it was configured in (``model.peft.init_args.block_size: ...``); :func:`config_field` finds that field.
:func:`explain_bare_class_name` and :func:`class_path_error` name a class path that cannot be imported (``adamw``
for ``torch.optim.AdamW``) with the class meant; :func:`check_root_dir` refuses a run folder that cannot be written.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from peftplug.errors import ConfigError, PeftplugError, one_line
from peftplug.fileio import nearest_existing

# Lines of a jsonargparse error that describe its own machinery, not the user's value.
_JSONARGPARSE_NOISE = re.compile(
    r"^(Given value( type)?:|Subtypes:|Errors:$|Does not validate against any of the Union subtypes$"
    r"|Expected a path but .* either not accessible or invalid$"
    # its list of the forms a subclass value may take, after the real problem
    r"|Not a valid subclass of \w+$|Subclass types expect one of:$|a class path \(str\)$|a dict with(out)? )"
)
# Union alternatives the user did not mean when a value fails (`model.peft` may also be a dict or null).
_UNION_ALTERNATIVE = re.compile(r"^Expected a <class '(NoneType|dict)'>")
# The classes LightningCLI's OptimizerCallable/LRSchedulerCallable fall back to when a recipe names none.
_CALLABLE_BASES = ("torch.optim.Optimizer", "torch.optim.optimizer.Optimizer", "torch.optim.lr_scheduler.LRScheduler",
                   "typing.Union")


def condense_argument_error(message: str) -> str:
    """One line from a (multi-line, nested) jsonargparse error: the field path and the innermost messages.

    ``Parser key "data": ... Problem with given class_path '...CausalLMData': Parser key "batch_size": Expected a
    <class 'int'>. Got value: x`` becomes ``data.init_args.batch_size: expected int. Got value: x``; the dumps of
    the given value and the union's subtypes are dropped.

    Args:
        message: ``str()`` of a ``jsonargparse.ArgumentError``.
    """
    path: list[str] = []
    class_path, class_indent = None, 0
    found: list[str] = []
    for raw in message.splitlines():
        indent = len(raw) - len(raw.lstrip(" -"))
        line = raw.strip()
        line = line[2:].strip() if line.startswith("- ") else line
        if not line or _JSONARGPARSE_NOISE.match(line):
            continue
        if class_path and indent <= class_indent:  # left the block of that class's problem
            class_path = None
        # A callable type (optimizer, scheduler) built from a class: what follows is about its init_args.
        line, callable_class = re.subn(r"^Type \S.* expects a function or a callable class: ", "", line)
        key = re.fullmatch(r'Parser key "([^"]+)":\s*(.*)', line)
        if key:
            path.append(("init_args." if path and (class_path or callable_class) else "") + key.group(1))
            class_path = None
            if not key.group(2):
                continue
            line = key.group(2)
        problem = re.fullmatch(r"Problem with given class_path '([^']+)':", line)
        if problem:
            class_path, class_indent = problem.group(1), indent
            continue
        if class_path:  # the class itself failed (e.g. it cannot be imported): say which
            line = f"class_path {class_path!r}: {line}"
        found.append(line)
    kept = [line for line in found if not _UNION_ALTERNATIVE.match(line)] or found
    text = "; ".join(dict.fromkeys(kept)) or message
    text = re.sub(r"Expected a <class '([\w.]+)'>", r"expected \1", text)
    text = re.sub(r"Expected a typing\.Literal\[(.*?)\]", r"expected one of \1", text)
    dump = re.search(r"\. Got value: Namespace\(class_path='([^']+)'.*", text)
    if dump:  # drop the namespace dump; name the class that refused the option
        refused = text.endswith("not accepted", 0, dump.start())
        if dump.group(1) in _CALLABLE_BASES:  # no class configured: LightningCLI's abstract default took the args
            suffix = f" (no class_path is set for {'.'.join(path) or 'it'})"
        else:
            suffix = f" by {dump.group(1)}" if refused else ""
        text = text[: dump.start()] + suffix
    return f"{'.'.join(path)}: {text}" if path else text


def _exception_chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, then its causes/contexts (each once)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _leaves(config: Any, prefix: str = "") -> dict[str, Any]:
    """The dotted leaf keys and values of a jsonargparse Namespace (lists of objects as ``key[i].field``, dicts as
    ``key.field``), only those under ``prefix`` when it is given."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            # A plain dict: `model.peft` in the dict form, or a class_path config jsonargparse kept as a dict (a value
            # failed the class's types); PEFT's messages name its keys (`r`), which are leaves here too. The dict
            # stays a leaf itself: it may be the (wrong) value of one setting (`betas: {a: 1}`).
            flat[key] = value
            flat.update({f"{key}.{sub}": leaf for sub, leaf in _leaves(value).items()})
            continue
        items = value if isinstance(value, list) and any(hasattr(v, "items") for v in value) else None
        if items is None:
            flat[key] = value
            continue
        for i, item in enumerate(items):
            for sub, leaf in (_leaves(item).items() if hasattr(item, "items") else [("", item)]):
                flat[f"{key}[{i}]" + (f".{sub}" if sub else "")] = leaf
    if not prefix:
        return flat
    return {k: v for k, v in flat.items() if k == prefix or k.startswith((prefix + ".", prefix + "["))}


# How torch's optimizers and schedulers name their arguments in their ValueErrors ("Invalid learning rate: nan").
_TORCH_WORDS = {"learning rate": "lr", "epsilon value": "eps", "momentum value": "momentum", "beta parameter": "betas",
                "starting multiplicative factor": "start_factor", "ending multiplicative factor": "end_factor"}
_NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?|-?inf|nan"


def _named_in(message: str, leaves: dict[str, Any]) -> str | None:
    """The one leaf the message is about: named as an identifier (`` `x` ``, ``x=``, ``x must``, a leading ``x (`` or
    ``x:``, a snake_case word, torch's words for its arguments) or, failing that, quoted by value (``Invalid learning rate:
    -1.0``; the value after ``got`` first, as a range's bounds are numbers too); ``None`` when that is not a single
    leaf."""
    names = set(re.findall(r"`(\w+)`", message)) | set(re.findall(r"\b(\w+)\s*=", message))
    names |= set(re.findall(r"\b(\w+) (?:must|should)\b", message)) | set(re.findall(r"^(\w+)(?= \(|:)", message))
    # Weaker: any snake_case word, torch's words; only when the identifiers above name no single leaf (a message
    # about block_size may suggest another setting, e.g. exclude_modules).
    weaker = set(re.findall(r"\b([A-Za-z]\w*_\w+)\b", message))
    weaker |= {name for words, name in _TORCH_WORDS.items() if words in message.lower()}
    for tier in (names, weaker):
        tier = {n.lower() for n in tier}
        hits = [k for k in leaves if k.rsplit(".", 1)[-1].lower() in tier]
        if len(hits) == 1:
            return hits[0]
    got = re.search(r"\bgot:? (\S+?)[,;.)]?(?:\s|$)", message)
    for text in ([got.group(1)] if got else []) + [message]:
        tokens = set(re.findall(rf"(?<![\w.])(?:{_NUMBER})(?![\w.])", text))
        hits = [k for k, v in leaves.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and {repr(v), repr(float(v))} & tokens]
        if hits:
            return hits[0] if len(hits) == 1 else None
    return None


def _first_non_finite(kwargs: dict[str, Any]) -> tuple[str, Any] | None:
    """The first keyword argument that is, or holds (``betas``), a NaN or infinite float, as ``(key, value)``."""
    for key, value in kwargs.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            return key, value
    return None


def config_field(config: Any, message: str, section: str = "", class_type: type | None = None) -> str:
    """The config field a settings error is about, as the user writes it (``model.peft.init_args.block_size``).

    Args:
        config: The parsed config (a jsonargparse Namespace of one subcommand).
        message: The error message.
        section: Where the failing object is configured (``"model"``), if known.
        class_type: The class whose constructor failed, if known: its ``class_path`` entry in ``config`` gives
            the section (the optimizer of ``model.optimizer``, the PEFT config of ``model.peft``).

    Returns:
        The most precise field found; at least the section, or ``""`` if nothing is known.
    """
    leaves = _leaves(config, section)
    if class_type is not None:
        for key, value in leaves.items():
            if key.endswith(".class_path") and str(value).rsplit(".", 1)[-1] == class_type.__name__:
                section = key[: -len(".class_path")]
                leaves = _leaves(config, section)
                break
    return _named_in(message, leaves) or section


def _section_of(err: BaseException) -> str | None:
    """``model``, ``data`` or ``trainer``: whose constructor the error came from (outermost on the stack)."""
    from lightning.pytorch import LightningDataModule, LightningModule, Trainer

    kinds = ((LightningModule, "model"), (LightningDataModule, "data"), (Trainer, "trainer"))
    for exc in _exception_chain(err):
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "__init__":
                owner = frame.f_locals.get("self")
                for cls, name in kinds:
                    if isinstance(owner, cls):
                        return name
            tb = tb.tb_next
    return None


class ConfigFieldInstantiator:
    """jsonargparse instantiator of the configured classes (PEFT configs, optimizers, schedulers, callbacks, ...).

    A ``ValueError`` (or Lightning's ``MisconfigurationException``) from a constructor called here is a settings
    error: it is raised again as a :class:`ConfigError` that names the config field. Optimizers and schedulers
    are built through this too (jsonargparse hands the model a partial of it), at ``configure_optimizers`` time.

    Args:
        config: Returns the parsed config of the running subcommand.
    """

    def __init__(self, config: Callable[[], Any]) -> None:
        self.config = config

    def __call__(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
        """Builds ``class_type(*args, **kwargs)``.

        Args:
            class_type: The configured class.
            *args: Positional arguments (e.g. the parameters given to an optimizer).
            **kwargs: The configured ``init_args``.
        """
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            built = class_type(*args, **kwargs)
        except PeftplugError:
            raise
        except (ValueError, MisconfigurationException) as err:
            field = config_field(self.config(), str(err), class_type=class_type)
            raise ConfigError(f"{field or class_type.__name__}: {one_line(err)}") from err
        self._check_finite(class_type, kwargs)  # after: a class's own check of the value says its range
        self._check_learning_rate(built, class_type)
        return built

    def _check_finite(self, class_type: type, kwargs: dict[str, Any]) -> None:
        """Refuses a NaN or infinite argument of an optimizer or LR scheduler: torch checks most of them with
        ``0 <= x``, which ``inf`` passes (``lr``, ``weight_decay``) and NaN's comparisons skip (``start_factor``,
        ``pct_start``); the run then trained with NaN or infinite updates, silently."""
        import torch

        kinds = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        found = _first_non_finite(kwargs) if isinstance(class_type, type) and issubclass(class_type, kinds) else None
        if found is not None:
            key, value = found
            section = config_field(self.config(), "", class_type=class_type) or class_type.__name__
            raise ConfigError(f"{section}.init_args.{key}: {key} must be a finite number, got {value!r}")

    def _check_learning_rate(self, built: Any, class_type: type) -> None:
        """Refuses an optimizer whose learning rate is 0 (torch accepts it; the run would train nothing)."""
        import torch

        if not isinstance(built, torch.optim.Optimizer):
            return
        rates = [g.get("lr") for g in built.param_groups]
        bad = next((lr for lr in rates if isinstance(lr, (int, float)) and lr <= 0), None)
        if bad is not None:
            field = config_field(self.config(), "lr=", class_type=class_type) or class_type.__name__
            field = field if field.endswith(".lr") else f"{field}.init_args.lr"
            raise ConfigError(f"{field} must be > 0; got {bad} (a zero learning rate trains nothing)")


def config_paths(argv: Sequence[str]) -> list[str]:
    """The config files a LightningCLI command line gives, in order: ``--config F``, ``--config=F``, the short
    ``-c F`` / ``-cF`` that its usage line shows, and the abbreviations argparse accepts (``--conf F``).

    Args:
        argv: The LightningCLI arguments.
    """
    def is_config(option: str) -> bool:
        return option == "-c" or (len(option) >= 4 and "--config".startswith(option))

    given = []
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        if eq and is_config(option):
            given.append(value)
        elif not eq and is_config(arg) and i + 1 < len(argv):
            given.append(argv[i + 1])
        elif arg.startswith("-c") and not arg.startswith("--") and len(arg) > 2:
            given.append(arg[2:])
    return given


def read_yaml_mapping(name: str) -> dict:
    """A config file's content when it is a readable YAML mapping, else ``{}`` (for hints only).

    Args:
        name: The file's path.
    """
    import yaml

    try:
        content = yaml.safe_load(Path(name).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return content if isinstance(content, dict) else {}


def required_hint(message: str, argv: Sequence[str]) -> str:
    """Adds to jsonargparse's "the following arguments are required: fit.model.model, fit.data" the settings'
    own names and, when no recipe was given, how to give one.

    Args:
        message: The condensed parse error.
        argv: The LightningCLI arguments.
    """
    found = re.match(r"the following arguments are required: (.*)$", message)
    if not found:
        return message
    names = ", ".join(re.sub(r"^(fit|validate|test|predict)\.", "", n.strip()) for n in found[1].split(","))
    text = f"the following settings are required: {names}"
    if not config_paths(argv):
        text += "; give a recipe with --config R.yaml (e.g. recipes/quickstart.yaml), or set them on the command line"
    return text


def check_root_dir(trainer: Any, default_root: str = "runs") -> None:
    """Refuses a ``trainer.default_root_dir`` that cannot be written, before anything is built or trained.

    Lightning writes the resolved config, logs and checkpoints there (with its default logger, or none); a folder
    without write permission or on a read-only file system was an ``OSError`` traceback from the logger, after the
    model had loaded. A logger configured with its own folder, ``fast_dev_run`` (which writes nothing) and remote
    paths (``s3://``) are left to Lightning.

    Args:
        trainer: The ``trainer`` section of the parsed config (``None``: nothing to check).
        default_root: The folder used when the section sets none (the CLI's default).

    Raises:
        ConfigError: If the folder, or the nearest existing folder above it, cannot be written.
    """
    if trainer is None:
        return
    get = trainer.get if hasattr(trainer, "get") else lambda key, default=None: default
    root = get("default_root_dir") or default_root
    if get("fast_dev_run") or get("logger") not in (None, True, False) or "://" in str(root):
        return
    existing = nearest_existing(str(root))
    if not existing.is_dir():
        raise ConfigError(f"trainer.default_root_dir: {str(root)!r} cannot be created: {str(existing)!r} is a file; "
                          "set --trainer.default_root_dir to a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"trainer.default_root_dir: cannot write in {str(existing)!r} (permissions or a read-only "
                          f"file system), where this run's config, logs and checkpoints go ({str(root)!r}); set "
                          "--trainer.default_root_dir to a writable folder")


# Where a class is looked for when a setting that takes one is given a bare name (`optimizer: adamw`): the modules,
# in the order their classes are suggested, and the base class the suggestions must derive from.
CLASS_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "model.peft": (("peft", "oftv2", "prompt_transfer", "steering"), ("peft.PeftConfig",)),
    "model.optimizer": (("torch.optim", "helene"), ("torch.optim.Optimizer",)),
    "model.lr_scheduler": (("peftplug.schedules", "torch.optim.lr_scheduler"),
                           ("torch.optim.lr_scheduler.LRScheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau")),
    "data": (("peftplug.data",), ("lightning.pytorch.LightningDataModule",)),
    "trainer.callbacks": (("lightning.pytorch.callbacks",), ("lightning.pytorch.callbacks.Callback",)),
    "trainer.logger": (("lightning.pytorch.loggers",), ("lightning.pytorch.loggers.Logger",)),
    "trainer.strategy": (("lightning.pytorch.strategies",), ("lightning.pytorch.strategies.Strategy",)),
}
# Names a user knows a class by that its own name does not contain (the papers' names).
CLASS_ALIASES: dict[str, str] = {"mezo": "helene.ZOSGD", "qoft": "oftv2.OFTv2Config", "qlora": "peft.LoraConfig"}
_BARE_NAME = re.compile(r"^(?P<field>[\w.\[\]]+): Expected a dot import path string: (?P<name>[^;\s]+)")


def _import(dotted: str) -> Any:
    """The module or attribute ``dotted`` names, or ``None`` when it cannot be imported."""
    import importlib

    module_name, _, attr = dotted.rpartition(".")
    for name, rest in ((dotted, None), (module_name, attr)):
        try:
            found = importlib.import_module(name)
        except ImportError:
            continue
        return found if rest is None else getattr(found, rest, None)
    return None


def class_candidates(field: str) -> list[str]:
    """The classes a class-valued setting accepts, as full class paths (``torch.optim.AdamW``).

    Args:
        field: The setting (``model.optimizer``; ``trainer.callbacks[0]`` counts as ``trainer.callbacks``).

    Returns:
        The class paths, each class once, in :data:`CLASS_FIELDS` module order; empty for another field.
    """
    modules, base_names = CLASS_FIELDS.get(re.sub(r"\[\d+\]$", "", field), ((), ()))
    bases = tuple(b for b in map(_import, base_names) if isinstance(b, type))
    found: dict[type, str] = {}
    for module_name in modules:
        module = _import(module_name)
        for name in (sorted(n for n in dir(module) if not n.startswith("_")) if module is not None else []):
            obj = getattr(module, name, None)
            if isinstance(obj, type) and bases and issubclass(obj, bases) and obj not in bases:
                found.setdefault(obj, f"{module_name}.{name}")
    return list(found.values())


def class_hint(field: str, name: str) -> str:
    """``"; did you mean torch.optim.AdamW?"`` for a bare class name given to a class-valued setting.

    The name is compared without case, ``_``/``-`` and a ``Config`` suffix (``lora`` is ``peft.LoraConfig``), then
    as a part of a class name (``cosine``), then by spelling (difflib); without a match, some accepted classes.

    Args:
        field: The setting (``model.optimizer``).
        name: What was given (``adamw``).
    """
    candidates = class_candidates(field)
    if not candidates:
        return ""

    def squash(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.lower())

    short = {c: c.rpartition(".")[2] for c in candidates}
    key = squash(name)
    matches = [c for c in candidates if key in (squash(short[c]), squash(short[c].removesuffix("Config")))
               or CLASS_ALIASES.get(key) == c]
    matches = matches or [c for c in candidates if key and key in squash(short[c])]
    if not matches:
        import difflib

        close = difflib.get_close_matches(key, [squash(s) for s in short.values()], n=3, cutoff=0.6)
        matches = [c for c in candidates if squash(short[c]) in close]
    if matches:
        return f"; did you mean {' or '.join(matches[:4])}?"
    return f"; accepted, e.g.: {', '.join(candidates[:6])}{', ...' if len(candidates) > 6 else ''}"


def explain_bare_class_name(message: str) -> str:
    """Rewrites jsonargparse's ``FIELD: Expected a dot import path string: NAME`` (a class-valued setting given a
    bare name such as ``adamw``) into one line that says what a class path is and suggests the class; other
    messages unchanged.

    Args:
        message: A condensed one-line parse error (:func:`condense_argument_error`).
    """
    found = _BARE_NAME.match(message)
    if not found:
        return message
    return not_a_class_path(found["field"], found["name"])


def not_a_class_path(field: str, name: str, suffix: str = "") -> str:
    """The one line for a bare name given where a class path goes, with :func:`class_hint`'s suggestion.

    Args:
        field: The class-valued setting (``model.optimizer``).
        name: What was given.
        suffix: Appended to ``field`` in the message (``.class_path`` for a ``class_path`` key).
    """
    return f"{field}{suffix}: {name!r} is not a class path (a full module.Class name is expected){class_hint(field, name)}"


def given_class_paths(argv: list[str], configs: list[Any]) -> list[tuple[str, str]]:
    """The class paths a command line and its config files give, as ``(field, class path)``, in the order given.

    Args:
        argv: The arguments of the subcommand (``--model.peft.class_path X``, ``--model.optimizer X``, ...).
        configs: The parsed config files (YAML mappings), in the order given.
    """
    found: list[tuple[str, str]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("class_path"), str):
                found.append((path, node["class_path"]))
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")
        elif isinstance(node, str) and re.sub(r"\[\d+\]$", "", path) in CLASS_FIELDS:
            found.append((path, node))

    for config in configs:
        walk(config, "")
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        if not option.startswith("--") or (not eq and i + 1 >= len(argv)):
            continue
        field = option[2:].removesuffix("+").removesuffix(".class_path")
        value = value if eq else argv[i + 1]
        # A value in YAML form (`--model.peft '{class_path: ...}'`) is left to jsonargparse's own message.
        if (option[2:].endswith(".class_path") or field in CLASS_FIELDS) and not re.search(r"[\s{}\[\]:]", value):
            found.append((field, value))
    return found


def class_path_error(argv: list[str], configs: list[Any]) -> ConfigError | None:
    """The first given class path that cannot be imported, as a one-line error naming its field; ``None`` if all
    can be (a bare name counts when it is a class the field accepts: jsonargparse resolves those).

    Args:
        argv: The arguments of the subcommand.
        configs: The parsed config files.
    """
    from peftplug.config_names import import_class

    for field, class_path in given_class_paths(argv, configs):
        if "." not in class_path:
            if class_path in ("null", "None") or any(c.rpartition(".")[2] == class_path
                                                     for c in class_candidates(field)):
                continue
            return ConfigError(not_a_class_path(field, class_path, ".class_path"))
        try:
            import_class(class_path, f"{field}.class_path")
        except ConfigError as err:
            return err
    return None


__all__ = ["CLASS_ALIASES", "CLASS_FIELDS", "ConfigFieldInstantiator", "check_root_dir", "class_candidates",
           "class_hint", "class_path_error", "condense_argument_error", "config_field", "config_paths", "explain_bare_class_name",
           "given_class_paths", "read_yaml_mapping", "required_hint"]
