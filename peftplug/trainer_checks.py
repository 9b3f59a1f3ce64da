"""Checks of ``trainer.accelerator``, ``trainer.strategy`` and ``trainer.devices`` against the machine at hand.

Lightning refuses an unavailable accelerator or strategy in several ways — a ``ModuleNotFoundError`` for
``tpu`` without ``torch_xla``, ``TypeError`` for device lists on the CPU, messages that do not say which setting to
change — and accepts 64 CPU processes on a 2-core machine. :func:`check_trainer_settings` says what is wrong in
one :class:`peftplug.errors.ConfigError` that names the field and what this machine has, before Lightning builds
anything (and refuses ``max_steps`` / ``max_epochs`` of 0, which train nothing). Settings given as objects (an ``Accelerator`` or ``Strategy`` instance) are left to Lightning, except a ``ModelParallelStrategy``'s sizes.
"""

from __future__ import annotations

import os
from typing import Any

from peftplug.errors import ConfigError

# Why an accelerator Lightning knows is not usable here, by name.
_NEEDS = {
    "cuda": "no CUDA device is visible",
    "gpu": "it needs CUDA or Apple MPS and neither is available",
    "mps": "it needs Apple silicon (MPS)",
    "tpu": "it needs a TPU and torch_xla",
}
FSDP2 = "lightning.pytorch.strategies.ModelParallelStrategy"


