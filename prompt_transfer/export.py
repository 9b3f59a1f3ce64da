"""Export: collapse a trained PCT adapter into a plain PEFT prompt-tuning adapter.

Task-level attention does not depend on the input, so a trained PCT prompt is one static ``[l, d]`` matrix.
The export writes it in PEFT's own ``PROMPT_TUNING`` format (``adapter_config.json`` +
``adapter_model.safetensors`` with ``prompt_embeddings`` and any ``modules_to_save`` head), which vanilla PEFT
loads without this library, and keeps the full PCT adapter (query, keys, residual, ``P_0``, ``S_k``) in
``pct_state/`` so training can resume from it. An export never writes over a PCT adapter and never leaves a
``pct_state/`` of an earlier export behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from peftplug.fileio import atomic_directory, atomic_write

PCT_STATE_DIR = "pct_state"


def export_prompt_tuning(model, out_dir: str, adapter_name: str | None = None, keep_pct_state: bool = True) -> str:
    """Writes a PCT adapter of ``model`` as a vanilla PEFT prompt-tuning adapter into ``out_dir``.

    The folder then describes this export only: a ``pct_state/`` left by an earlier export is removed first (with
    ``keep_pct_state`` it is replaced by this adapter's state, written last), so :func:`load_pct_for_training` never
    resumes an older adapter. Each file and ``pct_state/`` as a whole are replaced atomically; an interruption leaves
    the top-level prompt with no ``pct_state/`` rather than with a stale one.

    Args:
        model: A ``PeftModel`` with a PCT adapter.
        out_dir: Output directory (created if missing). It must not hold a PCT adapter (a folder written by
            ``save_pretrained``) or any other adapter but an earlier export: the export would replace it.
        adapter_name: The PCT adapter (default: the active one).
        keep_pct_state: Also save the full PCT adapter into ``out_dir/pct_state`` (for resuming).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: If the adapter is not a PCT adapter, or ``out_dir`` holds an adapter other than an earlier
            export.
    """
    from peft.utils import get_peft_model_state_dict

    name = adapter_name or model.active_adapter
    config = model.peft_config[name]
    if str(getattr(config.peft_type, "value", config.peft_type)) != "PCT":
        raise ValueError(f"adapter {name!r} is a {getattr(config.peft_type, 'value', config.peft_type)} adapter, "
                         "not PCT")
    _check_export_dir(out_dir)
    state = get_peft_model_state_dict(model, adapter_name=name)
    with torch.no_grad():
        prompt = model.prompt_encoder[name].embedding.weight.detach()

    def save_state(staging: str) -> None:
        # PEFT saves a non-"default" adapter into a subfolder named after it; load_pct_for_training reads
        # pct_state/ itself, so the files are moved up to it.
        saved = os.path.join(staging, "peft")
        model.save_pretrained(saved, selected_adapters=[name])
        adapter = saved if name == "default" else os.path.join(saved, name)
        for fname in os.listdir(adapter):
            if os.path.isfile(os.path.join(adapter, fname)):
                os.replace(os.path.join(adapter, fname), os.path.join(staging, fname))
        shutil.rmtree(saved)

    _write_export(out_dir, config, state, prompt, save_state if keep_pct_state else None)
    return out_dir


def _check_export_dir(out_dir: str, source_dir: str | None = None) -> None:
    """Refuses an export that would destroy the PCT adapter it comes from (or any PCT adapter).

    Args:
        out_dir: The export directory.
        source_dir: The saved PCT adapter being exported, if it is on disk.

    Raises:
        ValueError: If ``out_dir`` holds a PCT adapter (e.g. it is ``source_dir``) or another adapter that is not an
            earlier export, or ``source_dir`` lies inside ``out_dir/pct_state``, which the export replaces.
    """
    import json

    config_path = os.path.join(out_dir, "adapter_config.json")
    if os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                peft_type = json.load(f).get("peft_type")
        except (OSError, ValueError, AttributeError):
            peft_type = None  # not a readable adapter config: nothing of PCT's to lose there
        if peft_type == "PCT":
            what = "is the PCT adapter being exported" if source_dir is not None and _same_dir(
                source_dir, out_dir) else "holds a PCT adapter"
            raise ValueError(f"the export directory {out_dir} {what}; exporting into it would overwrite that "
                             "adapter with a plain prompt-tuning one: choose another output directory")
        if peft_type is not None and not _is_pct_export(out_dir):
            # Any other adapter (a source prompt, a LoRA) was silently replaced by the target prompt before; only an
            # earlier export, which this one is meant to update, may be written over.
            raise ValueError(f"the export directory {out_dir} holds a {peft_type} adapter that is not an earlier PCT "
                             "export; exporting into it would overwrite that adapter: choose another output directory")
    if source_dir is not None:
        state_dir = os.path.realpath(os.path.join(out_dir, PCT_STATE_DIR))
        if os.path.commonpath([state_dir, os.path.realpath(source_dir)]) == state_dir:
            raise ValueError(f"{source_dir} is the PCT state kept in the export directory {out_dir}, which the "
                             "export replaces: copy it elsewhere first or choose another output directory")


def _is_pct_export(out_dir: str) -> bool:
    """Whether ``out_dir``'s weights were written by an export (their safetensors metadata says so)."""
    from safetensors import safe_open

    try:
        with safe_open(os.path.join(out_dir, "adapter_model.safetensors"), framework="pt") as f:
            return (f.metadata() or {}).get("exported_from") == "PCT"
    except Exception:  # noqa: BLE001  (missing or unreadable: not an export's)
        return False


def _same_dir(a: str, b: str) -> bool:
    """Whether two paths name one folder (``out`` and ``out/``, or a symlink to it)."""
    return os.path.realpath(a) == os.path.realpath(b)


def _write_export(out_dir: str, config, state: dict, prompt: torch.Tensor, write_state=None) -> None:
    """Writes an export: drops any earlier ``pct_state/``, writes the prompt-tuning files, then the new state.

    This order keeps every intermediate folder consistent: a crash leaves the old or the new top-level files
    with no ``pct_state/``, never a top-level prompt next to the state of another adapter.

    Args:
        out_dir: The export directory.
        config: The PCT adapter's config.
        state: Its PEFT state dict (prompt-tuning heads are kept, PCT's own tensors dropped).
        prompt: The static prompt ``[l * submodules, d]``.
        write_state: ``write_state(staging_dir)`` writes the PCT adapter's files; ``None`` keeps no state.
    """
    os.makedirs(out_dir, exist_ok=True)
    state_dir = os.path.join(out_dir, PCT_STATE_DIR)
    if os.path.lexists(state_dir):
        # Rename first (atomic), delete after: a reader sees the old state or none, never half of it.
        aside = tempfile.mkdtemp(prefix=f".{PCT_STATE_DIR}.", suffix=".old", dir=out_dir)
        os.replace(state_dir, os.path.join(aside, PCT_STATE_DIR))
        shutil.rmtree(aside, ignore_errors=True)
    _write_prompt_tuning(out_dir, config, state, prompt)
    if write_state is not None:
        with atomic_directory(state_dir) as staging:
            write_state(str(staging))


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


#: A saved adapter's own files, which the export writes itself (the rest of the folder is copied beside them).
_ADAPTER_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md"})


def export_adapter_dir(pct_dir: str, out_dir: str, keep_pct_state: bool = True) -> str:
    """File-to-file export of a saved PCT adapter (no base model needed: the prompt depends only on PCT's state).

    Args:
        pct_dir: Directory of a saved PCT adapter (``save_pretrained`` or ``peftplug export``).
        out_dir: Output directory, as for :func:`export_prompt_tuning`; neither ``pct_dir`` itself nor the folder
            whose ``pct_state/`` ``pct_dir`` is (the export would overwrite or delete its own source).
        keep_pct_state: Copy the PCT adapter into ``out_dir/pct_state``.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: If ``pct_dir`` is not a PCT adapter, or ``out_dir`` is refused as above.
    """
    from peft import PeftConfig
    from peft.utils import load_peft_weights

    from prompt_transfer.model import PCTPromptEncoder

    config = PeftConfig.from_pretrained(pct_dir)
    if str(getattr(config.peft_type, "value", config.peft_type)) != "PCT":
        raise ValueError(f"{pct_dir} holds a {getattr(config.peft_type, 'value', config.peft_type)} adapter, not PCT")
    _check_export_dir(out_dir, source_dir=pct_dir)
    state = load_peft_weights(pct_dir)
    encoder = PCTPromptEncoder(config)
    encoder._load_adapter_state_dict(state)
    with torch.no_grad():
        prompt = encoder.embedding.weight

    def copy_state(staging: str) -> None:
        for fname in os.listdir(pct_dir):
            if os.path.isfile(os.path.join(pct_dir, fname)):
                shutil.copy2(os.path.join(pct_dir, fname), os.path.join(staging, fname))

    _write_export(out_dir, config, state, prompt, copy_state if keep_pct_state else None)
    # What `peftplug export` writes beside the adapter (peftplug_base.json: the base's quantization and dtype; the
    # tokenizer) goes to the top level too: peftplug.load_adapter(name, export) reads them there, and without the
    # record it loaded a float32 unquantized base for an nf4- or bf16-trained target.
    for fname in sorted(os.listdir(pct_dir)):
        src = os.path.join(pct_dir, fname)
        if os.path.isfile(src) and fname not in _ADAPTER_FILES:
            atomic_write(os.path.join(out_dir, fname), lambda tmp, src=src: shutil.copy2(src, tmp))
    return out_dir


def load_pct_for_training(base_model, adapter_dir: str, adapter_name: str = "default"):
    """Rebuilds a trainable PCT adapter from a saved one (PEFT refuses ``is_trainable=True`` for prompt learning).

    Accepts a PCT adapter directory or an export directory (then its ``pct_state/`` is used, whatever the
    adapter's name was; an export without one holds no PCT state and is refused). The saved state
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

    state_dir = os.path.join(adapter_dir, PCT_STATE_DIR)
    if os.path.isdir(state_dir):
        adapter_dir = state_dir
        if not os.path.isfile(os.path.join(state_dir, "adapter_config.json")):
            # Older exports of a non-"default" adapter kept it where PEFT saves named adapters: pct_state/<name>/.
            nested = [d for d in sorted(os.listdir(state_dir))
                      if os.path.isfile(os.path.join(state_dir, d, "adapter_config.json"))]
            if len(nested) == 1:
                adapter_dir = os.path.join(state_dir, nested[0])
    config = PeftConfig.from_pretrained(adapter_dir)
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if peft_type != "PCT":
        hint = (" (an export written with keep_pct_state=False keeps no PCT state to resume from)"
                if peft_type == "PROMPT_TUNING" else "")
        raise ValueError(f"{adapter_dir} holds a {peft_type} adapter, not PCT{hint}")
    config.inference_mode = False
    # The saved state holds P_0 and S_k and is loaded right below: the folder at decomposition_path is not read (a
    # training-mode encoder would load and check it, and a folder decomposed again since, with another K or prompt
    # length, refused the resume). The path stays recorded in the config for the adapter saved next.
    path, config.decomposition_path = config.decomposition_path, None
    try:
        model = get_peft_model(base_model, config, adapter_name=adapter_name)
    finally:
        config.decomposition_path = path
    model.peft_config[adapter_name].decomposition_path = path
    model.prompt_encoder[adapter_name].embedding.decomposition_path = path
    set_peft_model_state_dict(model, load_peft_weights(adapter_dir), adapter_name=adapter_name)
    return model
