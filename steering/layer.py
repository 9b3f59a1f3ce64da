"""The steering tuner layer: wraps one decoder block and edits the hidden state it returns."""

from __future__ import annotations

import warnings

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from peftplug.adapter_params import PARAM_NAME, AdapterParameterDict
from peftplug.parameter_writes import managed_by_fsdp, write_count
from steering.config import SteeringConfig
from steering.positions import NOTHING, SteeringContext

_EPS = 1e-12


def _get_submodule(module: nn.Module, path: str | None) -> nn.Module | None:
    if not path:
        return None
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


try:
    # transformers >= 5 records ``hidden_states`` with forward hooks on the decoder-layer *class*
    # (``_can_record_outputs``), filling the dict held by this context variable. PEFT wraps each steered block, so
    # that hook sits on the inner block and records the block's output *before* this layer steers it. Older
    # versions collect what the blocks return in the model's loop (already steered) and have no such module.
    from transformers.utils.output_capturing import _active_collector as _COLLECTOR
except ImportError:  # pragma: no cover - transformers < 5
    _COLLECTOR = None


def _report_steered(hidden: torch.Tensor, steered: torch.Tensor) -> None:
    """Makes ``output_hidden_states`` report this block's *steered* output.

    The inner block's capture hook appended exactly ``hidden`` (the same tensor object) as the last entry when
    this block's output was being recorded; it is swapped for ``steered``. The identity check leaves every other
    case alone: hidden states not requested, this index not selected (transformers appends ``None``), or a
    recording scheme this code does not know.
    """
    if _COLLECTOR is None:
        return
    try:
        collected = _COLLECTOR.get()
    except Exception:  # noqa: BLE001 - an internal API that may change; then report what transformers recorded
        return
    if not collected:
        return
    recorded = collected.get("hidden_states")
    if isinstance(recorded, list) and recorded and recorded[-1] is hidden:
        recorded[-1] = steered


