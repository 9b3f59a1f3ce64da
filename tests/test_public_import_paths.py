"""Every import path that recipes, saved configs, checkpoints, docs, benchmarks and users' code name keeps working
after the glue package was reorganised (peftplug/data.py -> peftplug/data/, prompt_cls.py split, one method list),
and resolves to the very object of the new home (not a copy that could drift)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# old module -> {name: "new.module:name"}: the paths that existed before the reorganisation.
MOVED = {
    "peftplug.data": {
        "TextClassificationData": "peftplug.data.classification:TextClassificationData",
        "BBCNewsData": "peftplug.data.classification:BBCNewsData",
        "CausalLMData": "peftplug.data.causal_lm:CausalLMData",
        "pad_batch": "peftplug.data.base:pad_batch",
        "_TokenizedDataModule": "peftplug.data.base:TokenizedDataModule",
        "read_table": "peftplug.data.files:read_table",
        "read_splits": "peftplug.data.files:read_splits",
        "check_val_fraction": "peftplug.data.files:check_val_fraction",
    },
    "peftplug.chat_data": {
        "ChatData": "peftplug.data.chat:ChatData",
        "BBCNewsChatData": "peftplug.data.chat:BBCNewsChatData",
        "encode_chat": "peftplug.data.chat:encode_chat",
        "GENERATION_KEYS": "peftplug.data.chat:GENERATION_KEYS",
        "_template_pieces": "peftplug.data.chat:_template_pieces",
        "_TokenizedDataModule": "peftplug.data.base:TokenizedDataModule",
        "BBCNewsData": "peftplug.data.classification:BBCNewsData",
        "pad_batch": "peftplug.data.base:pad_batch",
        "read_splits": "peftplug.data.files:read_splits",
        "check_val_fraction": "peftplug.data.files:check_val_fraction",
    },
    "peftplug.prompt_cls": {
        "PromptClassificationData": "peftplug.data.prompt_cls:PromptClassificationData",
        "PROMPT_TASKS": "peftplug.data.prompt_tasks:PROMPT_TASKS",
        "PromptTask": "peftplug.data.prompt_tasks:PromptTask",
        "PromptTemplate": "peftplug.data.prompt_tasks:PromptTemplate",
        "get_task": "peftplug.data.prompt_tasks:get_task",
        "ANSWER": "peftplug.data.prompt_templates:ANSWER",
        "FORMATS": "peftplug.data.prompt_templates:FORMATS",
        "MULTI_TOKEN_POLICIES": "peftplug.data.prompt_templates:MULTI_TOKEN_POLICIES",
        "template_fields": "peftplug.data.prompt_templates:template_fields",
        "split_template": "peftplug.data.prompt_templates:split_template",
        "label_word_ids": "peftplug.data.prompt_templates:label_word_ids",
        "render_prompt": "peftplug.data.prompt_templates:render_prompt",
        "kshot_files": "peftplug.data.kshot:kshot_files",
        "split_rows": "peftplug.data.kshot:split_rows",
        "sample_pool_splits": "peftplug.data.kshot:sample_pool_splits",
        "_read_rows": "peftplug.data.kshot:_read_rows",
        "_read_jsonl": "peftplug.data.kshot:_read_jsonl",
        "label_word_logits": "peftplug.prompt_scoring:label_word_logits",
        "prompt_cls_forward": "peftplug.prompt_scoring:prompt_cls_forward",
        "predict_labels": "peftplug.prompt_scoring:predict_labels",
        "PromptClsOutput": "peftplug.prompt_scoring:PromptClsOutput",
        "_is_prompt_learning": "peftplug.prompt_scoring:_is_prompt_learning",
        "_TokenizedDataModule": "peftplug.data.base:TokenizedDataModule",
        "pad_batch": "peftplug.data.base:pad_batch",
    },
    "peftplug.cli": {
        "METHOD_PACKAGES": "peftplug.registry:METHOD_PACKAGES",
        "import_method_packages": "peftplug.methods:import_method_packages",
    },
    "peftplug.loading": {
        "bitsandbytes_available": "peftplug.optional:bitsandbytes_available",
        "import_plugin_for": "peftplug.methods:import_plugin_for",
    },
}


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("old_module", sorted(MOVED))
def test_every_old_path_is_the_object_of_its_new_home(old_module):
    module = importlib.import_module(old_module)
    for name, target in MOVED[old_module].items():
        assert getattr(module, name) is _resolve(target), f"{old_module}.{name} is not {target}"


def test_the_data_package_exports_every_data_module_and_the_public_base():
    from peftplug import data
    from peftplug.data.base import TokenizedDataModule

    for name in data.__all__:
        assert getattr(data, name) is not None
    modules = [getattr(data, n) for n in data.__all__ if isinstance(getattr(data, n), type)]
    assert {m.__name__ for m in modules} >= {"TextClassificationData", "BBCNewsData", "CausalLMData", "ChatData",
                                            "BBCNewsChatData", "PromptClassificationData", "TokenizedDataModule"}
    assert all(issubclass(m, TokenizedDataModule) for m in modules)
    assert data.TokenizedDataModule._loader is data.TokenizedDataModule.loader  # benchmarks call _loader


def _named_imports() -> dict[tuple[str, str], set[str]]:
    """``(module, name)`` of every ``from peftplug... import name`` in the repository's Python files, and every
    dotted ``peftplug.<module>.<Name>`` in its recipes, docs and code, with the files that name it."""
    found: dict[tuple[str, str], set[str]] = {}
    # The checkout's own files (tracked or not, never the ignored venv and runs/): what a clone holds.
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.yaml",
                             "*.yml", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for path in (ROOT / name for name in listed):
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        where = str(path.relative_to(ROOT))
        if path.suffix == ".py":
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                        node.module == "peftplug" or node.module.startswith("peftplug.")):
                    for alias in node.names:
                        found.setdefault((node.module, alias.name), set()).add(where)
        for match in re.finditer(r"\bpeftplug((?:\.[a-z_][a-z0-9_]*)+)\.([A-Za-z_][A-Za-z0-9_]*)\b", text):
            found.setdefault(("peftplug" + match.group(1), match.group(2)), set()).add(where + " (dotted)")
    return found


def test_every_peftplug_name_the_repository_imports_or_mentions_exists():
    """Recipes' class_path entries, docs, benchmarks and tests: each named peftplug object (or module) resolves."""
    missing = []
    for (module_name, name), where in sorted(_named_imports().items()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            # ``peftplug.data.base`` is matched as module ``peftplug.data`` + name ``base``; a module path whose
            # head is itself an attribute (``peftplug.cli.main``) lands here only if that head is missing.
            missing.append(f"{module_name} (module) in {sorted(where)[:2]}")
            continue
        if hasattr(module, name):
            continue
        try:
            importlib.import_module(f"{module_name}.{name}")
        except ModuleNotFoundError:
            missing.append(f"{module_name}.{name} in {sorted(where)[:2]}")
    assert not missing, missing


def test_a_checkpoint_written_before_the_data_package_still_loads():
    """tests/fixtures/chat_data_before_data_package.ckpt was written by `peftplug fit` (tiny:llama, LoRA r=2 on
    q_proj, ChatData) at the commit before peftplug/data.py became a package; its datamodule hyperparameters name
    ``peftplug.chat_data.ChatData``."""
    from lightning.pytorch import LightningDataModule

    import peftplug.chat_data  # Lightning rebuilds only classes whose module the caller imported
    from peftplug.checkpoints import load_checkpoint_module, read_checkpoint, safe_globals
    from peftplug.data.chat import ChatData
    from peftplug.generate_cli import Generator

    path = FIXTURES / "chat_data_before_data_package.ckpt"
    checkpoint = read_checkpoint(path)
    assert checkpoint["datamodule_hyper_parameters"]["_class_path"] == "peftplug.chat_data.ChatData"
    with torch.serialization.safe_globals(safe_globals()):
        data = LightningDataModule.load_from_checkpoint(str(path), weights_only=True)
    assert type(data) is ChatData is peftplug.chat_data.ChatData
    assert data.system_prompt == "Reply briefly." and data.batch_size == 4
    module = load_checkpoint_module(path)
    lora = {k: v for k, v in module.model.state_dict().items() if "lora_" in k}
    saved = {k: v for k, v in checkpoint["state_dict"].items() if "lora_" in k}
    assert len(lora) == len(saved) == 4
    for (name, loaded), (saved_name, stored) in zip(sorted(lora.items()), sorted(saved.items())):
        assert saved_name.endswith(name) and torch.equal(loaded, stored), (name, saved_name)
    assert Generator(ckpt_path=str(path)).system == "Reply briefly."  # read from the old datamodule hyperparameters
