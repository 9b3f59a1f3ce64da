"""Misspelled setting names: one line that names the culprit and the closest valid name (``difflib``).

Used by the CLI for every place a name can be wrong — a key of a section (``trainer.max_step``), an option of a
configured class (an optimizer's, a scheduler's, a data module's ``init_args``), a ``class_path``, a key inside
``model.peft`` (PEFT configs are plain dataclasses: a typo there used to reach the constructor as a ``TypeError``
traceback) — and by :func:`peftplug.loading.build_peft_config` for the Python API.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import inspect
import math
import re
import types
import typing
from collections.abc import Iterable
from typing import Any

from peftplug.errors import ConfigError

#: Keys PEFT writes into every ``adapter_config.json`` besides the config class's own settings.
SAVED_BOOKKEEPING = ("peft_type", "peft_version", "auto_mapping")


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate nearest to ``name`` (difflib's ratio of at least 0.6), or ``None``.

    Args:
        name: The misspelled name.
        candidates: The valid names.
    """
    candidates = list(dict.fromkeys(candidates))
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if not match:  # a dotted key: compare the last part among the keys of the same parent (trainer.max_step)
        head, _, tail = name.rpartition(".")
        same_parent = [c.rpartition(".")[2] for c in candidates if c.rpartition(".")[0] == head]
        match = [f"{head}.{m}" if head else m for m in difflib.get_close_matches(tail, same_parent, n=1, cutoff=0.6)]
    return match[0] if match else None


def hint(name: str, candidates: Iterable[str], listed: int = 0) -> str:
    """``"; did you mean 'x'?"`` for the closest candidate; without one, the first ``listed`` valid names (or
    ``""``).

    Args:
        name: The misspelled name.
        candidates: The valid names.
        listed: How many valid names to list when none is close (0: none).
    """
    candidates = list(candidates)
    best = closest(name, candidates)
    if best is not None:
        return f"; did you mean {best!r}?"
    if listed and candidates:
        more = ", ..." if len(candidates) > listed else ""
        return f"; accepted: {', '.join(candidates[:listed])}{more}"
    return ""


def accepted_names(cls: type) -> list[str]:
    """The keyword arguments a class accepts: a dataclass's init fields (PEFT configs), else its signature's
    named parameters (all of its bases' when it passes ``**kwargs`` on).

    Args:
        cls: The class.
    """
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init]
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def import_class(class_path: str, field: str) -> type:
    """Imports ``module.Class``; a missing module or name is one line naming ``field`` and the closest name.

    Args:
        class_path: Dotted path of the class.
        field: The config field that gave it (``model.peft.class_path``).

    Raises:
        ConfigError: If it cannot be imported.
    """
    module_name, _, name = str(class_path).rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError):
        raise ConfigError(f"{field}: {class_path!r} cannot be imported (no module {module_name!r})") from None
    if not hasattr(module, name):
        public = [n for n in dir(module) if not n.startswith("_") and inspect.isclass(getattr(module, n))]
        found = closest(name, public)
        suggestion = f"; did you mean {module_name}.{found}?" if found else ""
        raise ConfigError(f"{field}: {class_path!r} cannot be imported: {module_name} has no {name!r}{suggestion}")
    return getattr(module, name)


def check_init_args(cls: type, given: Iterable[str], field: str) -> None:
    """Refuses a keyword ``cls`` does not accept, naming it (``field.key``) and the closest accepted one.

    Args:
        cls: The configured class.
        given: The keys given for it.
        field: Where they are configured (``model.peft.init_args``).

    Raises:
        ConfigError: For the first unknown key.
    """
    accepted = accepted_names(cls)
    for key in given:
        if key not in accepted:
            raise ConfigError(f"{field}.{key}: {cls.__name__} has no setting {key!r}{hint(key, accepted, 12)}")


