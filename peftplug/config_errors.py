"""Settings errors of the ``peftplug`` CLI with the config field they come from.

:func:`condense_argument_error` turns jsonargparse's nested, multi-line parse errors into one line with the field
path; :class:`ConfigFieldInstantiator` builds the configured classes and reports a constructor's ``ValueError`` with
the field it was configured in (``model.peft.init_args.block_size: ...``); :func:`config_field` finds that field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from peftplug.errors import ConfigError, PeftplugError, one_line

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
    """The dotted leaf keys and values of a jsonargparse Namespace (lists of objects as ``key[i].field``), only
    those under ``prefix`` when it is given."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
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


def _named_in(message: str, leaves: dict[str, Any]) -> str | None:
    """The one leaf the message is about: named as an identifier (`` `x` ``, ``x=``, ``x must``) or, failing that,
    quoted by value (``Invalid learning rate: -1.0``); ``None`` when that is not a single leaf."""
    names = set(re.findall(r"`(\w+)`", message)) | set(re.findall(r"\b(\w+)\s*=", message))
    names |= set(re.findall(r"\b(\w+) (?:must|should)\b", message))
    hits = [k for k in leaves if k.rsplit(".", 1)[-1] in names]
    if len(hits) == 1:
        return hits[0]
    tokens = set(re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.])", message))
    hits = [k for k, v in leaves.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and {repr(v), repr(float(v))} & tokens]
    return hits[0] if len(hits) == 1 else None


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
        self._check_learning_rate(built, class_type)
        return built

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


__all__ = ["ConfigFieldInstantiator", "condense_argument_error", "config_field"]
