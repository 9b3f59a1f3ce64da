"""FSDP2 sharding of a PEFT-wrapped Hugging Face model: what :meth:`peftplug.lightning.PeftModule.configure_model`
applies under Lightning's ``ModelParallelStrategy``.

Units are those of the large-model recipes (torchtitan, torchtune, accelerate's FSDP2 plugin): every module whose
class the model names in ``_no_split_modules`` (its transformer block; PEFT's adapter layers sit inside the blocks'
linear layers, so each unit holds frozen base and trainable adapter parameters together, which FSDP2 allows), then
the transformers model itself as the root unit (embeddings, final norm, head, and adapter tensors outside the
blocks, e.g. steering vectors or ``modules_to_save``). The root is the transformers model and not the
``PeftModel``: ``generate`` calls the transformers model's ``forward`` directly, which must gather the root's
parameters.

Refused, each with a one-line reason (:func:`sharding_refusal`): prompt-learning adapters (PEFT's prompt/prefix/
P-tuning, PCT), int8 bases, and a model with no ``_no_split_modules`` block among its modules. 4-bit bases (QOFT,
QLoRA) shard with bitsandbytes' default ``uint8`` storage: FSDP2 keeps a parameter's dtype per tensor, so the packed
bytes need no float ``quant_storage`` (a float one risks bitsandbytes issue #1945, NaN bit patterns canonicalised in
the gather).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from peftplug.errors import ConfigError

#: ``fsdp_mixed_precision`` choices: the dtype FSDP2 gathers parameters in for forward/backward.
FSDP_MIXED_PRECISIONS = ("none", "bfloat16", "float16")


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a ``PeftModel`` (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _block_classes(base: torch.nn.Module) -> set[str]:
    names = getattr(base, "_no_split_modules", None) or ()
    return {names} if isinstance(names, str) else set(names)


def sharding_refusal(model: torch.nn.Module) -> str | None:
    """Why this model cannot be sharded with FSDP2 by :func:`shard_model`, in one line, or ``None`` if it can.

    Args:
        model: A ``PeftModel`` or a plain transformers model (full finetuning).
    """
    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict) and any(getattr(c, "is_prompt_learning", False) for c in configs.values()):
        # Checked on PEFT 0.21.2: PeftModelForCausalLM.forward and its prepare_inputs_for_generation look up
        # word_embeddings(input_ids) before calling the base model, i.e. outside every FSDP unit's forward, where
        # the embedding is still a sharded DTensor ("aten.embedding.default got mixed torch.Tensor and DTensor").
        return ("prompt-learning adapters (prompt tuning, prefix tuning, P-tuning, PCT) read the base model's "
                "input embedding outside its forward, where FSDP2 has not gathered it; their prompt is tiny, so "
                "train them with strategy: ddp")
    base = _transformers_model(model)
    for name, module in base.named_modules():
        if type(module).__name__ == "Linear8bitLt":
            # FSDP2 gathers an Int8Params shard back as a plain Parameter, without the CB/SCB attributes that
            # Linear8bitLt.forward reads ("'Parameter' object has no attribute 'CB'", bitsandbytes 0.50.2).
            # 4-bit bases do shard: Linear4bit restores its quant_state from the module after the gather.
            return (f"the base is quantized to int8 ({name} is a Linear8bitLt), whose weights lose their "
                    "quantization state when FSDP2 gathers them; use quantization nf4/fp4, or strategy: ddp")
    blocks = _block_classes(base)
    if not any(type(m).__name__ in blocks for m in base.modules()):
        return (f"{type(base).__name__} names no transformer block in _no_split_modules ({sorted(blocks)}) that "
                "its modules contain, so there are no units to shard")
    return None


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :func:`shard_model` wraps, innermost first: each transformer block, then the root.

    Args:
        model: A ``PeftModel`` or a plain transformers model.
    """
    base = _transformers_model(model)
    blocks = _block_classes(base)
    units = [(name, m) for name, m in base.named_modules() if type(m).__name__ in blocks and m is not base]
    # fully_shard must reach a unit before any unit around it (an outer unit takes every parameter not yet
    # sharded, and sharding the inner one afterwards fails inside FSDP2). Some models list a class nested in
    # another listed one (Idefics2: Idefics2MLP inside Idefics2PerceiverLayer); modules() yields the outer first,
    # so deeper names go first. The sort is stable: same-depth blocks keep the model's order.
    units.sort(key=lambda item: -item[0].count("."))
    return [m for _, m in units] + [base]