def _accelerators() -> dict[str, bool]:
    """Lightning's accelerator names and whether each is available here."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    found = {}
    for name in sorted(AcceleratorRegistry.available_accelerators()):
        try:
            found[name] = bool(AcceleratorRegistry[name]["accelerator"].is_available())
        except (ImportError, RuntimeError, OSError):  # a probe that fails (a broken optional package): unusable
            found[name] = False
    return found


def _resolve_accelerator(accelerator: Any, available: dict[str, bool]) -> str | None:
    """The accelerator Lightning would use (``cuda``, ``mps``, ``tpu``, ``cpu``), or ``None`` for an object."""
    if not isinstance(accelerator, str):
        return None
    name = accelerator.lower()
    usable = [n for n, ok in available.items() if ok]
    if name == "auto":
        return next((n for n in ("cuda", "mps", "tpu") if available.get(n)), "cpu")
    if name == "gpu":
        gpu = next((n for n in ("cuda", "mps") if available.get(n)), None)
        if gpu is None:
            raise ConfigError(f"trainer.accelerator: 'gpu' is not available on this machine ({_NEEDS['gpu']}); "
                              f"available: {', '.join(usable)}")
        return gpu
    if name not in available:
        raise ConfigError(f"trainer.accelerator: {accelerator!r} is not an accelerator; accepted: auto, gpu, "
                          f"{', '.join(available)} (available on this machine: {', '.join(usable)})")
    if not available[name]:
        raise ConfigError(f"trainer.accelerator: {accelerator!r} is not available on this machine "
                          f"({_NEEDS.get(name, 'Lightning reports it unavailable')}); available: {', '.join(usable)}")
    return name


def _check_strategy(strategy: Any, accelerator: str | None) -> None:
    if not isinstance(strategy, str) or accelerator is None:
        return
    name = strategy.lower()
    if name.startswith("fsdp") and accelerator != "cuda":
        raise ConfigError(
            f"trainer.strategy: {strategy!r} (Lightning's FSDP strategy) needs CUDA and the accelerator here is "
            f"{accelerator}; to shard with FSDP2 use strategy: {{class_path: {FSDP2}}} (see docs/cli.md), or "
            "'ddp' / 'auto'"
        )
    if name.startswith("deepspeed"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"trainer.strategy: {strategy!r} needs the deepspeed package, which is not installed "
                              "(pip install deepspeed; it also needs CUDA)")
    if (name.startswith("xla") or name in ("single_xla", "single_tpu")) and accelerator != "tpu":
        raise ConfigError(f"trainer.strategy: {strategy!r} needs a TPU (accelerator: tpu) and the accelerator here "
                          f"is {accelerator}")


def _device_count(accelerator: str) -> int:
    import torch

    if accelerator == "cuda":
        return torch.cuda.device_count()
    if accelerator == "cpu":
        return os.cpu_count() or 1
    return 1


def _check_devices(devices: Any, accelerator: str | None) -> None:
    if devices is None or accelerator is None:
        return
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return
        try:
            devices = int(text)
        except ValueError:
            if accelerator == "cpu":
                raise ConfigError(f"trainer.devices: {devices!r} is not a number of processes; with the cpu "
                                  "accelerator give a number >= 1 or 'auto'") from None
            return  # "0,1" device indices: Lightning parses and checks them
    if isinstance(devices, (list, tuple)):
        if accelerator == "cpu":
            raise ConfigError(f"trainer.devices: {list(devices)} are device indices, which the cpu accelerator "
                              "does not have; give a number of processes (>= 1)")
        count = _device_count(accelerator)
        missing = [d for d in devices if not isinstance(d, int) or not 0 <= d < count]
        if missing:
            raise ConfigError(f"trainer.devices: {list(devices)} names devices this machine does not have (it has "
                              f"{count} {accelerator} device(s): indices 0 to {count - 1})")
        return
    if not isinstance(devices, int) or isinstance(devices, bool):
        return
    if devices == 0 or devices < -1:
        raise ConfigError(f"trainer.devices must be >= 1, -1 (all) or 'auto'; got {devices}")
    count = _device_count(accelerator)
    if devices == -1 and accelerator == "cpu":
        # Lightning's CPU accelerator takes no -1: a TypeError traceback ("should be an int > 0") after the model
        # was loaded.
        raise ConfigError(f"trainer.devices: -1 (all devices) is not accepted with the cpu accelerator; give a "
                          f"number of processes from 1 to {count} (this machine's CPU cores) or 'auto' (1)")
    if devices > count:
        unit = "CPU cores" if accelerator == "cpu" else f"{accelerator} device(s)"
        raise ConfigError(f"trainer.devices: {devices} requested but this machine has {count} {unit}; "
                          f"use devices <= {count}")


def _check_length(max_steps: Any, max_epochs: Any) -> None:
    # Lightning takes -1 for "no limit" and None for its default; 0 trains nothing, which is never what was meant.
    if isinstance(max_steps, int) and (max_steps == 0 or max_steps < -1):
        raise ConfigError(f"trainer.max_steps must be >= 1, or -1 for no step limit; got {max_steps}")
    if isinstance(max_epochs, int) and (max_epochs == 0 or max_epochs < -1):
        raise ConfigError(f"trainer.max_epochs must be >= 1, or -1 for no epoch limit; got {max_epochs}")


def _processes_per_node(devices: Any, accelerator: str) -> int | None:
    """How many processes Lightning starts per node for ``devices``, or ``None`` where this module cannot tell."""
    if isinstance(devices, str):
        text = devices.strip()
        if text != "auto":
            try:
                devices = int(text)
            except ValueError:
                return None  # "0,1" device indices: Lightning parses them
    if devices is None or devices == "auto":
        return 1 if accelerator == "cpu" else (_device_count(accelerator) if accelerator == "cuda" else None)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices == -1:
            return _device_count(accelerator) if accelerator == "cuda" else None
        return devices if devices >= 1 else None
    return None


def _check_model_parallel(strategy: Any, devices: Any, accelerator: str | None, num_nodes: Any) -> None:
    """Refuses ``ModelParallelStrategy`` sizes that do not fit the run, before Lightning starts any process.

    Lightning checks ``data_parallel_size * tensor_parallel_size == world size`` only inside every launched process,
    after the model was loaded there (one ``RuntimeError`` traceback per rank); and peftplug shards over the
    data-parallel dimension only, so a tensor-parallel size above 1 (``auto``: every device of a node) is refused
    later anyway (:func:`peftplug.sharding.data_parallel_mesh`).
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if accelerator is None or not isinstance(strategy, ModelParallelStrategy):
        return
    per_node = _processes_per_node(devices, accelerator)
    if per_node is None:
        return
    nodes = num_nodes if isinstance(num_nodes, int) and not isinstance(num_nodes, bool) and num_nodes >= 1 else None
    data, tensor = strategy._data_parallel_size, strategy._tensor_parallel_size
    if tensor == "auto":
        tensor = per_node  # Lightning's resolution
    if data == "auto":
        data = nodes  # Lightning's resolution; None: unknown here
    if not isinstance(tensor, int) or isinstance(tensor, bool) or not (
            data is None or isinstance(data, int) and not isinstance(data, bool)):
        return  # Lightning's own type checks
    # With the node count unknown the world size is only known to be a multiple of the processes per node.
    if data is None:
        fits = True
    else:
        fits = data * tensor == per_node * nodes if nodes is not None else data * tensor % per_node == 0
    if tensor != 1 or not fits:
        data = "auto (trainer.num_nodes)" if data is None else data
        world = (f"{per_node * nodes}" if nodes is not None else
                 f"a multiple of {per_node}") + ": trainer.devices x trainer.num_nodes"
        target = f"{per_node * nodes}" if nodes is not None else f"{per_node} on one node, the number of processes"
        raise ConfigError(
            f"trainer.strategy: ModelParallelStrategy got data_parallel_size {data} and tensor_parallel_size "
            f"{tensor}, whose product must be the number of processes ({world}), and peftplug shards over the "
            f"data-parallel dimension only; set data_parallel_size: {target} and tensor_parallel_size: 1")


