"""Registration of out-of-tree PEFT methods.

PEFT (>= 0.15) offers ``peft.utils.register_peft_method``, but it only accepts names that are already members
of the closed enum ``peft.utils.PeftType``. This module is the ONLY place in peftplug that touches PEFT
internals: it adds enum members at run time, calls ``register_peft_method``, and makes loading an adapter of a
plugin type whose package was not imported fail with a message that says what to import.

It is a leaf module: it imports nothing else from this project, so every method package can import it.
"""

from __future__ import annotations

import enum
import functools
import sys
import threading
from typing import Any

import peft
import torch
from packaging.version import Version

from peftplug.seq_cls_pooling import pool_at_last_attended_token

# The PEFT versions whose internals (PeftType's enum maps, the mapping dicts, BaseTuner's hooks) this package was
# written and tested against (docs/compatibility.md: 0.16-0.20 fail in our tuners and in PEFT's own save/load).
# An older PEFT is refused at import; a newer one is tried, and a failure names the version.
SUPPORTED_PEFT = (Version("0.21.0"), Version("0.22.0"))


def check_peft_version(version: str | None = None) -> None:
    """Refuses a PEFT older than :data:`SUPPORTED_PEFT` with one line, before its internals fail obscurely.

    Args:
        version: The version to check (default: the installed ``peft.__version__``).

    Raises:
        ImportError: Naming the installed version and the supported range.
    """
    version = peft.__version__ if version is None else version
    if Version(version).release < SUPPORTED_PEFT[0].release:
        raise ImportError(
            f"peftplug needs PEFT >={SUPPORTED_PEFT[0]},<{SUPPORTED_PEFT[1]}; PEFT {version} is installed "
            f"(pip install 'peft>={SUPPORTED_PEFT[0]},<{SUPPORTED_PEFT[1]}')"
        )


check_peft_version()

#: peftplug's method packages (the one list), each with the PEFT types it registers when imported (``helene`` is an
#: optimizer: none). ``peftplug.methods`` imports them before a recipe or checkpoint names their classes; the load
#: hint below tells users which one to import before loading an adapter.
METHOD_PACKAGES: dict[str, tuple[str, ...]] = {
    "oftv2": ("OFTV2",),
    "helene": (),
    "prompt_transfer": ("PCT",),
    "steering": ("STEERING",),
}
#: Which package provides each plugin PEFT type (derived from :data:`METHOD_PACKAGES`).
PLUGIN_PACKAGES: dict[str, str] = {peft_type: package for package, types in METHOD_PACKAGES.items()
                                   for peft_type in types}

_LOCK = threading.Lock()


class PeftInternalsChanged(RuntimeError):
    """Raised when the installed PEFT no longer has the internals this module extends."""


def _internals_error(what: str) -> PeftInternalsChanged:
    return PeftInternalsChanged(
        f"peftplug cannot register its methods with PEFT {peft.__version__}: {what}. "
        f"peftplug is tested with PEFT >={SUPPORTED_PEFT[0]},<{SUPPORTED_PEFT[1]}; "
        "install a version in that range or report this at the peftplug tracker."
    )


def add_peft_type(name: str) -> enum.Enum:
    """Adds ``name`` as a member of ``peft.utils.PeftType`` (idempotent).

    ``PeftType`` is a ``str`` Enum; a member is created like the class would create it and entered into
    the enum's member map, value map and member-name list (CPython Enum internals).

    Args:
        name: Upper-case member name; the value is the same string (PEFT's own convention).

    Returns:
        The (possibly pre-existing) ``PeftType`` member.

    Raises:
        ValueError: If ``name`` is not an upper-case identifier.
        PeftInternalsChanged: If ``PeftType`` does not look like the enum this code extends.
    """
    from peft.utils import PeftType

    if not name.isidentifier() or name.upper() != name:
        raise ValueError(f"PEFT type name must be an upper-case identifier, got {name!r}")
    with _LOCK:
        if name in PeftType.__members__:
            return PeftType[name]
        for attr in ("_member_map_", "_value2member_map_", "_member_names_"):
            if not hasattr(PeftType, attr):
                raise _internals_error(f"peft.utils.PeftType has no {attr} (Python {sys.version.split()[0]})")
        if not issubclass(PeftType, str):
            raise _internals_error("peft.utils.PeftType is no longer a str Enum")
        member = str.__new__(PeftType, name)
        member._name_ = name
        member._value_ = name
        member.__objclass__ = PeftType
        if hasattr(next(iter(PeftType)), "_sort_order_"):
            member._sort_order_ = len(PeftType._member_names_)
        member.__init__(name)
        # type.__setattr__ bypasses EnumType's guard against assigning members after class creation.
        type.__setattr__(PeftType, name, member)
        PeftType._member_map_[name] = member
        PeftType._value2member_map_[name] = member
        PeftType._member_names_.append(name)
        if PeftType[name] is not member or PeftType(name) is not member or member not in list(PeftType):
            raise _internals_error("a member added to PeftType is not found by lookup")
        return member


