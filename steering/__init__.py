"""Steering vectors (EasyEdit2-style) as a PEFT method: generators, an adapter applier, merging, converters.

Importing this package registers the ``STEERING`` PEFT type, so ``peft.get_peft_model(model, SteeringConfig(...))``
and ``PeftModel.from_pretrained(model, path)`` work::

    import steering
    from steering import SteeringConfig, train_steering_vector

    peft_model = train_steering_vector(model, tokenizer, [("I love it", "I hate it")], method="caa", layers=[2])
    peft_model.base_model.set_multiplier(4.0)
"""

from peftplug.registry import register_method
from steering.config import OPERATORS, POSITIONS, SteeringConfig
from steering.layer import SteeringLayer
from steering.model import SteeringModel, steering_model_of

register_method("steering", SteeringConfig, SteeringModel, prefix="steer_")

# Registration first: the generators and converters build PEFT models of this type.
from steering.easyedit_data import TokenizedPairs, caa_rows, vector_prompt_rows
from steering.generators import (
    METHODS,
    caa_vectors,
    extract_activations,
    pca_vectors,
    steering_loss,
    train_steering_vector,
    train_vectors,
    vector_prompt_vectors,
)
from steering.io import (
    EASYEDIT_FOLDERS,
    export_easyedit,
    export_gguf,
    import_easyedit,
    load_easyedit,
    steering_adapter,
)

__all__ = [
    "EASYEDIT_FOLDERS",
    "METHODS",
    "OPERATORS",
    "POSITIONS",
    "SteeringConfig",
    "SteeringLayer",
    "SteeringModel",
    "TokenizedPairs",
    "caa_rows",
    "caa_vectors",
    "export_easyedit",
    "export_gguf",
    "extract_activations",
    "import_easyedit",
    "load_easyedit",
    "pca_vectors",
    "steering_adapter",
    "steering_loss",
    "steering_model_of",
    "train_steering_vector",
    "train_vectors",
    "vector_prompt_rows",
    "vector_prompt_vectors",
]