def _fits(value: Any, annotation: Any) -> bool:
    """Whether a YAML/JSON value fits a dataclass field's annotation; types this cannot judge (classes, ``Any``,
    callables) are accepted and left to the config class."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or annotation is None or annotation is type(None):
        return annotation is Any or value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        # PEFT spells some open families as one placeholder ('pissa_niter_[number of iters]'): its prefix counts.
        return value in args or (isinstance(value, str) and any(
            isinstance(a, str) and "[" in a and value.startswith(a.split("[")[0]) for a in args))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, annotation) or value in [m.value for m in annotation]
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        # Any number: PEFT annotates scalars it only divides by as int (lora_alpha: 16.0 works there). What this
        # check is for is a string or a list where a number belongs.
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set, frozenset):
        if not isinstance(value, (list, tuple, set, frozenset)):
            return False
        item = args[0] if args and (origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)) else Any
        return all(_fits(v, item) for v in value)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    return True


def _type_name(annotation: Any) -> str:
    """A readable annotation: ``int``, ``list[str] | str | None``."""
    if isinstance(annotation, type):
        return annotation.__name__
    # Classes by their own names: `Union[PromptTuningInit, str]`, not `peft.tuners.prompt_tuning.config.Prompt...`.
    return re.sub(r"\b(?:[a-z_]\w*\.)+(?=[A-Za-z_]\w*)", "", str(annotation))


def _field_types(cls: type) -> dict[str, Any]:
    """The resolved field annotations of a dataclass; empty for another class or an annotation that does not
    resolve (the checks then leave the values to the class)."""
    if not dataclasses.is_dataclass(cls):
        return {}
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001  (any error of a foreign annotation: the class checks its values itself)
        return {}


def check_init_types(cls: type, values: dict, field: str) -> None:
    """Refuses a value whose type does not fit the dataclass field it sets, in one line naming the field
    (``model.peft.init_args.r``) and its type: PEFT's configs do not check, and a string ``r`` surfaced as a
    ``TypeError`` deep inside the adapter's layers.

    Args:
        cls: The config class (a dataclass; other classes are not checked).
        values: The settings given for it.
        field: Where they are configured (``model.peft.init_args``).

    Raises:
        ConfigError: For the first value that does not fit.
    """
    hints = _field_types(cls)
    if not hints:
        return
    # A null is fine where the field's own default is None, whatever its annotation says (PEFT's token_dim: int = None).
    none_defaults = {f.name for f in dataclasses.fields(cls) if f.default is None}
    for key, value in values.items():
        if value is None and key in none_defaults:
            continue
        if key in hints and not _fits(value, hints[key]):
            raise ConfigError(f"{field}.{key}: expected {_type_name(hints[key])}, got {type(value).__name__} "
                              f"{value!r}")


# PEFT annotates the scales it only divides by as int (lora_alpha, LoHa/LoKr alpha): a float is fine there. Any other
# int field sizes a tensor or counts something: `r: 1.5` or `num_virtual_tokens: .nan` was a TypeError from torch.
_FLOAT_OK_INT_FIELD = re.compile(r"alpha|lambda")
# Enum-valued fields whose strings PEFT compares with the members' values: another string silently took the last
# branch (`prompt_tuning_init: sample_vocab`, lower case, gave a random init). peft_type and task_type are checked
# where the config is built (peftplug.loading), with their own messages.
_CHECKED_ELSEWHERE = ("peft_type", "task_type")


def _enum_class(annotation: Any) -> type[enum.Enum] | None:
    """The Enum class an annotation (or one member of its union) names, else ``None``."""
    for arg in (typing.get_args(annotation) or (annotation,)):
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return arg
    return None


def _wants_int(annotation: Any) -> bool:
    """Whether an annotation takes ``int`` and not ``float`` (``int``, ``int | None``)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = set(args or (annotation,))
    return int in kinds and float not in kinds


def check_init_values(cls: type, values: dict, field: str) -> None:
    """Refuses values of the right type that no PEFT config can use, in one line naming the field and the accepted
    values: PEFT does not check them, and each either failed deep in the layers or trained a wrong adapter silently.
    Classes outside PEFT (``oftv2``, ``prompt_transfer``, ``steering``) are left to their own checks.

    - a NaN or infinite number (``lora_alpha: .inf`` made every LoRA output NaN);
    - a float where an int is annotated (``r: 1.5``), except the ``alpha``/``lambda`` scales PEFT only divides by;
    - a dropout probability outside [0, 1] (PEFT used no dropout for a negative one, silently);
    - ``num_virtual_tokens`` below 1 (a prompt of 0 tokens trains nothing), ``lora_alpha`` 0 (scales the adapter's
      output, and so its gradients, to 0);
    - a string not among the values of an Enum-typed field (``prompt_tuning_init: sample_vocab``).

    Args:
        cls: The config class (a dataclass; other classes are not checked).
        values: The settings given for it.
        field: Where they are configured (``model.peft.init_args``).

    Raises:
        ConfigError: For the first value that cannot be used.
    """
    from peftplug.validation import check_int, check_real

    # Only PEFT's own configs: peftplug's (OFTv2, PCT, steering) check their values themselves, with their ranges.
    if not dataclasses.is_dataclass(cls) or not cls.__module__.startswith("peft."):
        return
    hints = _field_types(cls)
    for key, value in values.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            if number and not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value!r}")
            if isinstance(value, float) and _wants_int(hints.get(key)) and not _FLOAT_OK_INT_FIELD.search(key):
                raise ValueError(f"{key} must be an int, got {value!r}")
            if number and key.endswith(("dropout", "dropout_p")):
                check_real(key, value, 0.0, 1.0, hint="a probability")
            if key == "num_virtual_tokens" and value is not None:
                check_int(key, value, low=1, hint="the soft prompt's length")
            if key == "lora_alpha" and number and value == 0:
                raise ValueError("lora_alpha must not be 0 (it scales the adapter's output: 0 would train nothing)")
            choices = _enum_class(hints.get(key)) if key not in _CHECKED_ELSEWHERE else None
            if choices is not None and isinstance(value, str) and not isinstance(value, enum.Enum):
                accepted = [str(m.value) for m in choices]
                if value not in accepted:
                    same = [a for a in accepted if a.lower() == value.lower()]  # PEFT compares case-sensitively
                    suggestion = f"; did you mean {same[0]!r}?" if same else hint(value, accepted)
                    raise ValueError(f"{key} must be one of {', '.join(map(repr, accepted))}, got {value!r}"
                                     f"{suggestion}")
        except ValueError as err:
            raise ConfigError(f"{field}.{key}: {err}") from None


