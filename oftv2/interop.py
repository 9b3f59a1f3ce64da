"""Conversion between OFTv2 adapters and PEFT's own OFT adapters (``peft_type: OFT``, PEFT >= 0.18 layout).

Both store each block's skew matrix Q as its strict upper triangle (``triu_indices(b, b, 1)`` order), shape
``[n_blocks or 1, b(b-1)/2]``, and both rotate the input (``x' = x R``). The forms map as follows:

=====================================  ========================================  ===========================
PEFT ``OFTConfig``                      OFTv2                                     parameters
=====================================  ========================================  ===========================
``use_cayley_neumann=True``, n terms    ``orthogonalization="peft_cn"``, n terms  same Q
``use_cayley_neumann=False`` (exact)    ``orthogonalization="cayley"``            Q negated
=====================================  ========================================  ===========================

PEFT's exact path solves ``X (I + Q) = I − Q``, i.e. ``X = (I − Q)(I + Q)⁻¹ = Cayley(−Q)``, the transpose of the
rotation its Neumann path approximates. OFTv2 uses ``(I + Q)(I − Q)⁻¹`` everywhere, so an exact adapter changes
sign on the way through. Both mappings reproduce the outputs to fp32 rounding.

PEFT's polynomial for ``num_cayley_neumann_terms = n`` is ``I + 2Q + … + 2Qⁿ⁻² + Qⁿ⁻¹`` (OFTv2's ``"peft_cn"``)
only for n >= 4: n = 2 gives ``I + 2Q`` (OFTv2's Taylor form with 2 terms) and n = 3 gives the same polynomial
as n = 4 (checked against PEFT 0.21.2). :func:`peft_terms_to_oftv2` and :func:`oftv2_terms_to_peft` handle that.

OFTv2's default ``"cayley_neumann"`` (Taylor) form has no PEFT equivalent (except with 2 terms), nor has
``"peft_cn"`` with fewer than 4 terms: such adapters are exported as PEFT's exact Cayley (the map the series
approximates), which differs by the truncation error O(||Q||^n); the export warns with the measured largest
difference of the rotation entries. ``max_q_norm`` is baked into the exported Q.

Layer types. ``nn.Linear`` / ``Conv1D`` and ``nn.Conv2d`` rotations are PEFT's ``oft_R``, ``nn.Embedding`` rotations
its ``oft_embedding_R`` (rotation of the looked-up vectors in both libraries); the tensors have the same layout.
For ``Conv2d`` both libraries rotate each filter's flattened ``in · kh · kw`` input (merged weight ``W_flat Rᵀ``),
but PEFT 0.21.2's *unmerged* Conv2d forward computes something else for kernels larger than 1 × 1 (it folds
rotated stride-1 image patches back into an image; see ``oftv2.conv``). So a converted Conv2d adapter reproduces
what PEFT's merged model (``merge_and_unload``) computes, which is the function its weights define; it reproduces
PEFT's unmerged outputs only for 1 × 1 kernels. The same holds the other way: PEFT evaluates an exported k > 1
Conv2d adapter correctly only after merging it (both directions warn, naming the layers), and cannot load adapters
of non-square kernels at all (its Conv2d layer assumes ``kh == kw``).

What does not convert is refused in one ``ValueError``: on export, layers PEFT's OFT cannot load (GPT-2 ``Conv1D``;
``Conv2d`` with groups, a non-square kernel or dilation) and ``trainable_token_indices`` (no ``OFTConfig`` field, so
vanilla PEFT would drop the trained rows silently); on load, saved rotations whose shape OFTv2 does not build
(grouped convs, per-layer adjusted block sizes). A PEFT adapter whose ``oft_block_size`` PEFT adjusted to one other
size on every layer loads with that size.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import torch
from peft import OFTConfig
from safetensors.torch import load_file, save_file
from torch import nn

from peftplug.fileio import atomic_write
from peftplug_kernels import ops
from peftplug_kernels.cayley_neumann.reference import block_size_from_triangle

from .config import OFTv2Config
from .conv import Conv2d
from .embedding import Embedding
from .layer import OFTv2Layer, bound_q

PEFT_KEY = ".oft_R.weight"
# PEFT keeps an Embedding layer's rotation under its own attribute (same layout, rotation on the output).
PEFT_EMBEDDING_KEY = ".oft_embedding_R.weight"
OFTV2_KEY = ".oftv2_Q.weight"
# The key adapters saved before peftplug.adapter_params had (still loadable).
OFTV2_LEGACY_KEY = ".oftv2_Q"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# Fields both configs share under the same name and meaning.
_SHARED_FIELDS = (
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "modules_to_save",
    "module_dropout",
    "block_share",
    "init_weights",
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "fan_in_fan_out",
)


def _plain(value):
    return sorted(value) if isinstance(value, set) else value


def peft_terms_to_oftv2(terms: int) -> tuple[str, int]:
    """OFTv2 ``(orthogonalization, neumann_terms)`` computing the same R as PEFT's ``num_cayley_neumann_terms``.

    Args:
        terms: PEFT's ``num_cayley_neumann_terms`` (with ``use_cayley_neumann=True``).

    Raises:
        ValueError: For ``terms < 2`` (PEFT then applies R = I, which no OFTv2 form reproduces for all Q).
    """
    if terms < 2:
        raise ValueError(
            f"PEFT OFT with num_cayley_neumann_terms={terms} applies no rotation; nothing to convert"
        )
    if terms == 2:
        return "cayley_neumann", 2  # PEFT: I + 2Q
    return "peft_cn", max(terms, 4)  # PEFT's n = 3 computes the n = 4 polynomial


def oftv2_terms_to_peft(form: str, terms: int) -> int | None:
    """PEFT's ``num_cayley_neumann_terms`` that reproduces an OFTv2 Neumann form, or ``None`` if none does.

    Args:
        form: OFTv2 orthogonalization.
        terms: OFTv2 neumann_terms.
    """
    if form == "peft_cn" and terms >= 4:
        return terms
    if form == "cayley_neumann" and terms == 2:
        return 2
    return None


def oftv2_config_from_oft(oft_config: OFTConfig) -> OFTv2Config:
    """The OFTv2 config that reproduces a PEFT ``OFTConfig`` (see the module docstring for the form mapping).

    Args:
        oft_config: A PEFT OFT config.

    Raises:
        ValueError: For features OFTv2 does not have (COFT) or a config that is not OFT.
    """
    if str(getattr(oft_config.peft_type, "value", oft_config.peft_type)) != "OFT":
        raise ValueError(
            f"expected a PEFT OFT config (peft_type 'OFT'), got peft_type {oft_config.peft_type!r}"
        )
    if oft_config.coft:
        raise ValueError("PEFT OFT adapters with coft=True (constrained OFT) have no OFTv2 equivalent")
    kwargs = {f: _plain(getattr(oft_config, f)) for f in _SHARED_FIELDS if hasattr(oft_config, f)}
    if oft_config.oft_block_size:
        kwargs["block_size"] = oft_config.oft_block_size
    else:
        kwargs["r"] = oft_config.r
    if oft_config.use_cayley_neumann:
        form, terms = peft_terms_to_oftv2(oft_config.num_cayley_neumann_terms)
        kwargs.update(orthogonalization=form, neumann_terms=terms)
    else:
        kwargs["orthogonalization"] = "cayley"
    kwargs["bias"] = {"oft_only": "oftv2_only"}.get(oft_config.bias, oft_config.bias)
    return OFTv2Config(**kwargs)


def oft_config_from_oftv2(config: OFTv2Config) -> OFTConfig:
    """The PEFT ``OFTConfig`` an OFTv2 config exports to (forms without a PEFT twin -> exact Cayley, see above).

    Args:
        config: An OFTv2 config.
    """
    kwargs = {f: _plain(getattr(config, f)) for f in _SHARED_FIELDS}
    if config.block_size is not None:
        kwargs.update(oft_block_size=config.block_size, r=0)
    else:
        kwargs.update(oft_block_size=0, r=config.r)
    peft_terms = oftv2_terms_to_peft(config.orthogonalization, config.neumann_terms)
    if peft_terms is not None:
        kwargs.update(use_cayley_neumann=True, num_cayley_neumann_terms=peft_terms)
    else:
        kwargs["use_cayley_neumann"] = False
    kwargs["bias"] = {"oftv2_only": "oft_only"}.get(config.bias, config.bias)
    return OFTConfig(**kwargs)


def _negates(form_is_exact: bool) -> float:
    return -1.0 if form_is_exact else 1.0


def state_dict_from_peft_oft(
    state_dict: dict[str, torch.Tensor], oft_config: OFTConfig
) -> dict[str, torch.Tensor]:
    """Renames (and for exact Cayley negates) a saved PEFT OFT adapter state dict into OFTv2's layout.

    Args:
        state_dict: As saved by PEFT (adapter name removed), keys ``...oft_R.weight``.
        oft_config: The adapter's config.

    Raises:
        ValueError: If the dict holds no OFT rotation or tensors OFTv2 cannot represent.
    """
    sign = _negates(not oft_config.use_cayley_neumann)
    out = {}
    for key, value in state_dict.items():
        peft_key = next((k for k in (PEFT_KEY, PEFT_EMBEDDING_KEY) if key.endswith(k)), None)
        if peft_key is not None:
            out[key[: -len(peft_key)] + OFTV2_KEY] = sign * value
        elif ".oft_" in key:
            raise ValueError(
                f"unsupported PEFT OFT tensor {key!r} (only the rotations `oft_R` and `oft_embedding_R` convert)"
            )
        else:
            out[key] = value  # modules_to_save, biases
    if not any(k.endswith(OFTV2_KEY) for k in out):
        raise ValueError(f"no PEFT OFT rotation (keys ending in {PEFT_KEY!r}) in the state dict")
    return out


def state_dict_to_peft_oft(
    state_dict: dict[str, torch.Tensor], config: OFTv2Config, embedding_modules: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """Renames an OFTv2 adapter state dict (adapter name removed) into PEFT OFT's layout.

    Applies ``max_q_norm`` and, for forms exported as PEFT's exact Cayley (see :func:`oft_config_from_oftv2`),
    negates Q.

    Args:
        state_dict: Keys ``...oftv2_Q.weight`` (as ``get_peft_model_state_dict`` returns them; the older
            ``...oftv2_Q`` too).
        config: The adapter's config.
        embedding_modules: Module paths (the keys without ``.oftv2_Q.weight``) of ``nn.Embedding`` layers, whose
            rotation PEFT stores as ``oft_embedding_R``.
    """
    sign = _negates(oftv2_terms_to_peft(config.orthogonalization, config.neumann_terms) is None)
    embedding_modules = embedding_modules or set()
    out = {}
    for key, value in state_dict.items():
        suffix = next((k for k in (OFTV2_KEY, OFTV2_LEGACY_KEY) if key.endswith(k)), None)
        if suffix is not None:
            module = key[: -len(suffix)]
            peft_key = PEFT_EMBEDDING_KEY if module in embedding_modules else PEFT_KEY
            out[module + peft_key] = sign * bound_q(value, config.max_q_norm)
        else:
            out[key] = value
    return out


def _series_gap(model: nn.Module, adapter_name: str) -> float:
    """Largest |R_series − R_exact| entry over the OFTv2 layers of ``model`` (what an inexact export changes)."""
    gap = 0.0
    for module in model.modules():
        if isinstance(module, OFTv2Layer) and adapter_name in module.oftv2_Q:
            with torch.no_grad():
                q = module.effective_q(adapter_name).double()
                b = module.oftv2_block_size[adapter_name]
                approx = module.get_rotation(adapter_name).double()
                exact = ops.cayley_neumann(q, b, form="cayley", impl="torch")
                gap = max(gap, float((approx - exact).abs().max()))
    return gap


def _conv_layers_beyond_1x1(model: nn.Module, adapter_name: str) -> list[str]:
    """Names of the ``Conv2d`` layers of ``adapter_name`` with a kernel larger than 1 × 1 (see the module docstring),
    or of a conv class with its own forward (weight standardization, SAME padding: PEFT's unmerged forward skips it
    at any kernel size).

    Args:
        model: A model holding OFTv2 layers.
        adapter_name: The adapter.
    """
    return [name for name, module in model.named_modules()
            if isinstance(module, Conv2d) and adapter_name in module.oftv2_Q
            and (math.prod(module.get_base_layer().kernel_size) > 1 or module.custom_forward)]


def _peft_cannot_load(model: nn.Module, adapter_name: str) -> list[str]:
    """``"<layer> (<why>)"`` for each layer of ``adapter_name`` whose rotation PEFT 0.21.2's OFT cannot load.

    Args:
        model: A model holding OFTv2 layers.
        adapter_name: The adapter.
    """
    refused = []
    for name, module in model.named_modules():
        if not isinstance(module, OFTv2Layer) or adapter_name not in module.oftv2_Q:
            continue
        if getattr(module, "fan_in_fan_out", False):
            refused.append(f"{name} (GPT-2 Conv1D: PEFT's OFT raises TypeError on it)")
        elif isinstance(module, Conv2d):
            base = module.get_base_layer()
            # PEFT sizes a conv's rotation as in_channels · kh · kh and refuses dilation (its layer.py).
            if base.groups > 1:
                refused.append(f"{name} (groups={base.groups}: PEFT rotates all in_channels · kh · kw together)")
            elif base.kernel_size[0] != base.kernel_size[1]:
                refused.append(f"{name} (kernel {tuple(base.kernel_size)}: PEFT assumes a square kernel)")
            elif base.dilation[0] > 1:
                refused.append(f"{name} (dilation {tuple(base.dilation)}: PEFT refuses dilation > 1)")
    return refused


def export_peft_oft_adapter(
    peft_model: nn.Module, out_dir: str | os.PathLike, adapter_name: str = "default"
) -> Path:
    """Writes an OFTv2 adapter as a PEFT OFT adapter directory that vanilla PEFT loads.

    Args:
        peft_model: A ``PeftModel`` holding the OFTv2 adapter.
        out_dir: Directory to write ``adapter_config.json`` and ``adapter_model.safetensors`` into.
        adapter_name: Which adapter.

    Returns:
        The output directory.

    Raises:
        ValueError: For an adapter that is not OFTv2, one with ``trainable_token_indices`` (PEFT's ``OFTConfig`` has
            no such field: vanilla PEFT would load it without the trained token rows, silently), or one on layers
            PEFT's OFT cannot load (GPT-2 ``Conv1D``; ``Conv2d`` with groups, a non-square kernel or dilation).
    """
    from peft import get_peft_model_state_dict

    config = peft_model.peft_config[adapter_name]
    if not isinstance(config, OFTv2Config):
        # A wrong adapter *choice*, not a wrong argument type: ValueError like PEFT's own adapter-name errors.
        raise ValueError(f"adapter {adapter_name!r} is not an OFTv2 adapter ({type(config).__name__})")  # noqa: TRY004
    if config.trainable_token_indices:
        raise ValueError(
            f"adapter {adapter_name!r} trains token rows (trainable_token_indices), which PEFT's OFTConfig cannot "
            "hold: vanilla PEFT would load the export without them; keep it as an OFTv2 adapter (save_pretrained)"
        )
    refused = _peft_cannot_load(peft_model, adapter_name)
    if refused:
        raise ValueError(
            f"PEFT's OFT cannot load adapter {adapter_name!r} on {len(refused)} layer(s): {'; '.join(refused[:5])}"
            f"{' ...' if len(refused) > 5 else ''}; exclude them (exclude_modules) or keep it as an OFTv2 adapter"
        )
    convs = _conv_layers_beyond_1x1(peft_model, adapter_name)
    if convs:
        warnings.warn(
            f"adapter {adapter_name!r} adapts Conv2d layers with kernels larger than 1 x 1 or a forward of their own "
            f"({', '.join(convs[:5])}): "
            "PEFT 0.21's unmerged OFT Conv2d forward computes another function there (oftv2.conv); in PEFT, "
            "evaluate the exported adapter after merge_and_unload()",
            stacklevel=2,
        )
    if (
        config.orthogonalization != "cayley"
        and oftv2_terms_to_peft(config.orthogonalization, config.neumann_terms) is None
    ):
        gap = _series_gap(peft_model, adapter_name)
        warnings.warn(
            f"PEFT has no equivalent of orthogonalization={config.orthogonalization!r} with "
            f"{config.neumann_terms} terms: exporting as PEFT's exact Cayley (use_cayley_neumann=False); rotation "
            f"entries change by at most {gap:.2e}. Train with orthogonalization='peft_cn' (>= 4 terms) or "
            "'cayley' for an exact export.",
            stacklevel=2,
        )
    embeddings = {name for name, module in peft_model.named_modules() if isinstance(module, Embedding)}
    state = state_dict_to_peft_oft(
        get_peft_model_state_dict(peft_model, adapter_name=adapter_name), config, embedding_modules=embeddings
    )
    oft_config = oft_config_from_oftv2(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_dict = {k: _plain(v) for k, v in oft_config.to_dict().items()}
    config_dict["peft_type"] = "OFT"
    config_dict["task_type"] = _plain(getattr(config.task_type, "value", config.task_type))
    import peft

    config_dict["peft_version"] = peft.__version__

    def write_config(tmp):
        with open(tmp, "w") as fh:
            json.dump(config_dict, fh, indent=2, sort_keys=True)

    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write(out / CONFIG_NAME, write_config)
    return out


def _read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path = adapter_dir / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a PEFT adapter directory")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON ({err})") from err
    if raw.get("peft_type") != "OFT":
        raise ValueError(f"{config_path} has peft_type {raw.get('peft_type')!r}; expected 'OFT'")
    weights = adapter_dir / WEIGHTS_NAME
    if weights.is_file():
        try:
            return raw, load_file(weights)
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{weights} is not a readable safetensors file ({err})") from err
    legacy = adapter_dir / "adapter_model.bin"
    if legacy.is_file():
        return raw, torch.load(legacy, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no {WEIGHTS_NAME} (or adapter_model.bin) in {adapter_dir}")


# OFTv2Config fields config_overrides may set: how the loaded rotations are computed and trained, not which
# tensors exist or what they mean.
OVERRIDABLE_ON_LOAD = (
    "kernel_impl", "conv_evaluation", "stack_rotations", "module_dropout", "max_q_norm", "task_type",
    "base_model_name_or_path", "revision",
)
_SHAPE = "it sets the shape of the saved rotation parameters (read from the adapter's oft_block_size / r)"
_TARGETS = "it decides which layers get a rotation, and the saved weights name exactly those layers"
_EXTRAS = "it decides which extra tensors the adapter holds, which adapter_config.json already records"
_FORM = ("the saved parameters were converted for the form in adapter_config.json (exact Cayley negates them): "
         "another form computes a different rotation from them than the adapter did")
# Why each other field cannot be overridden on load (the message names the field and this reason).
_FIXED_ON_LOAD = {
    "block_size": _SHAPE, "r": _SHAPE, "block_share": _SHAPE,
    "orthogonalization": _FORM, "neumann_terms": _FORM,
    "target_modules": _TARGETS, "exclude_modules": _TARGETS, "layers_to_transform": _TARGETS,
    "layers_pattern": _TARGETS,
    "modules_to_save": _EXTRAS, "trainable_token_indices": _EXTRAS, "bias": _EXTRAS,
    "fan_in_fan_out": "it is set per layer from the base layer's type (GPT-2 Conv1D)",
    "init_weights": "the saved weights replace the initial ones on load, so it would have no effect",
    "inference_mode": "it follows is_trainable; pass is_trainable instead",
    "peft_type": "the loaded adapter is an OFTv2 adapter",
    "auto_mapping": "PEFT sets it", "peft_version": "PEFT sets it",
}


def _check_overrides(overrides: dict) -> None:
    """Refuses override keys that are no ``OFTv2Config`` field, or fields fixed by the saved adapter.

    Without this, ``setattr`` accepted a typo as a new attribute (silently ignored) and a structural field ended
    in a size-mismatch ``RuntimeError`` from ``load_state_dict``.

    Args:
        overrides: The ``config_overrides`` argument.

    Raises:
        ValueError: Naming the first key refused, and why.
    """
    for key in overrides:
        if key in OVERRIDABLE_ON_LOAD:
            continue
        if key in _FIXED_ON_LOAD or key in OFTv2Config.__dataclass_fields__:
            reason = _FIXED_ON_LOAD.get(key, "the saved adapter fixes it")
            raise ValueError(f"config_overrides cannot set {key!r} when loading an adapter: {reason}")
        raise ValueError(
            f"config_overrides has unknown key {key!r}; accepted keys: {', '.join(OVERRIDABLE_ON_LOAD)}"
        )


def _saved_block_size(state: dict[str, torch.Tensor], oft_config: OFTConfig) -> int | None:
    """The one block size of a PEFT adapter saved with ``oft_block_size`` that PEFT adjusted (``None`` if not).

    PEFT moves a block size that does not divide a layer's width to the nearest divisor (with a warning) and saves
    rotations of that size. When every layer got the same size, OFTv2 converts it with that block size.

    Args:
        state: The saved PEFT state dict.
        oft_config: Its config.

    Raises:
        ValueError: When the layers were saved with different block sizes (OFTv2 has one per adapter).
    """
    if not oft_config.oft_block_size:
        return None  # r given: block sizes differ per width by design; the shape check below judges each layer
    sizes = {block_size_from_triangle(v.shape[-1]) for k, v in state.items()
             if k.endswith((PEFT_KEY, PEFT_EMBEDDING_KEY))}
    if len(sizes) > 1:
        raise ValueError(
            f"PEFT adjusted oft_block_size={oft_config.oft_block_size} layer by layer to the block sizes "
            f"{sorted(sizes)}; an OFTv2 adapter has one block size, so this adapter cannot be converted"
        )
    if sizes and sizes != {oft_config.oft_block_size}:
        (size,) = sizes
        warnings.warn(
            f"the PEFT adapter was saved with block size {size} (PEFT adjusted oft_block_size="
            f"{oft_config.oft_block_size}, which does not divide the widths); converting with block_size={size}",
            stacklevel=3,
        )
        return size
    return None


def _check_shapes(peft_model: nn.Module, converted: dict[str, torch.Tensor], adapter_name: str, where: Path) -> None:
    """Refuses (in one line) saved rotations whose shape is not what OFTv2 built for the layer.

    Args:
        peft_model: The OFTv2 ``PeftModel`` just built.
        converted: The converted state dict (keys without the adapter name).
        adapter_name: The adapter.
        where: The adapter directory, for the message.

    Raises:
        ValueError: Naming the first layer that does not fit, both shapes and the likely reason.
    """
    from peft import get_peft_model_state_dict

    expected = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    modules = dict(peft_model.named_modules())
    for key, value in converted.items():
        if not key.endswith(OFTV2_KEY) or key not in expected or expected[key].shape == value.shape:
            continue
        module = key[: -len(OFTV2_KEY)]
        layer = modules.get(module)
        if isinstance(layer, Conv2d) and layer.get_base_layer().groups > 1:
            why = "PEFT sizes a grouped conv's rotation over all in_channels · kh · kw, OFTv2 over one group's"
        else:
            why = "PEFT adjusts an r or oft_block_size that does not divide a layer's width, layer by layer"
        raise ValueError(
            f"PEFT OFT adapter {where} does not fit this model: layer {module!r} has a saved rotation of shape "
            f"{tuple(value.shape)} where OFTv2 builds {tuple(expected[key].shape)} ({why})"
        )


def load_peft_oft_adapter(
    model: nn.Module,
    adapter_dir: str | os.PathLike,
    adapter_name: str = "default",
    is_trainable: bool = False,
    config_overrides: dict | None = None,
):
    """Loads a PEFT OFT adapter directory into ``model`` as an OFTv2 adapter.

    Args:
        model: The base model (a plain ``transformers`` model).
        adapter_dir: Directory with ``adapter_config.json`` (peft_type OFT) and the weights.
        adapter_name: Name for the adapter.
        is_trainable: Keep the adapter trainable (else inference mode).
        config_overrides: OFTv2Config fields to set on the converted config (e.g. ``{"kernel_impl": "torch"}``):
            only those in :data:`OVERRIDABLE_ON_LOAD`, which change how the rotations are computed or trained, not
            which tensors the adapter holds or what they mean.

    Returns:
        The ``PeftModel`` with the OFTv2 adapter, producing the same outputs as PEFT's OFT.

    Raises:
        ValueError: For an adapter that is not PEFT OFT or does not fit ``model`` (a saved rotation of another shape
            than OFTv2 builds, named with both shapes), and for a ``config_overrides`` key that is unknown or fixed
            by the saved adapter.
    """
    from peft import get_peft_model, set_peft_model_state_dict

    _check_overrides(config_overrides or {})  # before anything is read or built
    adapter_dir = Path(adapter_dir)
    raw, state = _read_adapter(adapter_dir)
    known = set(OFTConfig.__dataclass_fields__)
    oft_config = OFTConfig(**{k: v for k, v in raw.items() if k in known and k != "peft_type"})
    config = oftv2_config_from_oft(oft_config)
    saved_block = _saved_block_size(state, oft_config)
    if saved_block is not None:
        config.block_size = saved_block
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    config.inference_mode = not is_trainable
    config._validate()
    peft_model = get_peft_model(model, config, adapter_name=adapter_name)
    converted = state_dict_from_peft_oft(state, oft_config)
    _check_shapes(peft_model, converted, adapter_name, adapter_dir)
    result = set_peft_model_state_dict(peft_model, converted, adapter_name=adapter_name)
    unexpected = [k for k in result.unexpected_keys if "oftv2_" in k or k in converted]
    missing = [k for k in result.missing_keys if f"oftv2_Q.{adapter_name}" in k]
    if unexpected or missing:
        raise ValueError(
            f"PEFT OFT adapter {adapter_dir} does not fit this model: unexpected {unexpected[:5]}, missing {missing[:5]}"
        )
    convs = _conv_layers_beyond_1x1(peft_model, adapter_name)
    if convs:
        warnings.warn(
            f"PEFT OFT adapter {adapter_dir} adapts Conv2d layers with kernels larger than 1 x 1 or a forward of their own "
            f"({', '.join(convs[:5])}): the converted adapter computes conv(x, W_flat R^T), what PEFT's merged model "
            "(merge_and_unload) computes; PEFT 0.21's unmerged outputs differ there (oftv2.conv)",
            stacklevel=2,
        )
    if not is_trainable:
        peft_model.eval()
    return peft_model