def mixed_precision_policy(name: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for an ``fsdp_mixed_precision`` name (``None`` for ``"none"``).

    Parameters are gathered and used in ``name``'s dtype; gradients are reduced in fp32, and the shards (what the
    optimizer updates) keep the module's dtype.

    Args:
        name: One of :data:`FSDP_MIXED_PRECISIONS`.
    """
    if name not in FSDP_MIXED_PRECISIONS:
        raise ConfigError(f"model.fsdp_mixed_precision must be one of {', '.join(FSDP_MIXED_PRECISIONS)}; "
                          f"got {name!r}")
    if name == "none":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, name), reduce_dtype=torch.float32)


def data_parallel_mesh(device_mesh: Any) -> Any:
    """The 1-D mesh to shard over: the ``data_parallel`` dimension of Lightning's ``ModelParallelStrategy`` mesh.

    Args:
        device_mesh: The strategy's 2-D ``(data_parallel, tensor_parallel)`` device mesh.

    Raises:
        ConfigError: If the tensor-parallel dimension is larger than 1: peftplug applies no tensor parallelism,
            and Lightning feeds the ranks of one tensor-parallel group the same batches.
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    if "data_parallel" not in names:
        return device_mesh
    tensor_parallel = device_mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
    if tensor_parallel > 1:
        data_parallel = device_mesh["data_parallel"].size()
        raise ConfigError(
            f"trainer.strategy: ModelParallelStrategy got data_parallel_size {data_parallel} and "
            f"tensor_parallel_size {tensor_parallel}; peftplug shards with FSDP2 over the data-parallel dimension "
            f"only, so set data_parallel_size: {data_parallel * tensor_parallel} and tensor_parallel_size: 1")
    return device_mesh["data_parallel"]


def check_checkpoint_files(trainer: Any) -> None:
    """Refuses a ``fit`` under ``ModelParallelStrategy`` with ``save_distributed_checkpoint: true`` (Lightning's
    default), before anything is trained: its checkpoints are ``torch.distributed.checkpoint`` folders, which
    ``--ckpt_path``, ``export`` and ``generate`` cannot read, so a long run would end without a usable adapter.
    ``validate``/``test``/``predict`` write no checkpoint and are let through.

    Args:
        trainer: The Lightning trainer (its strategy a ``ModelParallelStrategy``).

    Raises:
        ConfigError: Naming the setting to change.
    """
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer.state.fn == TrainerFn.FITTING and getattr(trainer.strategy, "_save_distributed_checkpoint", False):
        raise ConfigError(
            "trainer.strategy: ModelParallelStrategy with save_distributed_checkpoint: true (Lightning's default) "
            "writes checkpoints as folders, which peftplug cannot resume or export; set "
            "trainer.strategy.init_args.save_distributed_checkpoint: false (one .ckpt of the adapter, see docs/cli.md)")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a module inside it.

    Args:
        model: Any module.
    """
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def zeroth_order_loss(model: torch.nn.Module, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One forward of a zeroth-order step: ``compute()`` without autograd as a detached fp32 tensor, with every
    FSDP2 unit of ``model`` resharded afterwards.

    FSDP2 keeps the root unit's parameters gathered after its forward, for the backward that would reshard them. A
    zeroth-order step has no backward and updates (and perturbs) the sharded parameters in place between its
    forwards, so a forward that finds the root still gathered runs on stale copies of everything the root holds
    (embeddings, the final norm, ``lm_head``, steering vectors). Every unit is resharded after the forward, and
    before it too: a validation pass (the sanity check, ``val_check_interval``) or any other forward without a
    backward leaves the root gathered as well, and the first perturbed forward of the next step then ran without
    its perturbation of those tensors (a wrong projected gradient after every validation).

    Args:
        model: The model ``compute`` runs (sharded or not).
        compute: Runs the forward and returns the loss.
    """
    _reshard_all(model)
    with torch.no_grad():
        loss = compute().detach().float()
    _reshard_all(model)
    return loss


