"""OFTv2: input-centric orthogonal finetuning with the Cayley–Neumann parameterisation, as a PEFT method.

Importing this package registers the ``OFTV2`` PEFT type, so ``peft.get_peft_model(model, OFTv2Config(...))`` and
``PeftModel.from_pretrained`` of a saved OFTv2 adapter work afterwards.
"""

from __future__ import annotations

from peftplug.registry import register_method

from .config import OFTv2Config
from .conv import Conv2d
from .embedding import Embedding
from .layer import Linear, OFTv2Layer
from .model import OFTv2Model

register_method("oftv2", OFTv2Config, OFTv2Model, prefix="oftv2_")

from .diagnostics import (
    LayerDiagnostics,
    NeumannDivergenceWarning,
    format_diagnostics,
    rotation_diagnostics,
)
from .interop import (
    export_peft_oft_adapter,
    load_peft_oft_adapter,
    oft_config_from_oftv2,
    oftv2_config_from_oft,
    oftv2_terms_to_peft,
    peft_terms_to_oftv2,
    state_dict_from_peft_oft,
    state_dict_to_peft_oft,
)
from .lora_export import LoraExport, export_lora, load_oft_family_adapter, lora_from_oftv2, save_lora_export
from .lora_export_eval import lora_applied, measure_lora_export
from .stacking import StackedRotations, stack_rotations

__all__ = [
    "Conv2d",
    "Embedding",
    "LayerDiagnostics",
    "Linear",
    "LoraExport",
    "NeumannDivergenceWarning",
    "OFTv2Config",
    "OFTv2Layer",
    "OFTv2Model",
    "StackedRotations",
    "export_lora",
    "export_peft_oft_adapter",
    "format_diagnostics",
    "load_oft_family_adapter",
    "load_peft_oft_adapter",
    "lora_applied",
    "lora_from_oftv2",
    "measure_lora_export",
    "oft_config_from_oftv2",
    "oftv2_config_from_oft",
    "oftv2_terms_to_peft",
    "peft_terms_to_oftv2",
    "rotation_diagnostics",
    "save_lora_export",
    "stack_rotations",
    "state_dict_from_peft_oft",
    "state_dict_to_peft_oft",
]
