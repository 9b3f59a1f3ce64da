"""Shared fixtures: tiny offline models and tokenizer, the shared data directory, and a fresh-process runner."""

from __future__ import annotations

import gc
import logging
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]

# Where the kernel and QOFT tests run. By default on CPU, the Triton kernels through Triton's interpreter: Triton
# reads TRITON_INTERPRET when a kernel is decorated, i.e. at the first import of a peftplug_kernels/*/triton.py module, and
# those are imported lazily, so setting it here, before any test module is collected, is early enough for the
# single-process suite (tests/kernels/conftest.py explains the one catch). On a CUDA machine
# PEFTPLUG_KERNELS_ON_GPU=1 (benchmarks/gpu/run_all.sh sets it) runs them on the GPU with compiled kernels, and
# the QOFT models are quantized there by bitsandbytes' CUDA kernels.
ON_GPU = os.environ.get("PEFTPLUG_KERNELS_ON_GPU") == "1" and torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

# Imported after the environment above is set: importing peftplug imports PEFT (and through it triton, bitsandbytes).
from peftplug.datadir import default_data_dir

DATA_DIR = default_data_dir()


def pytest_collection_finish(session):
    """Moves everything alive after collection (the imported libraries, the collected tests) out of the cyclic
    garbage collector's sight (:func:`gc.freeze`): each full collection walked those millions of objects again, and
    libraries call ``gc.collect()`` on purpose (accelerate's ``free_memory`` at every HF/TRL ``train()`` end, 0.37 s
    a call here) besides the interpreter's own. What the tests create is still collected as before.

    Args:
        session: The pytest session (unused).
    """
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Hands the frozen objects back to the collector before the interpreter's shutdown, which collects them: left
    frozen, nanobind (triton's bindings) reported them as leaked instances and functions at exit.

    Args:
        config: The pytest config (unused).
    """
    gc.unfreeze()


@pytest.fixture
def device() -> str:
    """Where the kernels and quantized models under test live: ``cuda`` with ``PEFTPLUG_KERNELS_ON_GPU=1``, else
    ``cpu`` (Triton interpreter)."""
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """The converted-model cache of the whole run (``PEFTPLUG_CACHE``, inherited by fresh processes), empty at its
    start: the packaged SmolLM2 is converted from its GGUF exactly once per run (≈ 25 s, by whichever test loads it
    first; tests/test_gguf_models.py checks that conversion), and the suite never reads or writes a user's cache."""
    cache = tmp_path_factory.mktemp("peftplug-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PEFTPLUG_CACHE", str(cache))
        yield cache


@pytest.fixture(autouse=True)
def _single_thread():
    """One intra-op thread for the suite's small tensors: on a loaded 2-core machine OpenMP's thread handoff made
    tiny quantize/merge ops ~50x slower (measured 23 s vs 0.4 s for one merge round trip). Restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fails a test that leaves pytest's file-size limit (``RLIMIT_FSIZE``) lowered, and puts it back before pytest
    writes the test's report: with stdout redirected to a file already past the limit (CI's log), that write died
    with ``OSError: File too large`` and took the whole run down. Tests that need a small limit set it in a child."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        return (yield)
    finally:
        after = resource.getrlimit(resource.RLIMIT_FSIZE)
        if after != before:
            resource.setrlimit(resource.RLIMIT_FSIZE, before)
            raise AssertionError(f"the test left RLIMIT_FSIZE at {after} (it was {before}); lower it in a child "
                                 "process (the zygote fixture) instead")


#: What Lightning's strategies export into the process environment and leave there after an in-process run.
_DISTRIBUTED_ENV = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leftover_rank_environment():
    """Puts the distributed variables back as they were: a test that runs a Lightning strategy in-process left
    ``LOCAL_RANK``/``NODE_RANK`` behind, and a later ``peftplug fit`` subprocess then waited for peers."""
    saved = {name: os.environ.get(name) for name in _DISTRIBUTED_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tokenizer():
    """Offline character-level tokenizer (pad id 0)."""
    from peftplug.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model(family="llama", task="causal_lm", seed=0, **config_overrides)``."""
    from peftplug.tiny import tiny_model as build

    return build


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared real-data directory; tests that need it skip when it is absent."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"shared data directory {DATA_DIR} not present")
    return DATA_DIR


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    """The fork server of fresh processes (tests/fresh_interpreter.py), started at its first use, once per run."""
    from fresh_interpreter import Zygote

    server = None

    def get() -> Zygote:
        nonlocal server
        if server is None:
            server = Zygote(tmp_path_factory.mktemp("zygote"), {**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        return server

    yield get
    if server is not None:
        server.close()


@pytest.fixture
def run_fresh(tmp_path, zygote):
    """Runs a Python snippet in a fresh process (cwd = repo root) and returns its ``CompletedProcess``.

    By default the process is a child of the fork server, which has imported torch, transformers, PEFT and
    Lightning but nothing of this library (tests/fresh_interpreter.py says why that is what these tests need).
    ``bare=True`` starts a new interpreter instead (~12 s here): for tests of what an import pulls in.
    """

    def run(code: str, timeout: int = 240, check: bool = True, bare: bool = False) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        if bare:
            script = tmp_path / "fresh_snippet.py"
            script.write_text(textwrap.dedent(code))
            proc = subprocess.run([sys.executable, str(script)], check=False, cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=timeout, env=env)
        else:
            proc = zygote().run(textwrap.dedent(code), [], env, REPO_ROOT, timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"fresh process failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run


# The BBC News data module's offline corpus cut down to a few articles (recipes that train on it).
TINY_BBC_SPLITS = ["--data.init_args.n_train", "32", "--data.init_args.n_val", "8", "--data.init_args.n_test", "8"]


@pytest.fixture
def tiny_recipe_args():
    """Factory: ``tiny_recipe_args(recipe, root_dir, steps, *extra, bbc_subset=False, model="tiny:bert")`` ->
    ``peftplug fit`` arguments that run ``recipes/<recipe>`` on a tiny offline model for ``steps`` steps, quietly,
    writing under ``root_dir``; ``bbc_subset`` keeps 32/8/8 BBC News articles; ``extra`` are further overrides."""

    def make(recipe: str, root_dir, steps: int, *extra: str, bbc_subset: bool = False,
             model: str = "tiny:bert") -> list[str]:
        return ["fit", "--config", str(REPO_ROOT / "recipes" / recipe), "--model.model", model,
                "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(root_dir),
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                *(TINY_BBC_SPLITS if bbc_subset else []), *extra]

    return make



class _RankZeroLines(logging.Handler):
    """Collects the messages of Lightning's rank-zero logger (which need not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def info_lines():
    """The INFO messages of Lightning's rank-zero logger during the test (peftplug's parameter lines among them)."""
    logger, handler = logging.getLogger("lightning.pytorch.utilities.rank_zero"), _RankZeroLines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def nf4_base(tiny_model, tmp_path):
    """Factory: the tiny Llama loaded in nf4 by transformers itself (as plain PEFT and TRL's model_init_kwargs do)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", seed=0).save_pretrained(tmp_path / "base")

    def load():
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, device_map="cpu")

    return load
