"""Source stage and baselines: per-task PEFT prompt tuning, reading source prompts back, SPoT selection."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping

import torch

from prompt_transfer.decompose import check_decompose_settings
from prompt_transfer.training import train_prompt


def prompt_tuning_config(task_type: str, num_virtual_tokens: int, init: str = "random", **kwargs):
    """A PEFT ``PromptTuningConfig`` for the source stage and the PT baselines.

    Args:
        task_type: PEFT task type (``"SEQ_CLS"``, ``"CAUSAL_LM"``, ``"SEQ_2_SEQ_LM"``).
        num_virtual_tokens: Prompt length ``l``.
        init: ``"random"`` (PEFT's RANDOM) or ``"vocab"`` (SAMPLE_VOCAB: embeddings of random vocabulary tokens).
        **kwargs: Other ``PromptTuningConfig`` fields (e.g. ``modules_to_save``).
    """
    from peft import PromptTuningConfig, PromptTuningInit

    inits = {"random": PromptTuningInit.RANDOM, "vocab": PromptTuningInit.SAMPLE_VOCAB}
    if init not in inits:
        raise ValueError(f"init must be one of {sorted(inits)}, got {init!r}")
    return PromptTuningConfig(task_type=task_type, num_virtual_tokens=num_virtual_tokens,
                              prompt_tuning_init=inits[init], **kwargs)


def set_prompt(model, prompt: torch.Tensor, adapter_name: str | None = None) -> None:
    """Overwrites a prompt-tuning adapter's prompt (SPoT: initialise the target from a source prompt).

    Args:
        model: A ``PeftModel`` with a ``PROMPT_TUNING`` adapter.
        prompt: ``[l, d]``; repeated for each transformer submodule.
        adapter_name: Adapter (default: the active one).
    """
    name = adapter_name or model.active_adapter
    weight = model.prompt_encoder[name].embedding.weight
    length = model.peft_config[name].num_virtual_tokens
    # Exactly [l, d]: a prompt of l/2 tokens also divides the stacked [l * submodules, d] weight, and tiling it would
    # silently give another prompt than the source's.
    if prompt.dim() != 2 or tuple(prompt.shape) != (length, weight.shape[1]):
        raise ValueError(
            f"prompt of shape {tuple(prompt.shape)} does not fit adapter {name!r}: it needs [num_virtual_tokens, "
            f"token_dim] = [{length}, {weight.shape[1]}] (source and target prompts must have the same length and "
            "come from the same base model)"
        )
    with torch.no_grad():
        weight.copy_(prompt.to(weight).repeat(weight.shape[0] // length, 1))


def train_source_prompts(
    make_model: Callable[[str], torch.nn.Module],
    tasks: Mapping[str, Iterable[Mapping[str, torch.Tensor]]],
    config_factory: Callable[[str], object],
    out_dir: str,
    steps: int,
    lr: float = 3e-2,
    head_lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, str]:
    """Trains one soft prompt per source task (PEFT prompt tuning) and saves each as a PEFT adapter.

    Args:
        make_model: ``task name -> fresh base model`` (e.g. a classifier with that task's number of labels).
        tasks: ``task name -> training batches``.
        config_factory: ``task name -> PromptTuningConfig`` (all with the same ``num_virtual_tokens``).
        out_dir: Adapters go to ``out_dir/<task name>/`` (``adapter_config.json`` + ``adapter_model.safetensors``).
        steps: Optimizer steps per task.
        lr: Prompt learning rate.
        head_lr: Learning rate of trainable heads (``modules_to_save``).
        seed: Seed (per task ``seed + index``) for prompt init and dropout.

    Returns:
        ``task name -> adapter directory``.
    """
    from peft import get_peft_model

    if not tasks:
        raise ValueError("tasks is empty: give at least one source task")
    paths = {}
    for i, (name, batches) in enumerate(tasks.items()):
        torch.manual_seed(seed + i)
        model = get_peft_model(make_model(name), config_factory(name))
        train_prompt(model, batches, steps=steps, lr=lr, head_lr=head_lr)
        path = os.path.join(out_dir, name)
        model.save_pretrained(path)
        paths[name] = path
    return paths


def load_source_prompt(adapter_dir: str) -> torch.Tensor:
    """Reads the prompt ``[l, d]`` of a saved PEFT prompt-tuning (or PCT) adapter.

    Args:
        adapter_dir: Directory with ``adapter_config.json`` and ``adapter_model.safetensors``.

    Raises:
        ValueError: If the adapter is not a prompt-tuning/PCT adapter or its tensor is missing.
    """
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") not in ("PROMPT_TUNING", "PCT"):
        raise ValueError(f"{adapter_dir} holds a {cfg.get('peft_type')!r} adapter, not PROMPT_TUNING/PCT")
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    if "prompt_embeddings" not in tensors:
        raise ValueError(f"{adapter_dir}/adapter_model.safetensors has no 'prompt_embeddings' tensor")
    return tensors["prompt_embeddings"][: cfg["num_virtual_tokens"]].float()


def source_base_model(adapters: Mapping[str, str]) -> str | None:
    """The base model shared by saved source adapters (their ``base_model_name_or_path``), or ``None`` if unrecorded.

    Args:
        adapters: ``source name -> adapter directory``.

    Raises:
        ValueError: If two sources were trained on different models (naming both), or ``adapters`` is empty.
    """
    from prompt_transfer.decompose import model_id

    if not adapters:
        raise ValueError("sources is empty: give at least one source adapter")
    seen: tuple[str, str] | None = None
    for name, path in adapters.items():
        with open(os.path.join(path, "adapter_config.json")) as f:
            model = json.load(f).get("base_model_name_or_path")
        if model_id(model) is None:
            continue
        if seen is not None and model_id(seen[1]) != model_id(model):
            raise ValueError(f"source prompts come from different models: {seen[0]!r} from {seen[1]!r}, {name!r} from "
                             f"{model!r}; decompose prompts of one base model")
        seen = seen or (name, model)
    return None if seen is None else seen[1]


def spot_select(target_prompt: torch.Tensor, source_prompts: Mapping[str, torch.Tensor],
                mode: str = "mean_token") -> tuple[str, dict[str, float]]:
    """SPoT retrieval: the source prompt most similar (cosine) to a prompt trained briefly on the target.

    Args:
        target_prompt: The target's task embedding, ``[l, d]`` (a prompt tuned on the target task).
        source_prompts: ``name -> [l, d]``.
        mode: ``"mean_token"`` (cosine of token-averaged prompts, SPoT's default) or ``"flat"`` (cosine of the
            flattened prompts).

    Returns:
        ``(best source name, {name: similarity})``.
    """
    if not source_prompts:
        raise ValueError("source_prompts is empty")
    if mode not in ("mean_token", "flat"):
        raise ValueError(f"mode must be 'mean_token' or 'flat', got {mode!r}")

    def embed(p):
        return p.float().mean(0) if mode == "mean_token" else p.float().flatten()

    t = embed(target_prompt)
    sims = {}
    for name, p in source_prompts.items():
        if p.shape[-1] != target_prompt.shape[-1]:
            raise ValueError(f"source prompt {name!r} has width {p.shape[-1]}, target {target_prompt.shape[-1]}")
        if mode == "flat" and p.shape != target_prompt.shape:  # flattened prompts compare entry by entry
            raise ValueError(f"mode='flat' compares prompts of one shape: source prompt {name!r} is "
                             f"{tuple(p.shape)}, the target {tuple(target_prompt.shape)} (use mode='mean_token')")
        sims[name] = float(torch.nn.functional.cosine_similarity(t, embed(p), dim=0))
    return max(sims, key=sims.get), sims


# ---------------------------------------------------------------- multi-source recipes (``train-sources``)
RECIPE_KEYS = ("out_dir", "seed_everything", "evaluate_after_fit", "zero_shot", "trainer", "model", "sources",
               "decompose")
SOURCE_KEYS = ("name", "data", "model", "trainer")
DECOMPOSE_KEYS = ("out", "rank", "explained_variance", "contrastive_weight", "contrastive_steps")


def _require_mapping(value, field_name: str) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(f"{field_name} must be a mapping, got {type(value).__name__}")  # noqa: TRY004
    return dict(value)


def _reject_unknown(mapping: Mapping, accepted: tuple[str, ...], field_name: str) -> None:
    unknown = sorted(set(mapping) - set(accepted))
    if unknown:
        raise ValueError(f"{field_name}: unknown key(s) {unknown}; accepted: {list(accepted)}")


def validate_sources_recipe(recipe: Mapping, check_files: bool = True) -> dict:
    """Checks a multi-source recipe (the input of ``python -m prompt_transfer.cli train-sources``).

    A recipe holds the ``peftplug fit`` sections shared by every source (``seed_everything``, ``trainer``,
    ``model``), a list ``sources`` (each: ``name``, ``data`` as in a ``peftplug fit`` recipe, optional ``model`` /
    ``trainer`` overrides such as ``num_labels``), ``out_dir`` (adapters go to ``<out_dir>/<name>/``) and an
    optional ``decompose`` section (``out`` plus :func:`prompt_transfer.decompose` arguments). ``zero_shot: true``
    also tests each source task with the adapter disabled before training (the base model's own accuracy).

    Args:
        recipe: The parsed YAML.
        check_files: Check that every ``data.init_args.*_file`` exists (relative paths are relative to the working
            directory, as in ``peftplug fit``).

    Returns:
        The recipe as plain dicts, with defaults filled in (``seed_everything`` 0, ``trainer``/``model`` ``{}``).

    Raises:
        ValueError: Naming the offending field (``sources[1].data.init_args.train_file``) and what is accepted.
    """
    recipe = _require_mapping(recipe, "recipe")
    _reject_unknown(recipe, RECIPE_KEYS, "recipe")
    out_dir = recipe.get("out_dir")
    if not isinstance(out_dir, str) or not out_dir.strip():
        raise ValueError("out_dir must be a non-empty path: adapters are written to <out_dir>/<source name>/")
    seed = recipe.setdefault("seed_everything", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed_everything must be an integer (source k uses seed + k), got {seed!r}")  # noqa: TRY004
    for key in ("trainer", "model"):
        recipe[key] = _require_mapping(recipe.get(key) or {}, key)
    if not recipe["model"].get("peft"):
        raise ValueError("model.peft must be set (e.g. class_path: peft.PromptTuningConfig): it is shared by all "
                         "sources so that their prompts have one shape and can be decomposed together")
    sources = recipe.get("sources")
    if not isinstance(sources, list) or not sources:
        raise ValueError("sources must be a non-empty list of {name, data[, model, trainer]} entries")
    seen: dict[str, int] = {}
    checked = []
    for i, source in enumerate(sources):
        where = f"sources[{i}]"
        source = _require_mapping(source, where)
        _reject_unknown(source, SOURCE_KEYS, where)
        name = source.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.name must be a non-empty string")
        # The name becomes a directory under out_dir: keep it one plain path component.
        if name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"{where}.name {name!r} must be usable as a directory name (no '/', no leading '.')")
        if name in seen:
            raise ValueError(f"{where}.name {name!r} duplicates sources[{seen[name]}].name; names must be unique")
        seen[name] = i
        data = _require_mapping(source.get("data"), f"{where}.data")
        if not isinstance(data.get("class_path"), str):
            raise ValueError(f"{where}.data.class_path must name a LightningDataModule "  # noqa: TRY004
                             "(e.g. peftplug.data.TextClassificationData)")
        init_args = _require_mapping(data.get("init_args") or {}, f"{where}.data.init_args")
        if check_files:
            for key, value in init_args.items():
                if key.endswith("_file") and value is not None and not os.path.isfile(str(value)):
                    raise ValueError(f"{where}.data.init_args.{key}: file {value!r} does not exist "
                                     f"(relative to {os.getcwd()})")
        for key in ("model", "trainer"):
            source[key] = _require_mapping(source.get(key) or {}, f"{where}.{key}")
        if "peft" in source["model"]:
            raise ValueError(f"{where}.model.peft cannot be overridden: the prompt config is shared so that the "
                             "source prompts stack into one decomposition")
        task = source["model"].get("task", recipe["model"].get("task"))
        if recipe.get("zero_shot") and task == "seq_cls":
            # A fresh classification head scores chance whatever the prompt, and PEFT's disable_adapter() on a
            # prompt-learning sequence classifier fails (UnboundLocalError in PEFT 0.21): nothing to measure.
            raise ValueError(f"zero_shot: true needs sources that answer without training (model.task prompt_cls or "
                             f"causal_lm); {where} has model.task seq_cls, whose new head is untrained: set "
                             "zero_shot: false")
        checked.append(source)
    recipe["sources"] = checked
    if recipe.get("decompose") is not None:
        dec = _require_mapping(recipe["decompose"], "decompose")
        _reject_unknown(dec, DECOMPOSE_KEYS, "decompose")
        if not isinstance(dec.get("out"), str) or not dec["out"].strip():
            raise ValueError("decompose.out must be a non-empty path for the decomposition directory")
        # decompose()'s own rules, applied now: a bad value must stop the run before the first source trains,
        # not after the last one. None means "decompose()'s default", as in train_sources.
        check_decompose_settings(len(checked), **{k: v for k, v in dec.items() if k != "out" and v is not None},
                                 field_prefix="decompose.")
        recipe["decompose"] = dec
    return recipe


def source_run_config(recipe: Mapping, index: int, log_root: str) -> dict:
    """The ``peftplug fit`` config (as a dict) of source ``index`` of a validated multi-source recipe.

    Args:
        recipe: Output of :func:`validate_sources_recipe`.
        index: Which source.
        log_root: Trainer logs/checkpoints of the source go to ``<log_root>/<name>``.
    """
    source = recipe["sources"][index]
    config = {
        "seed_everything": recipe["seed_everything"] + index,  # distinct prompt inits across sources
        "trainer": {**recipe["trainer"], **source["trainer"], "default_root_dir": os.path.join(log_root,
                                                                                                source["name"])},
        "model": {**recipe["model"], **source["model"]},
        "data": source["data"],
    }
    return config
