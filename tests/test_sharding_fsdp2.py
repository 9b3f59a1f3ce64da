"""FSDP2 through Lightning's ``ModelParallelStrategy`` on CPU (2 gloo processes), from the command line: ``peftplug
fit`` shards an OFTv2-adapted tiny Llama and trains it; the adapter equals a DDP run's on the same data and seed,
each rank holds about half of the parameters, the one ``.ckpt`` exports (with and without ``--merge``) to exactly
the DDP export's keys, and a resumed sharded run equals a resumed DDP run and the uninterrupted one.

In the DDP run the strategy re-launches the command for rank 1 (Lightning's subprocess launcher), so each rank is a
``peftplug`` process of its own, as a user's would be; the FSDP2 run of CI is launched as ``torchrun`` launches
``peftplug fit`` (each rank's environment set, the command's entry point called in each), from two processes forked
from one fresh interpreter: a launched run costs about 30 s of two processes' imports. CI (``make test``) makes
those two runs, with AdamW (fixture ``runs``), and exports their checkpoints in this process. The rest is
``slow`` (``make test-slow``): zeroth-order HELENE under FSDP2 twice and under DDP (fixture ``zo_runs``), the
resumed runs, and QOFT on an nf4 base. In CI the zeroth-order step on FSDP2 shards is covered in process by
tests/helene/test_zo_dtensor.py (per-shard z, placements kept, bit-for-bit repeatable).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REPO = Path(__file__).resolve().parents[1]
PEFTPLUG = Path(sys.executable).parent / "peftplug"
FSDP2 = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
         "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1, "process_group_backend": "gloo",
                       "save_distributed_checkpoint": False}}


ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}
# HELENE as specified (preconditioner "hessian" with the paper's A-GNB estimate, elementwise; layer-wise clipping).
HELENE = {"class_path": "helene.Helene", "init_args": {"lr": 1e-3, "eps": 1e-3, "seed": 3,
                                                       "preconditioner": "hessian"}}


def _recipe(root: Path, name: str, strategy, max_steps: int, optimizer: dict = ADAMW,
            quantization: str = "none") -> Path:
    """A 2-process tiny-Llama OFTv2 recipe (AdamW by default: Adam's state must survive a resume too)."""
    recipe = {
        "seed_everything": 0,
        "trainer": {"default_root_dir": str(root / name), "max_steps": max_steps, "accelerator": "cpu", "devices": 2,
                    "strategy": strategy, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0},
        "model": {"model": "tiny:llama", "quantization": quantization,
                  "peft": {"class_path": "oftv2.OFTv2Config",
                           "init_args": {"block_size": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}},
                  "optimizer": optimizer},
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(root / "train.jsonl"), "validation_file": str(root / "train.jsonl"),
                               "prompt_column": "prompt", "response_column": "response", "batch_size": 2}},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _peftplug(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    # Output to files, not pipes, and the command in its own session: when rank 0 dies, the rank 1 it launched
    # waits for it (holding any pipe open), so the call returns when rank 0 exits and then ends the whole group.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(PEFTPLUG), *args], cwd=REPO, stdout=out, stderr=err, text=True, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=300)  # a run takes ~20 s
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert code == 0, f"peftplug {' '.join(args)} failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return stdout + stderr


def _checkpoint(root: Path, name: str) -> Path:
    (ckpt,) = (root / name).rglob("*.ckpt")  # save_distributed_checkpoint: false -> one ordinary file
    return ckpt


def _adapter(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def _fits(root: Path, runs: tuple) -> dict[str, str]:
    """Runs ``peftplug fit`` for each (name, strategy, optimizer) for 3 steps; returns each run's output."""
    return {name: _peftplug("fit", "--config", str(_recipe(root, name, strategy, 3, optimizer)))
            for name, strategy, optimizer in runs}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """The folder every run of this module writes into, with the 16-row training file."""
    root = tmp_path_factory.mktemp("fsdp2")
    rows = [{"prompt": f"{i:02d} plus {i:02d} is", "response": f" {2 * i}"} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return root


def _torchrun_rank(rank: int, recipe: str, port: int) -> None:
    """One rank of ``torchrun --nproc-per-node 2 peftplug fit --config <recipe>``: the environment torchrun gives
    it, then the command's own entry point (Lightning sees the ranks launched and starts none itself)."""
    from gloo_ranks import torchrun_env

    from peftplug.cli import main

    os.environ.update(torchrun_env(rank, port), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    code = main(["fit", "--config", recipe])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code or 0)  # no interpreter teardown: gloo's threads may abort it (tests/helene/test_ddp.py)


@pytest.fixture(scope="module")
def runs(data_root, zygote):
    """Three AdamW steps of the same recipe under DDP, launched as a user's ``peftplug fit`` (Lightning starts rank
    1), and under FSDP2, launched as ``torchrun`` would (two ranks forked from one fresh process:
    tests/gloo_ranks.py; a second command launch would cost ~30 s of imports)."""
    from gloo_ranks import free_port, run_ranks

    logs = _fits(data_root, (("ddp", "ddp", ADAMW),))
    proc = run_ranks(zygote, _torchrun_rank, (str(_recipe(data_root, "fsdp2", FSDP2, 3)), free_port()), timeout=300)
    logs["fsdp2"] = proc.stdout + proc.stderr
    return data_root, logs


@pytest.fixture(scope="module")
def zo_runs(data_root):
    """Three HELENE steps of the same recipe under FSDP2 (twice) and under DDP: only the slow test needs them."""
    return data_root, _fits(data_root, (("zo_fsdp2", FSDP2, HELENE), ("zo_fsdp2_again", FSDP2, HELENE),
                                        ("zo_ddp", "ddp", HELENE)))


def test_sharded_adapter_equals_ddp_and_each_rank_holds_half(runs):
    root, logs = runs
    sharded, ddp = _adapter(_checkpoint(root, "fsdp2")), _adapter(_checkpoint(root, "ddp"))
    assert sharded.keys() == ddp.keys() and all("oftv2_Q" in k for k in sharded)
    initial = torch.zeros(())  # OFTv2 starts at Q = 0 (the identity rotation)
    assert any(not torch.equal(v, initial.expand_as(v)) for v in ddp.values()), "nothing trained"
    for key, value in ddp.items():
        # Same data order, same per-rank batches; the gradient mean is a reduce-scatter instead of an all-reduce
        # of the same two fp32 numbers, so the sums agree bit for bit here (tolerance kept for other backends).
        torch.testing.assert_close(sharded[key], value, rtol=1e-6, atol=1e-7)
    share = re.search(r"FSDP2 over 2 ranks, (\d+) units, .* rank 0 holds ([\d,]+) of ([\d,]+) parameter elements",
                      logs["fsdp2"])
    assert share, logs["fsdp2"][-3000:]
    units, local, total = int(share[1]), int(share[2].replace(",", "")), int(share[3].replace(",", ""))
    assert units == 3  # the tiny Llama's 2 decoder layers + the root
    assert 0.45 < local / total < 0.55
    assert "FSDP2" not in logs["ddp"]


def _export(*args: str) -> None:
    """``peftplug export`` in this process (the checkpoint file is what is under test, not a fresh interpreter)."""
    from peftplug.cli import main

    assert main(["export", *args]) == 0


def test_sharded_checkpoint_exports_like_ddp(runs):
    from safetensors.torch import load_file

    root, _ = runs
    for name in ("fsdp2", "ddp"):
        _export("--ckpt_path", str(_checkpoint(root, name)), "--output", str(root / f"{name}_adapter"))
    sharded = load_file(root / "fsdp2_adapter" / "adapter_model.safetensors")
    ddp = load_file(root / "ddp_adapter" / "adapter_model.safetensors")
    assert sharded.keys() == ddp.keys()
    for key in ddp:
        torch.testing.assert_close(sharded[key], ddp[key], rtol=1e-6, atol=1e-7)
    _export("--ckpt_path", str(_checkpoint(root, "fsdp2")), "--output", str(root / "merged"), "--merge")
    assert (root / "merged" / "model.safetensors").is_file() and not (root / "merged" / "adapter_config.json").exists()


@pytest.mark.slow
def test_zeroth_order_under_fsdp2_reproduces_itself(zo_runs):
    root, _ = zo_runs
    first, again = _adapter(_checkpoint(root, "zo_fsdp2")), _adapter(_checkpoint(root, "zo_fsdp2_again"))
    ddp = _adapter(_checkpoint(root, "zo_ddp"))
    assert first.keys() == again.keys() == ddp.keys()
    for key in first:
        assert torch.equal(first[key], again[key]), key  # each shard's z comes from (step seed, tensor, shard)
    assert any(v.abs().max() > 0 for v in first.values()), "nothing trained"
    # Not the unsharded run: DDP draws z for each whole tensor from the step seed, FSDP2 each shard from its own
    # seed, so the two follow different (equally distributed) directions from the first step on.
    assert any(not torch.allclose(first[k], ddp[k]) for k in first)


@pytest.mark.slow
def test_resumed_sharded_run_equals_resumed_ddp_run(runs):
    root, _ = runs
    for name, strategy in (("fsdp2", FSDP2), ("ddp", "ddp")):
        recipe = _recipe(root, f"{name}_resumed", strategy, 5)
        _peftplug("fit", "--config", str(recipe), "--ckpt_path", str(_checkpoint(root, name)))
    _peftplug("fit", "--config", str(_recipe(root, "ddp_uninterrupted", "ddp", 5)))
    sharded, ddp = _adapter(_checkpoint(root, "fsdp2_resumed")), _adapter(_checkpoint(root, "ddp_resumed"))
    uninterrupted = _adapter(_checkpoint(root, "ddp_uninterrupted"))
    for key in ddp:
        torch.testing.assert_close(sharded[key], ddp[key], rtol=1e-6, atol=1e-7)
        # Step 3 is mid-epoch (4 batches per epoch), step 5 in the next epoch: position and next order restored.
        torch.testing.assert_close(ddp[key], uninterrupted[key], rtol=1e-6, atol=1e-7)
    state = torch.load(_checkpoint(root, "fsdp2_resumed"), weights_only=False)["optimizer_states"][0]["state"]
    assert len(state) == len(ddp)  # Adam's state of every adapter tensor came back (docs/cli.md, FSDP2)


@pytest.mark.slow
def test_qoft_on_an_nf4_base_shards_like_ddp(runs):
    """QOFT: the 4-bit base shards with bitsandbytes' uint8 storage (no float quant_storage needed)."""
    pytest.importorskip("bitsandbytes")
    root, _ = runs
    for name, strategy in (("qoft_fsdp2", FSDP2), ("qoft_ddp", "ddp")):
        _peftplug("fit", "--config", str(_recipe(root, name, strategy, 3, quantization="nf4")))
    sharded, ddp = _adapter(_checkpoint(root, "qoft_fsdp2")), _adapter(_checkpoint(root, "qoft_ddp"))
    assert sharded.keys() == ddp.keys() and any(v.abs().max() > 0 for v in ddp.values())
    for key in ddp:
        torch.testing.assert_close(sharded[key], ddp[key], rtol=1e-6, atol=1e-7)