class SteeringLayer(nn.Module, BaseTunerLayer):
    """A decoder block with steering vectors applied to its output hidden state.

    Each adapter owns one trainable vector ``steer_vector[adapter]`` of shape ``[hidden_size]`` (a normal PEFT
    parameter, so optimizers and Lightning train it like any adapter weight) and its operator, position policy
    and multiplier. Several active adapters are applied one after another; for ``"add"`` they add up. The vector's
    parameter is named ``<block>.steer_vector.<adapter>.weight`` (:class:`peftplug.adapter_params.AdapterParameterDict`,
    PEFT's module-based layout), so TRL's ``.default.`` -> ``.ref.`` copy of a trained adapter reaches it.

    Args:
        base_layer: The decoder block being wrapped.
        adapter_name: Name of the first adapter.
        layer_index: 0-based index of the block.
        context: The model's shared :class:`~steering.positions.SteeringContext`.
        config: The adapter's :class:`~steering.config.SteeringConfig`.
        hidden_size: Residual-stream width.
        bias_proj: Path (inside the block) of the module whose bias ``merge`` folds ``"add"`` vectors into.
        bias_scale: Factor applied to ``m v`` before folding (``1 / residual_multiplier`` for Granite).
        merge_refusal: Why no bias of this block can hold the shift exactly (``merge`` then raises it).
    """

    adapter_layer_names = ("steer_vector",)
    other_param_names = ("steer_multiplier", "steer_operator", "steer_positions", "steer_normalize")

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        layer_index: int,
        context: SteeringContext,
        config: SteeringConfig,
        hidden_size: int,
        bias_proj: str | None = None,
        bias_scale: float = 1.0,
        merge_refusal: str | None = None,
    ):
        super().__init__()
        self.base_layer = base_layer
        self.layer_index = layer_index
        self.hidden_size = hidden_size
        self.bias_proj = bias_proj
        self.bias_scale = float(bias_scale)
        self.merge_refusal = merge_refusal
        # A plain attribute (not a submodule): the context is shared by all layers of the model.
        self.steer_context = context
        # `steer_vector.<adapter>.weight`, not a ParameterDict's `steer_vector.<adapter>`: TRL builds a DPO reference
        # by copying parameters whose names contain `.default.` (see peftplug.adapter_params).
        self.steer_vector = AdapterParameterDict()
        self.steer_multiplier: dict[str, float] = {}
        self.steer_operator: dict[str, str] = {}
        self.steer_positions: dict[str, str] = {}
        self.steer_normalize: dict[str, bool] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self._created_bias = False
        # The bias as it was before the first merge: unmerge restores it, so it undoes exactly what was merged
        # even if a multiplier or vector changed meanwhile (and without float round-off from add-then-subtract).
        self._bias_before_merge: torch.Tensor | None = None
        self._plan: tuple | None = None  # see _add_plan
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)

    def __getattr__(self, name: str):
        """Attributes of the wrapped block that the model reads from each layer (e.g. Qwen2's ``attention_type``
        in transformers 5.0) resolve through to it, as they would without the adapter.

        Args:
            name: The attribute looked up.
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_layer" or "base_layer" not in self._modules:
                raise
            return getattr(self._modules["base_layer"], name)

    def update_layer(self, adapter_name: str, config: SteeringConfig) -> None:
        """Adds (or re-configures) ``adapter_name`` on this block; the vector starts at zero.

        Args:
            adapter_name: Adapter name.
            config: Its configuration.
        """
        if adapter_name not in self.steer_vector:
            ref = next(self.base_layer.parameters(), None)
            device = ref.device if ref is not None else None
            self.steer_vector[adapter_name] = nn.Parameter(torch.zeros(self.hidden_size, device=device))
        self.steer_multiplier[adapter_name] = config.layer_multiplier(self.layer_index)
        self.steer_operator[adapter_name] = config.operator
        self.steer_positions[adapter_name] = config.positions
        self.steer_normalize[adapter_name] = bool(config.normalize)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def set_vector(self, adapter_name: str, vector: torch.Tensor) -> None:
        """Copies ``vector`` into the adapter's parameter (shape ``[hidden_size]``).

        Args:
            adapter_name: Adapter name.
            vector: The steering vector.
        """
        vector = torch.as_tensor(vector).detach().reshape(-1)
        if vector.numel() != self.hidden_size:
            raise ValueError(
                f"steering vector for layer {self.layer_index} has {vector.numel()} entries, but the model's "
                f"hidden size is {self.hidden_size}"
            )
        param = self.steer_vector[adapter_name]
        with torch.no_grad():
            param.copy_(vector.to(device=param.device, dtype=param.dtype))

    def _effective_vector(self, adapter_name: str, dtype: torch.dtype) -> torch.Tensor:
        v = self.steer_vector[adapter_name]
        if self.steer_normalize[adapter_name]:
            v = v / v.norm().clamp_min(_EPS)
        return v.to(dtype)

    def _add_plan(self, dtype: torch.dtype) -> list | None:
        """Per active ``"add"`` adapter ``(policy, multiplier * v)``, or ``None`` when another operator is active.

        Built once and reused across decoding steps (no gradient is recorded then): the per-step work is then
        one (masked) add per adapter. The plan is checked against everything it was built from on each call,
        with plain dict/attribute reads only, so changing a vector, multiplier, policy or the active adapters
        invalidates it, and so does any optimizer step (fused ones write the vectors without bumping their
        version) or a call of :func:`peftplug.parameter_writes.parameters_written`, which whoever writes the vectors
        in place through ``param.data`` (bypassing the version counter) must make.
        """
        active = self._active_adapter
        if active.__class__ is not str:
            active = tuple(active)
        plan = self._plan
        writes = write_count()
        if (plan is not None and plan[0] == active and plan[1] == dtype and plan[2] == self.merged_adapters
                and plan[6] == writes):
            # The container's and each holder's own dicts: a module attribute lookup costs more than the add. The
            # holder must still be the adapter's and hold this very parameter (PEFT's dtype/device moves and
            # `load_state_dict(assign=True)` put a new one in), which catches what ParameterDict identity did.
            holders = plan[5]
            for name, holder, param, version, ptr, m, policy, normalize, _ in plan[3]:
                if (holders.get(name) is not holder or holder._parameters.get(PARAM_NAME) is not param
                        or param._version != version or param.data_ptr() != ptr
                        or self.steer_multiplier.get(name) != m or self.steer_positions.get(name) != policy
                        or self.steer_normalize.get(name) != normalize or self.steer_operator.get(name) != "add"):
                    break
            else:
                return plan[4]
        entries = []
        for name in self.active_adapters:
            if name not in self.steer_vector or name in self.merged_adapters:
                continue
            if self.steer_operator[name] != "add":
                self._plan = None
                return None
            holder = self.steer_vector._modules[name]
            param, m = holder._parameters[PARAM_NAME], self.steer_multiplier[name]
            with torch.no_grad():
                delta = self._effective_vector(name, dtype) * m
            entries.append((name, holder, param, param._version, param.data_ptr(), m, self.steer_positions[name],
                            self.steer_normalize[name], delta))
        steps = [(e[6], e[8]) for e in entries]
        # Which adapters are merged (not how many): unmerge a, merge b keeps the count but changes what to add.
        self._plan = (active, dtype, list(self.merged_adapters), entries, steps, self.steer_vector._modules, writes)
        return steps

    def steer(self, hidden: torch.Tensor) -> torch.Tensor:
        """Applies every active adapter of this block to ``hidden`` (``[batch, seq, hidden]``).

        Args:
            hidden: The block's output hidden state.
        """
        context = self.steer_context
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling() and not managed_by_fsdp(self):
            # Decoding hot path: a cached scaled vector and one fused (masked) add per adapter. Eager only: the
            # cache's validity check reads data pointers, which dynamo cannot trace, and a compiled graph gains
            # nothing from it (the general path below computes the same adds). Not under FSDP, whose gathered
            # vectors keep version and address across a write to the shards.
            plan = self._add_plan(hidden.dtype)
            if plan is not None:
                for policy, delta in plan:
                    mask = context.mask(policy, hidden.dtype)
                    if mask is None:
                        hidden = hidden + delta
                    elif mask is not NOTHING:
                        hidden = torch.addcmul(hidden, mask, delta)
                return hidden
        for name in self.active_adapters:
            if name not in self.steer_vector or name in self.merged_adapters:
                continue
            mask = context.mask(self.steer_positions[name], hidden.dtype)
            if mask is NOTHING:
                continue
            m = self.steer_multiplier[name]
            op = self.steer_operator[name]
            if op == "add":
                delta = self._effective_vector(name, hidden.dtype) * m
                hidden = hidden + delta if mask is None else torch.addcmul(hidden, mask, delta)
                continue
            v = self._effective_vector(name, hidden.dtype)
            unit = v / v.norm().clamp_min(_EPS)
            proj = (hidden @ unit)[..., None] * unit
            delta = -m * proj if op == "ablate" else m * v - proj
            hidden = hidden + (delta if mask is None else mask * delta)
        return hidden

    def forward(self, *args, **kwargs):
        if self._disable_adapters:
            # PEFT's convention (LoRA does the same): a disabled layer gives the base block, so merged vectors are
            # taken out of the bias first; after re-enabling they are applied unmerged, with the same result.
            if self.merged:
                self.unmerge()
            return self.base_layer(*args, **kwargs)
        out = self.base_layer(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        steered = self.steer(hidden)
        if steered is not hidden:
            _report_steered(hidden, steered)
        return (steered,) + tuple(out[1:]) if isinstance(out, tuple) else steered

    # ------------------------------------------------------------------------------------------ merging
    def _bias_module(self) -> nn.Module:
        if self.merge_refusal:
            raise ValueError(self.merge_refusal)
        proj = _get_submodule(self.base_layer, self.bias_proj)
        if proj is None or getattr(proj, "weight", None) is None:
            raise ValueError(
                f"cannot merge a steering vector into block {self.layer_index}: no residual output projection "
                f"{self.bias_proj!r} is known for it (steering.families.register_family(..., bias_proj=...))"
            )
        return proj

    def check_mergeable(self, adapter_names: list[str]) -> None:
        """Raises ``ValueError`` if any of ``adapter_names`` cannot be folded into this block's bias exactly.

        Args:
            adapter_names: Adapters about to be merged (names this layer does not hold are skipped).
        """
        names = [n for n in adapter_names if n in self.steer_vector and n not in self.merged_adapters]
        if not names:
            return
        self._bias_module()
        for name in names:
            if self.steer_operator[name] != "add" or self.steer_positions[name] != "all":
                raise ValueError(
                    f"adapter {name!r} uses operator={self.steer_operator[name]!r}, "
                    f"positions={self.steer_positions[name]!r}: only operator='add' with positions='all' is a "
                    "constant shift that can be merged into the weights"
                )

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Folds ``"add"`` vectors with ``positions="all"`` into the bias that ends the block (scaled as the family
        requires, see :func:`steering.families.merge_target`).

        The result differs from the unmerged adapter only at padding positions (which the adapter leaves
        alone and the merged bias does not), and padding never influences real tokens.

        Args:
            safe_merge: Check the merged bias for non-finite values first.
            adapter_names: Adapters to merge (default: the active ones).
        """
        # Active adapters that steer other blocks only are active here too (PEFT activates names on every layer).
        adapter_names = [n for n in check_adapters_to_merge(self, adapter_names) if n in self.steer_vector]
        if not adapter_names:
            return
        self.check_mergeable(adapter_names)
        proj = self._bias_module()
        # Everything is checked before the bias changes, so a refused merge leaves the block as it was.
        deltas = [(self.bias_scale * self.steer_multiplier[name] * self._effective_vector(name, torch.float32)).detach()
                  for name in adapter_names]
        if safe_merge:
            for name, delta in zip(adapter_names, deltas):
                if not torch.isfinite(delta).all():
                    raise ValueError(f"adapter {name!r} has non-finite values; refusing to merge")
        if not self.merged_adapters:
            self._created_bias = proj.bias is None
            self._bias_before_merge = None if proj.bias is None else proj.bias.detach().clone()
        if proj.bias is None:
            proj.bias = nn.Parameter(
                torch.zeros(self.hidden_size, device=proj.weight.device, dtype=bias_dtype(proj, self.base_layer)),
                requires_grad=False,
            )
        with torch.no_grad():
            for name, delta in zip(adapter_names, deltas):
                proj.bias.add_(delta.to(device=proj.bias.device, dtype=proj.bias.dtype))
                self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Restores the bias as it was before the first merge (whatever multipliers or vectors changed since)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        proj = self._bias_module()
        if self._created_bias:
            proj.bias = None
        else:
            with torch.no_grad():
                proj.bias.copy_(self._bias_before_merge)
        self.merged_adapters.clear()
        self._created_bias = False
        self._bias_before_merge = None

    def __repr__(self) -> str:
        return "steering." + super().__repr__()