def register_method(
    name: str,
    config_cls: type,
    model_cls: type | None,
    prefix: str | None = None,
    is_mixed_compatible: bool = False,
) -> enum.Enum:
    """Registers a peftplug method with PEFT so ``get_peft_model`` and ``from_pretrained`` know it.

    Idempotent: registering the same classes again is a no-op; registering other classes under a name that is
    already taken raises.

    Args:
        name: Lower-case method name, e.g. ``"oftv2"``; the PeftType member is ``name.upper()``.
        config_cls: The ``PeftConfig`` subclass.
        model_cls: The ``BaseTuner`` subclass, or ``None`` for prompt-learning methods.
        prefix: The parameter-name prefix of the tuner (must equal ``model_cls.prefix``). Defaults to
            ``name + "_"``.
        is_mixed_compatible: Whether ``PeftMixedModel`` may combine this method with others.

    Returns:
        The ``PeftType`` member of the method.
    """
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import register_peft_method

    if name != name.lower():
        raise ValueError(f"method name must be lower case, got {name!r}")
    install_load_hint()
    member = add_peft_type(name.upper())
    with _LOCK:
        if member in PEFT_TYPE_TO_CONFIG_MAPPING:
            if PEFT_TYPE_TO_CONFIG_MAPPING[member] is config_cls and (
                model_cls is None or PEFT_TYPE_TO_TUNER_MAPPING.get(member) is model_cls
            ):
                return member
            raise KeyError(
                f"PEFT type {member.value} is already registered to "
                f"{PEFT_TYPE_TO_CONFIG_MAPPING[member].__qualname__}; cannot register {config_cls.__qualname__}"
            )
        try:
            register_peft_method(
                name=name,
                config_cls=config_cls,
                model_cls=model_cls,
                prefix=prefix,
                is_mixed_compatible=is_mixed_compatible,
            )
        except TypeError as err:  # signature changed
            raise _internals_error(f"register_peft_method rejected our arguments ({err})") from err
    return member


def unknown_type_message(peft_type: Any) -> str:
    """Explains how to make an adapter of an unregistered ``peft_type`` loadable.

    Args:
        peft_type: The ``peft_type`` value read from an ``adapter_config.json``.
    """
    key = str(getattr(peft_type, "value", peft_type))
    package = PLUGIN_PACKAGES.get(key)
    if package is not None:
        return (
            f"This adapter has peft_type {key!r}, which peftplug's `{package}` package provides: "
            f"add `import {package}` before loading it, or load it with `peftplug.load_adapter(model, path)`, "
            "which imports what the adapter needs."
        )
    return (
        f"This adapter has peft_type {key!r}, which neither PEFT {peft.__version__} nor peftplug knows "
        f"(peftplug provides {sorted(PLUGIN_PACKAGES)}). Is it from a newer PEFT or another plugin?"
    )


class UnregisteredAdapterError(ValueError):
    """An adapter's ``peft_type`` is not registered (its plugin package was not imported)."""