def check_trainer_settings(accelerator: Any = "auto", strategy: Any = "auto", devices: Any = "auto",
                           max_steps: Any = -1, max_epochs: Any = None, num_nodes: Any = None) -> None:
    """Raises ``ConfigError`` for an accelerator, strategy or device count this machine cannot run, or a run
    length that trains nothing.

    Args:
        accelerator: ``trainer.accelerator`` (a name, or an ``Accelerator`` object, which is not checked).
        strategy: ``trainer.strategy`` (a name; of the ``Strategy`` objects only a ``ModelParallelStrategy``'s
            sizes are checked, against ``devices`` and ``num_nodes``).
        devices: ``trainer.devices`` (a number, ``-1``, ``'auto'``, or device indices).
        max_steps: ``trainer.max_steps`` (>= 1 or -1).
        max_epochs: ``trainer.max_epochs`` (>= 1, -1 or ``None``).
        num_nodes: ``trainer.num_nodes`` (>= 1), or ``None`` when unknown (then sizes are checked per node only).
    """
    _check_length(max_steps, max_epochs)
    resolved = _resolve_accelerator(accelerator if accelerator is not None else "auto", _accelerators())
    _check_strategy(strategy, resolved)
    _check_devices(devices, resolved)
    _check_model_parallel(strategy, devices, resolved, num_nodes)


_TIMEDELTA_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def check_trainer_values(trainer: Any, seed: Any = None) -> None:
    """Refuses trainer values that Lightning fails on with a traceback (not a message), before anything is built.

    ``val_check_interval: 0`` and ``check_val_every_n_epoch: 0`` were a ``ZeroDivisionError`` in the training loop,
    a ``val_check_interval`` or ``max_time`` dict with a key ``timedelta`` does not take a ``TypeError``, and a
    negative ``seed_everything`` numpy's ``ValueError``.

    Args:
        trainer: The ``trainer`` section of the parsed config (``None``: only the seed is checked).
        seed: The ``seed_everything`` setting (``None``, a bool or an int).

    Raises:
        ConfigError: Naming the field and the accepted values.
    """
    if seed is not None and not isinstance(seed, bool) and not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise ConfigError(f"seed_everything must be true/false or an int in [0, 2**32 - 1]; got {seed!r}")
    get = trainer.get if hasattr(trainer, "get") else lambda key, default=None: default
    interval = get("val_check_interval")
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and not interval > 0:
        raise ConfigError(f"trainer.val_check_interval must be an int >= 1 (batches) or a float in (0, 1] (a fraction "
                          f"of the epoch); got {interval!r} (to skip validation set trainer.limit_val_batches: 0)")
    every = get("check_val_every_n_epoch")
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise ConfigError(f"trainer.check_val_every_n_epoch must be an int >= 1, or null to validate by "
                          f"val_check_interval only; got {every!r}")
    for key in ("val_check_interval", "max_time"):
        value = get(key)
        if isinstance(value, dict) and (not value or set(value) - set(_TIMEDELTA_KEYS)):
            raise ConfigError(f"trainer.{key}: a duration dict takes the keys {', '.join(_TIMEDELTA_KEYS)}; "
                              f"got {value!r}")


__all__ = ["check_trainer_settings", "check_trainer_values"]


def check_zeroth_order_trainer(trainer: Any) -> None:
    """Refuses trainer settings a zeroth-order run (manual optimization, one step per batch) cannot honour.

    Both reached the run unrefused: PeftModule switches to manual optimization in ``configure_optimizers``, after
    Lightning's own check of manual optimization against gradient accumulation has run.

    - ``accumulate_grad_batches > 1``: every batch stepped anyway, while the run's length (HELENE's ``anneal_horizon:
      auto``, scheduler lengths) was sized for one step per window: a OneCycleLR raised mid-run.
    - A gradient scaler (``precision: 16-mixed`` on a GPU): Lightning's plugin runs the closure itself and then
      unscales a loss that was never scaled (an ``AssertionError`` from ``GradScaler.unscale_``).
    - ``gradient_clip_val``: there are no gradients to clip; Lightning refuses clipping under manual optimization,
      but checked before the switch, so it was silently ignored.

    Args:
        trainer: The Lightning trainer.

    Raises:
        ConfigError: Naming the setting and what to use instead.
    """
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ConfigError(f"trainer.accumulate_grad_batches: a zeroth-order optimizer steps once per batch, got "
                          f"{accumulate}; use 1 and a larger data.batch_size instead")
    if getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None:
        raise ConfigError(f"trainer.precision: a zeroth-order optimizer takes no gradient scaler, got "
                          f"{trainer.precision!r}; use bf16-mixed or 32-true")
    if getattr(trainer, "gradient_clip_val", None):
        raise ConfigError(f"trainer.gradient_clip_val: a zeroth-order optimizer has no gradients to clip, got "
                          f"{trainer.gradient_clip_val}; leave it unset (null or 0)")