def check_peft_spec(spec: Any, field: str = "model.peft") -> None:
    """Checks the names in a ``model.peft`` dict: the ``class_path`` and its ``init_args`` keys, or the
    ``peft_type`` config's keys (an ``adapter_config.json``'s bookkeeping keys are allowed).

    Args:
        spec: The ``model.peft`` value (anything but a dict is left alone).
        field: The config field, for messages.

    Raises:
        ConfigError: For a class that cannot be imported, a key its config class does not have, or a value that
            does not fit its field's type or that no config can use (:func:`check_init_values`).
    """
    if hasattr(spec, "as_dict") and not isinstance(spec, dict):
        # A class_path config that jsonargparse parsed (a Namespace): it checked the names and types, not the values.
        spec = spec.as_dict()
        if isinstance(spec.get("class_path"), str):
            cls = import_class(spec["class_path"], f"{field}.class_path")
            check_init_values(cls, dict(spec.get("init_args") or {}), f"{field}.init_args")
        return
    if not isinstance(spec, dict):
        return
    if "class_path" in spec:
        cls = import_class(spec["class_path"], f"{field}.class_path")
        unknown = set(spec) - {"class_path", "init_args", "dict_kwargs"}
        if unknown:
            raise ConfigError(f"{field}.{min(unknown)}: a class_path config takes its settings under init_args")
        init_args = dict(spec.get("init_args") or {})
        for check in (check_init_args, check_init_types, check_init_values):
            check(cls, init_args, f"{field}.init_args")
    elif "peft_type" in spec:
        from peftplug.methods import peft_config_classes

        raw = spec["peft_type"]
        peft_type = str(getattr(raw, "value", raw)).upper()
        # With the plugin imported first: the builder imports it right after this check, so without it the check
        # skipped an OFTV2 dict and a typo reached the constructor as a TypeError traceback.
        known = peft_config_classes(peft_type)
        # With peft_version the dict was written by PEFT (an adapter_config.json): a key only another PEFT release
        # has is not a typo; it is dropped with a warning where the config is built (saved_config_extras), as PEFT's
        # own loading does. Only a hand-written dict's keys are checked here.
        if peft_type in known and not spec.get("peft_version"):
            settings = {k: v for k, v in spec.items() if k not in SAVED_BOOKKEEPING}
            for check in (check_init_args, check_init_types, check_init_values):
                check(known[peft_type], settings, field)


def _public_path(cls: type) -> str:
    """``cls``'s shortest import path: ``peft.LoraConfig``, ``oftv2.OFTv2Config`` (else its module's)."""
    top = cls.__module__.split(".")[0]
    package = importlib.import_module(top)
    return f"{top}.{cls.__name__}" if getattr(package, cls.__name__, None) is cls else f"{cls.__module__}.{cls.__name__}"