def install_load_hint() -> None:
    """Makes loading an adapter of an unregistered plugin type raise a clear error (idempotent).

    PEFT looks the type up in ``PEFT_TYPE_TO_CONFIG_MAPPING`` and fails with a bare ``KeyError: 'OFTV2'``.
    We wrap the two class methods through which every load path reads the type.
    """
    from peft.config import PeftConfigMixin
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    if getattr(PeftConfigMixin, "_peftplug_hint_installed", False):
        return

    def check(peft_type: Any) -> None:
        known = {getattr(k, "value", k) for k in PEFT_TYPE_TO_CONFIG_MAPPING}
        if str(getattr(peft_type, "value", peft_type)) not in known:
            raise UnregisteredAdapterError(unknown_type_message(peft_type))

    original_get_type = PeftConfigMixin._get_peft_type.__func__

    @functools.wraps(original_get_type)
    def _get_peft_type(cls, model_id, **kwargs):
        peft_type = original_get_type(cls, model_id, **kwargs)
        check(peft_type)
        return peft_type

    original_from_type = PeftConfigMixin.from_peft_type.__func__

    @functools.wraps(original_from_type)
    def from_peft_type(cls, **kwargs):
        if "peft_type" in kwargs:
            check(kwargs["peft_type"])
        return original_from_type(cls, **kwargs)

    PeftConfigMixin._get_peft_type = classmethod(_get_peft_type)
    PeftConfigMixin.from_peft_type = classmethod(from_peft_type)
    PeftConfigMixin._peftplug_hint_installed = True


# ---------------------------------------------------------------------------------------------------------------
# Prompt-learning plugin types.
#
# Registering the enum member and mapping entries is not enough for a prompt-learning method in PEFT 0.21:
# ``PeftModel._setup_prompt_encoder`` builds encoders from a closed ``if peft_type in (PROMPT_TUNING, ...) /
# else: raise ValueError("Not supported")`` chain, and the forward/generate paths (seq2seq's decoder attention
# mask among them) branch on ``peft_type in [PROMPT_TUNING, P_TUNING]``. A plugin whose prompt is, at run time,
# a static prompt-tuning embedding (PCT) is therefore driven by PEFT *as* PROMPT_TUNING for dispatch, while it
# keeps its own type for saving and loading:
#   1. ``_setup_prompt_encoder`` runs PEFT's own setup with a ``PromptTuningConfig`` stand-in (freezes the base,
#      finds the word embeddings, fills ``num_transformer_submodules``), then swaps in ``encoder_cls``;
#   2. ``active_peft_config`` (read by every forward/generate/get_prompt path, never by save/load) returns a
#      ``PromptTuningConfig`` view of the plugin config.
# ---------------------------------------------------------------------------------------------------------------

_PROMPT_TUNING_LIKE: set[str] = set()


def _type_value(peft_type) -> str:
    return str(getattr(peft_type, "value", peft_type))


def _prompt_tuning_view(config):
    """A ``PromptTuningConfig`` with the plugin config's shape fields (what PEFT's dispatch reads)."""
    from peft import PromptTuningConfig

    return PromptTuningConfig(
        task_type=config.task_type, num_virtual_tokens=config.num_virtual_tokens, token_dim=config.token_dim,
        num_transformer_submodules=config.num_transformer_submodules,
        num_attention_heads=config.num_attention_heads, num_layers=config.num_layers,
        inference_mode=config.inference_mode, base_model_name_or_path=config.base_model_name_or_path,
    )


PACKED_REFUSAL = (
    "a {} prompt cannot train on packed or padding-free batches (TRL's packing=True or padding_free=True, "
    "transformers' DataCollatorWithFlattening): PEFT puts the prompt once before the packed row and drops its "
    "position ids, so its examples would attend to each other and only the first would see the prompt; set "
    "packing=False or use a padding collator"
)


def _refuse_packed_batches(peft_type: str):
    """A forward pre-hook for the base model under a prompt-tuning-like plugin: refuses packed batches.

    PEFT's prompt-learning forward drops ``position_ids`` and puts the prompt once before each row, so the examples
    of a packed row (TRL's ``packing=True`` / ``padding_free=True``) attended to each other and only the first saw
    the prompt: the run trained on the loss of one long sequence, silently. The boundaries TRL passes
    (``cu_seq_lens_q``, ``seq_idx``) still reach the base model, which is where they are seen.

    Args:
        peft_type: The plugin's type, for the message.
    """

    def hook(module, args, kwargs):
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(PACKED_REFUSAL.format(peft_type))

    return hook