def _reshard_all(model: torch.nn.Module) -> None:
    """Frees the gathered parameters of every FSDP2 unit in ``model``, so that the next forward gathers the shards
    as they are now (a no-op for a unit already resharded, and without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def shard_model(model: torch.nn.Module, mesh: Any, mixed_precision: str = "none") -> int:
    """Applies FSDP2's ``fully_shard`` to each transformer block, then to the transformers model (the root).

    Args:
        model: A ``PeftModel`` (adapter already attached) or a plain transformers model.
        mesh: A 1-D device mesh (see :func:`data_parallel_mesh`).
        mixed_precision: One of :data:`FSDP_MIXED_PRECISIONS`.

    Returns:
        The number of units (blocks + root).

    Raises:
        ConfigError: If :func:`sharding_refusal` gives a reason, or ``mixed_precision`` is not a choice.
    """
    reason = sharding_refusal(model)
    if reason is not None:
        raise ConfigError(f"FSDP2 (ModelParallelStrategy): {reason}")
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(mixed_precision)
    kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    units = shard_units(model)
    for unit in units:
        fully_shard(unit, **kwargs)
    return len(units)


def local_share(model: torch.nn.Module) -> tuple[int, int]:
    """(elements held on this rank, elements in all) over the model's parameters, counted from local shards.

    Args:
        model: A model after :func:`shard_model` (parameters not sharded count in full on every rank).
    """
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, total


def checkpoint_module_state(path: str | None) -> dict[str, Any]:
    """The module state (``state_dict``) of a full Lightning checkpoint file, memory-mapped, or ``{}``.

    Args:
        path: The checkpoint file (``trainer.ckpt_path``); a distributed checkpoint folder or ``None`` gives ``{}``.
    """
    if path is None or not os.path.isfile(path):
        return {}
    return torch.load(path, mmap=True, map_location="cpu", weights_only=False).get("state_dict", {})


def name_optimizer_states(optimizer_states: list[dict[str, Any]], module: torch.nn.Module) -> None:
    """Keys a sharded run's full optimizer states by parameter name instead of index, in place.

    Lightning 2.6's ``ModelParallelStrategy`` saves a full optimizer state keyed by each parameter's index in
    ``module.parameters()`` (frozen base parameters counted), and on resume re-keys it to names with FSDP1's
    ``rekey_optim_state_dict``, which misreads those indices for FSDP2 modules: with an adapter it restored the
    state of 2 of 6 adapter tensors (and dropped the rest), so the resumed run diverged. States keyed by name are
    passed to ``set_optimizer_state_dict`` as they are.

    Args:
        optimizer_states: The checkpoint's ``optimizer_states`` (empty dicts on ranks other than 0).
        module: The LightningModule whose ``parameters()`` order the indices follow.
    """
    names = [name for name, _ in module.named_parameters()]
    for state in optimizer_states:
        entries = state.get("state") if isinstance(state, dict) else None
        if not entries or not isinstance(next(iter(entries)), int):
            continue
        state["state"] = {names[index]: value for index, value in entries.items()}
        for group in state.get("param_groups", []):
            group["params"] = [names[index] if isinstance(index, int) else index for index in group["params"]]


__all__ = [
    "FSDP_MIXED_PRECISIONS",
    "check_checkpoint_files",
    "checkpoint_module_state",
    "data_parallel_mesh",
    "is_sharded",
    "local_share",
    "mixed_precision_policy",
    "name_optimizer_states",
    "shard_model",
    "shard_units",
    "sharding_refusal",
]