def check_peft_type_of_class(spec: Any, field: str = "model.peft") -> None:
    """Refuses a ``peft_type`` among a ``class_path`` config's ``init_args`` that is not that class's type.

    A dict given on the command line (``--model.peft '{"peft_type": "LORA", "r": 4}'``) over a recipe whose
    ``model.peft`` has a ``class_path`` is merged into that class's ``init_args`` by jsonargparse, and every PEFT
    config class sets its own type in ``__post_init__``: the run trained the recipe's adapter (OFTv2 with r=4,
    16M parameters) while the user asked for LoRA, silently.

    Args:
        spec: The ``model.peft`` value as a dict (anything without ``class_path`` is left alone).
        field: The config field, for messages.

    Raises:
        ConfigError: If ``init_args.peft_type`` names a known type whose config class is not the ``class_path``'s.
    """
    if not isinstance(spec, dict) or "class_path" not in spec:
        return
    raw = (spec.get("init_args") or {}).get("peft_type")
    if raw is None:
        return
    from peftplug.methods import peft_config_classes

    wanted = str(getattr(raw, "value", raw)).upper()
    known = peft_config_classes(wanted)
    cls = import_class(spec["class_path"], f"{field}.class_path")
    if wanted not in known:
        raise ConfigError(f"{field}.init_args.peft_type: unknown type {wanted!r}{hint(wanted, known)}")
    if issubclass(cls, known[wanted]):
        return
    target = _public_path(known[wanted])
    raise ConfigError(
        f"{field}: peft_type {wanted!r} was given to {spec['class_path']} (a dict on the command line is merged into "
        f"the recipe's class_path config, which would train that adapter instead); to switch adapters name the "
        f"class: --model.peft {target} --model.peft.init_args.<setting> <value> ..."
    )


def saved_config_extras(cls: type, spec: dict) -> list[str]:
    """The keys of a PEFT-saved config dict (one with ``peft_version``) that the installed ``cls`` does not have:
    settings of another PEFT release, which ``PeftConfig.from_pretrained`` drops with a warning. ``[]`` for a dict
    without ``peft_version`` (written by hand: an unknown key there is a typo).

    Args:
        cls: The PEFT config class of the dict's ``peft_type``.
        spec: The dict.
    """
    if not spec.get("peft_version"):
        return []
    accepted = set(accepted_names(cls)) | set(SAVED_BOOKKEEPING)
    return sorted(k for k in spec if k not in accepted)


# Messages (as condensed by peftplug.cli.condense_argument_error) about a name that does not exist.
_OPTION = re.compile(r"Option '([^']+)' is not accepted(?: by ([\w.]+))?")
_CLASS_OF = re.compile(r"class_path '([\w.]+)'")
_KEY = re.compile(r"(?:Subcommand '\w+' does not accept option|Key) '([^']+)'")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (--[\w.\-]+)")
_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")


def suggest(message: str, keys: Iterable[str] = (), options: Iterable[str] = ()) -> str:
    """Adds the closest valid name to a parse error about a name that does not exist; other messages unchanged.

    Args:
        message: The one-line error.
        keys: The parser's setting keys (``trainer.max_steps``), for unknown keys in a config file.
        options: The parser's option strings (``--trainer.max_steps``), for unknown command-line flags.
    """
    def after(found: re.Match, text: str) -> str:  # right after the culprit: the rest of a long line may be cut
        return message[: found.end()] + text + message[found.end():]

    found = _OPTION.search(message)
    if found:
        class_path = found.group(2) or next(iter(_CLASS_OF.findall(message[: found.start()])[-1:]), None)
        try:
            cls = import_class(class_path, "") if class_path else None
        except ConfigError:
            cls = None
        return after(found, hint(found.group(1), accepted_names(cls), 12) if cls is not None else "")
    found = _KEY.search(message)
    if found:
        return after(found, hint(found.group(1), [k for k in keys if not k.endswith(".help")]))
    found = _UNRECOGNIZED.search(message)
    if found:
        return message + hint(found.group(1), [o for o in options if o.startswith("--") and not o.endswith(".help")])
    found = _NO_ATTRIBUTE.search(message)
    if found:
        try:
            module = importlib.import_module(found.group(1))
        except ImportError:
            return message
        best = closest(found.group(2), [n for n in dir(module) if not n.startswith("_")])
        return after(found, f"; did you mean {found.group(1)}.{best}?" if best else "")
    return message


__all__ = ["SAVED_BOOKKEEPING", "accepted_names", "check_init_args", "check_init_values", "check_peft_spec", "closest",
           "given_peft_class_path", "hint", "import_class", "saved_config_extras", "suggest"]


def given_peft_class_path(argv: Iterable[str]) -> str | None:
    """The PEFT config class a command line sets for ``model.peft`` (from its ``--config`` files and
    ``--model.peft`` / ``--model.peft.class_path`` arguments, the last one winning), or ``None``.

    Args:
        argv: The command-line arguments.
    """
    import yaml

    argv = list(argv)
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if flag == "--config":
            try:
                with open(value, encoding="utf-8") as file:
                    peft = yaml.safe_load(file).get("model", {}).get("peft")
            except (OSError, yaml.YAMLError, AttributeError):
                continue
            found = peft.get("class_path", found) if isinstance(peft, dict) else found
        elif flag in ("--model.peft", "--model.peft.class_path") and "." in value and "{" not in value:
            found = value
    return found