def bias_dtype(proj: nn.Module, block: nn.Module | None = None) -> torch.dtype:
    """The dtype of a bias created on ``proj``: its weight's, unless that is a quantized storage dtype.

    A bitsandbytes 4-bit/8-bit layer stores its weight as ``uint8``/``int8``; a bias in that dtype truncated the
    merged vector to integers (wrong outputs, silently). Such layers cast their bias to the compute dtype in forward,
    so it is kept in the layer's ``compute_dtype``, else in the block's floating-point dtype, else fp32.

    Args:
        proj: The projection receiving the bias.
        block: The decoder block around it (its floating-point parameters give the model dtype).
    """
    weight = getattr(proj, "weight", None)
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    compute = getattr(proj, "compute_dtype", None)
    if isinstance(compute, torch.dtype) and compute.is_floating_point:
        return compute
    for param in (block or proj).parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def _is_zero(param: torch.Tensor) -> bool:
    """Whether a materialised, unsharded vector is all zeros (``False`` for meta tensors and FSDP2 DTensors, whose
    values are not known here without loading or a collective)."""
    if param.device.type == "meta" or hasattr(param, "placements"):
        return False
    return not bool(param.detach().any())


def check_no_zero_ablation(modules, names=None, trainable_only: bool = False) -> None:
    """Refuses to train an ``operator="ablate"`` vector that is still zero (its initial value).

    ``h - m (h.u) u`` with ``u = v/|v|`` is quadratic in ``v`` at zero, so its gradient is exactly zero: the vector
    would stay zero while the run logged losses as usual (``SteeringModel.train`` and ``steering.train_vectors``).

    Args:
        modules: Modules to look through (``model.modules()``); steering layers among them are checked.
        names: Adapters to check (default: each layer's active adapters).
        trainable_only: Check only vectors that require grad.

    Raises:
        ValueError: Naming the adapters and layers.
    """
    zero = []
    for layer in modules:
        if not isinstance(layer, SteeringLayer):
            continue
        wanted = layer.active_adapters if names is None else names
        for name, param in layer.steer_vector.parameter_items():
            if (name in wanted and (param.requires_grad or not trainable_only)
                    and layer.steer_operator[name] == "ablate" and _is_zero(param)):
                zero.append(f"{name!r} at layer {layer.layer_index}")
    if zero:
        raise ValueError(
            f"operator='ablate' vectors that are zero cannot be trained ({', '.join(zero)}): ablating along v/|v| "
            "has a zero gradient at v = 0, so the vector would stay zero while the run logged losses as usual; set "
            "a direction first (set_vectors, e.g. an extracted vector), or train with operator='ablate_then_add' or "
            "'add'"
        )
