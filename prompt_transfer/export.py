"""Export: collapse a trained PCT adapter into a plain PEFT prompt-tuning adapter.

Task-level attention does not depend on the input, so a trained PCT prompt is one static ``[l, d]`` matrix.
The export writes it in PEFT's own ``PROMPT_TUNING`` format (``adapter_config.json`` +
``adapter_model.safetensors`` with ``prompt_embeddings`` and any ``modules_to_save`` head), which vanilla PEFT
loads without this library, and keeps the full PCT adapter (query, keys, residual, ``P_0``, ``S_k``) in
``pct_state/`` so training can resume from it.
"""

from __future__ import annotations

import os
import tempfile

import torch

from peftplug.fileio import atomic_write

PCT_STATE_DIR = "pct_state"


def export_prompt_tuning(model, out_dir: str, adapter_name: str | None = None, keep_pct_state: bool = True) -> str:
    """Writes a PCT adapter of ``model`` as a vanilla PEFT prompt-tuning adapter into ``out_dir``.

    Args:
        model: A ``PeftModel`` with a PCT adapter.
        out_dir: Output directory (created if missing; files are replaced atomically one by one).
        adapter_name: The PCT adapter (default: the active one).
        keep_pct_state: Also save the full PCT adapter into ``out_dir/pct_state`` (for resuming).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: If the adapter is not a PCT adapter.
    """
    from peft.utils import get_peft_model_state_dict

    name = adapter_name or model.active_adapter
    config = model.peft_config[name]
    if str(getattr(config.peft_type, "value", config.peft_type)) != "PCT":
        raise ValueError(f"adapter {name!r} is a {config.peft_type} adapter, not PCT")
    state = get_peft_model_state_dict(model, adapter_name=name)
    with torch.no_grad():
        prompt = model.prompt_encoder[name].embedding.weight.detach()
    _write_prompt_tuning(out_dir, config, state, prompt)
    if keep_pct_state:
        model.save_pretrained(os.path.join(out_dir, PCT_STATE_DIR), selected_adapters=[name])
    return out_dir


def _write_prompt_tuning(out_dir: str, config, state: dict, prompt: torch.Tensor) -> None:
    """Writes PEFT's prompt-tuning files: the prompt, the non-PCT entries of ``state`` (heads), the config."""
    from peft import PromptTuningConfig
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    # Keep what vanilla prompt tuning saves: the prompt and any modules_to_save head; drop PCT's own tensors.
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if not k.startswith("pct_")}
    tensors["prompt_embeddings"] = prompt.detach().cpu().contiguous()
    pt_config = PromptTuningConfig(
        task_type=config.task_type, num_virtual_tokens=config.num_virtual_tokens, token_dim=config.token_dim,
        num_transformer_submodules=config.num_transformer_submodules,
        num_attention_heads=config.num_attention_heads, num_layers=config.num_layers,
        modules_to_save=config.modules_to_save, base_model_name_or_path=config.base_model_name_or_path,
        inference_mode=True,
    )
    atomic_write(os.path.join(out_dir, SAFETENSORS_WEIGHTS_NAME),
            lambda p: save_file(tensors, p, metadata={"format": "pt", "exported_from": "PCT"}))
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        pt_config.save_pretrained(tmp)
        os.replace(os.path.join(tmp, "adapter_config.json"), os.path.join(out_dir, "adapter_config.json"))


def export_adapter_dir(pct_dir: str, out_dir: str, keep_pct_state: bool = True) -> str:
    """File-to-file export of a saved PCT adapter (no base model needed: the prompt depends only on PCT's state).

    Args:
        pct_dir: Directory of a saved PCT adapter (``save_pretrained`` or ``peftplug export``).
        out_dir: Output directory, as for :func:`export_prompt_tuning`.
        keep_pct_state: Copy the PCT adapter into ``out_dir/pct_state``.

    Returns:
        ``out_dir``.
    """
    import shutil

    from peft import PeftConfig
    from peft.utils import load_peft_weights

    from prompt_transfer.model import PCTPromptEncoder

    config = PeftConfig.from_pretrained(pct_dir)
    if str(getattr(config.peft_type, "value", config.peft_type)) != "PCT":
        raise ValueError(f"{pct_dir} holds a {config.peft_type} adapter, not PCT")
    state = load_peft_weights(pct_dir)
    encoder = PCTPromptEncoder(config)
    encoder._load_adapter_state_dict(state)
    with torch.no_grad():
        prompt = encoder.embedding.weight
    _write_prompt_tuning(out_dir, config, state, prompt)
    if keep_pct_state:
        target = os.path.join(out_dir, PCT_STATE_DIR)
        os.makedirs(target, exist_ok=True)
        for fname in os.listdir(pct_dir):
            if os.path.isfile(os.path.join(pct_dir, fname)):
                shutil.copy2(os.path.join(pct_dir, fname), os.path.join(target, fname))
    return out_dir


def load_pct_for_training(base_model, adapter_dir: str, adapter_name: str = "default"):
    """Rebuilds a trainable PCT adapter from a saved one (PEFT refuses ``is_trainable=True`` for prompt learning).

    Accepts a PCT adapter directory or an export directory (then its ``pct_state/`` is used). The saved state
    holds ``P_0`` and ``S_k``, so the original decomposition directory is not needed.

    Args:
        base_model: A fresh base model (the same architecture the adapter was trained on).
        adapter_dir: Directory written by ``save_pretrained`` or :func:`export_prompt_tuning`.
        adapter_name: Name to give the adapter.

    Returns:
        A ``PeftModel`` whose PCT query, keys and residual are trainable.
    """
    from peft import PeftConfig, get_peft_model
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    if os.path.isdir(os.path.join(adapter_dir, PCT_STATE_DIR)):
        adapter_dir = os.path.join(adapter_dir, PCT_STATE_DIR)
    config = PeftConfig.from_pretrained(adapter_dir)
    if str(getattr(config.peft_type, "value", config.peft_type)) != "PCT":
        raise ValueError(f"{adapter_dir} holds a {config.peft_type} adapter, not PCT")
    config.inference_mode = False
    model = get_peft_model(base_model, config, adapter_name=adapter_name)
    set_peft_model_state_dict(model, load_peft_weights(adapter_dir), adapter_name=adapter_name)
    return model