def _refuse_restarting_positions(module, args, kwargs):
    """A forward pre-hook for the ``PeftModel`` of a prompt-tuning-like plugin: refuses rows whose position ids
    restart, the only mark of a packed batch from ``DataCollatorWithFlattening()`` with its defaults.

    That collator sends no ``cu_seq_lens_q``/``seq_idx`` and PEFT drops the position ids (with a warning) before the
    base model, where :func:`_refuse_packed_batches` looks. Positions are compared only between two attended
    tokens, so left or right padding (whose positions HF fills with 1) is not mistaken for a restart.

    Args:
        module: The ``PeftModel``.
        args: The forward's positional arguments.
        kwargs: Its keyword arguments.
    """
    positions = kwargs.get("position_ids")
    if not torch.is_tensor(positions) or positions.dim() != 2 or positions.shape[-1] < 2:
        return
    config = module.peft_config.get(module.active_adapter)
    if config is None or _type_value(config.peft_type) not in _PROMPT_TUNING_LIKE:
        return
    restarts = positions[:, 1:] <= positions[:, :-1]
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.shape == positions.shape:
        restarts &= mask[:, 1:].bool() & mask[:, :-1].bool()
    if bool(restarts.any()):
        raise ValueError(PACKED_REFUSAL.format(_type_value(config.peft_type)))


def _install_prompt_tuning_dispatch() -> None:
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.peft_model import PeftModel

    if getattr(PeftModel, "_peftplug_prompt_dispatch", False):
        return
    original_setup = getattr(PeftModel, "_setup_prompt_encoder", None)
    original_active = PeftModel.__dict__.get("active_peft_config")
    if original_setup is None or not isinstance(original_active, property):
        raise _internals_error("PeftModel._setup_prompt_encoder / active_peft_config not found")

    def _setup_prompt_encoder(self, adapter_name: str):
        from peftplug.quantized_layout import keep_exact_4bit_layout_if_intact

        # Every prompt-learning adapter (PEFT's too) on a 4-bit base loaded outside peftplug: bitsandbytes' CPU
        # repacking at the first eval forward gives a matmul without autograd, and the prompt's gradient changed
        # after an evaluate() (PCT's query by 43 %). A base already repacked is left to the user (it still infers).
        keep_exact_4bit_layout_if_intact(self.base_model)
        config = self.peft_config[adapter_name]
        if _type_value(config.peft_type) not in _PROMPT_TUNING_LIKE:
            original_setup(self, adapter_name)
            pool_at_last_attended_token(self)  # PEFT's own prompt tuning / P-tuning classifiers too
            return
        stand_in = _prompt_tuning_view(config)
        self.peft_config[adapter_name] = stand_in
        try:
            original_setup(self, adapter_name)
        finally:
            self.peft_config[adapter_name] = config
        config.num_transformer_submodules = stand_in.num_transformer_submodules
        encoder = PEFT_TYPE_TO_TUNER_MAPPING[config.peft_type](config, self.word_embeddings)
        self.prompt_encoder[adapter_name] = encoder.to(self.device)
        if "_peftplug_packing_guard" not in self.__dict__:
            self.__dict__["_peftplug_packing_guard"] = (
                self.base_model.register_forward_pre_hook(
                    _refuse_packed_batches(_type_value(config.peft_type)), with_kwargs=True),
                self.register_forward_pre_hook(_refuse_restarting_positions, with_kwargs=True),
            )
        pool_at_last_attended_token(self)

    def active_peft_config(self):
        config = original_active.fget(self)
        if _type_value(config.peft_type) in _PROMPT_TUNING_LIKE:
            return _prompt_tuning_view(config)
        return config

    PeftModel._setup_prompt_encoder = _setup_prompt_encoder
    PeftModel.active_peft_config = property(active_peft_config)
    PeftModel._peftplug_prompt_dispatch = True


def register_prompt_learning_method(name: str, config_cls: type, encoder_cls: type, prefix: str | None = None):
    """Registers a prompt-learning method whose encoder PEFT should drive like ``PROMPT_TUNING``'s.

    Args:
        name: Lower-case method name (``"pct"``).
        config_cls: Its ``PromptLearningConfig`` subclass.
        encoder_cls: Its ``BasePromptEncoder`` subclass, built as ``encoder_cls(config, word_embeddings)``; it must
            expose ``embedding.weight`` (the prompt, ``[num_virtual_tokens * num_transformer_submodules, d]``).
        prefix: Parameter prefix (defaults to ``name + "_"``).

    Returns:
        The ``PeftType`` member.
    """
    member = register_method(name, config_cls, encoder_cls, prefix=prefix)
    with _LOCK:
        _install_prompt_tuning_dispatch()
        _PROMPT_TUNING_LIKE.add(member.value)
    return member


# Once per process, whoever imports this module first (``import peftplug`` arranges it for when PEFT is imported).
install_load_hint()
