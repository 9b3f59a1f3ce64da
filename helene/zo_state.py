"""Checkpoint state of the zeroth-order optimizers: torch's per-parameter state plus a ``"zeroth_order"`` entry.

The entry holds what an exact resume needs besides the tensors: step counters and the private seed generator
(subclasses add theirs, e.g. HELENE's scalar second moments). ``torch.distributed.checkpoint``'s optimizer state
dict (``get/set_optimizer_state_dict``, through which Lightning's ``ModelParallelStrategy`` saves and resumes FSDP2
runs) keeps only ``state`` and ``param_groups``: the entry is then saved and restored on the side
(:meth:`ZerothOrderState.zeroth_order_state`, :meth:`ZerothOrderState.load_zeroth_order_state`; peftplug's
``PeftModule`` does it), and a step refuses to run until it was.
"""

from __future__ import annotations

from typing import Any

import torch

from peftplug.errors import ConfigError

_HOW_TO_RESUME = ("restore it with load_zeroth_order_state(saved['zeroth_order']) before the next step "
                  "(peftplug's PeftModule does so for its checkpoints); a checkpoint written without it cannot "
                  "be resumed exactly: start the run again")


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 shard), without importing torch.distributed when unused."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


class ZerothOrderState:
    """Mixin of :class:`helene.zo.ZerothOrderOptimizer`: ``state_dict``/``load_state_dict`` with the extra entry.

    Subclasses extend :meth:`zeroth_order_state` and :meth:`load_zeroth_order_state`, not the two torch methods.
    """

    #: Set when torch's tensors were loaded without the "zeroth_order" entry (FSDP2); cleared once it is restored.
    _zeroth_order_missing = False

    def zeroth_order_state(self) -> dict[str, Any]:
        """The ``"zeroth_order"`` entry of :meth:`state_dict`: step counters and the seed generator's state."""
        return {
            "step_count": self.step_count, "update_count": self.update_count,
            "skipped_nonfinite": self.skipped_nonfinite, "forward_passes": self.forward_passes, "seed": self.seed,
            "generator_state": self._seed_gen.get_state(),
        }

    def load_zeroth_order_state(self, zo: dict[str, Any]) -> None:
        """Restores a :meth:`zeroth_order_state` (after the tensors were loaded by ``load_state_dict``).

        Args:
            zo: The saved entry.
        """
        self.step_count = int(zo["step_count"])
        self.update_count = int(zo["update_count"])
        self.skipped_nonfinite = int(zo["skipped_nonfinite"])
        # Checkpoints written before the counter existed: two closure calls a step (exact unless a curvature
        # estimator added centre passes).
        self.forward_passes = int(zo.get("forward_passes", 2 * self.step_count))
        self.seed = int(zo["seed"])
        # A CPU generator takes a CPU state; a trainer may have moved the whole dict to the accelerator.
        self._seed_gen.set_state(zo["generator_state"].to("cpu"))
        self._zeroth_order_missing = False

    def check_zeroth_order_loaded(self) -> None:
        """Raises ValueError if the last ``load_state_dict`` came without the ``"zeroth_order"`` entry and it was
        not restored since: stepping on would silently leave the uninterrupted run's seeds and counters."""
        if self._zeroth_order_missing:
            raise ConfigError("the optimizer state was loaded without its 'zeroth_order' entry (step counters, "
                              "seed generator), which torch.distributed.checkpoint's optimizer state dict drops; "
                              + _HOW_TO_RESUME)

    def state_dict(self) -> dict:
        """The torch state (per-parameter tensors, groups) plus ``"zeroth_order"``: :meth:`zeroth_order_state`."""
        sd = super().state_dict()
        sd["zeroth_order"] = self.zeroth_order_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores :meth:`state_dict`'s output, so that the next step equals the uninterrupted run's.

        A dict without ``"zeroth_order"`` is refused, except for FSDP2 (sharded) parameters, where
        ``torch.distributed.checkpoint`` loads the tensors alone: the entry must then come through
        :meth:`load_zeroth_order_state` before the next step (which raises otherwise).

        Args:
            state_dict: A dict from :meth:`state_dict` of an optimizer with the same parameter layout.
        """
        state_dict = dict(state_dict)
        zo = state_dict.pop("zeroth_order", None)
        params = [p for g in self.param_groups for p in g["params"]]
        if zo is None and not any(is_dtensor(p) for p in params):
            raise ValueError("state_dict has no 'zeroth_order' entry: it was not saved by a zeroth-order "
                             f"optimizer (keys: {sorted(state_dict)})")
        saved_state = state_dict.get("state", {})
        saved_ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
        super().load_state_dict(state_dict)
        self._master_versions = {}  # masters replaced: the next step compares them with the parameters
        # torch casts loaded state to each parameter's dtype; fp32 masters and moments of fp16/bf16 parameters
        # must keep their saved fp32 values bit for bit, so they are put back from the saved dict.
        for idx, p in zip(saved_ids, params):
            for key, value in saved_state.get(idx, {}).items():
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    self.state[p][key] = value.to(device=p.device, copy=True)
        if zo is None:
            self._zeroth_order_missing = True
        else:
            self.load_zeroth_order_state(zo)
