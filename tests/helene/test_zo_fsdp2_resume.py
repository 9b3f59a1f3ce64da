"""Resuming zeroth-order runs under FSDP2 (Lightning's ``ModelParallelStrategy``), 2 gloo processes on CPU.

torch's ``set_optimizer_state_dict``, through which the strategy restores optimizers, makes the state of an optimizer
that has none by a closure-less step (which zeroth-order optimizers refuse) and loads into the state tensors it
finds; its ``get_optimizer_state_dict`` drops the ``"zeroth_order"`` entry (step counters, seed generator). So the
optimizers make their state tensors with their param groups, ``PeftModule`` saves and restores the entry, and a
resumed run equals the uninterrupted one bit for bit. An optimizer that keeps no per-parameter tensor (MeZO without
master weights) cannot be restored that way: the resume is refused in one line naming ``master_weights=True``.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest
import torch
from gloo_ranks import free_port, run_ranks, torchrun_env

dist = torch.distributed
pytestmark = [pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="torch.distributed with gloo is not available"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS, RESUME_AT = 4, 2  # 4 batches per rank and epoch: the resume starts mid-epoch
# name -> (class, options). HELENE as the FSDP2 recipe of tests/test_sharding_fsdp2.py (m and h per tensor), with a
# per-tensor Hessian estimate, the default scalar preconditioner (per-group moments in the "zeroth_order" entry), ZO-Adam, and the optimizers without
# moments with master weights (their only per-parameter state).
RESUMABLE = {
    "helene_hessian": ("Helene", {"lr": 1e-3, "eps": 1e-3, "seed": 3, "preconditioner": "hessian"}),
    # A per-tensor estimate of a shard is the rank's own float (the clipping floor λ = 0 lets it matter).
    "helene_agnb_layer": ("Helene", {"lr": 1e-3, "eps": 1e-3, "seed": 3, "hessian": "agnb_layer", "lam": 0.0}),
    "helene_scalar": ("Helene", {"lr": 1e-3, "eps": 1e-3, "seed": 3}),
    "zoadam": ("ZOAdam", {"lr": 1e-3, "eps": 1e-3, "seed": 3}),
    "fzoo_master": ("FZOO", {"lr": 1e-3, "eps": 1e-3, "seed": 3, "n_probes": 2, "master_weights": True}),
    "zosgd_master": ("ZOSGD", {"lr": 1e-2, "eps": 1e-3, "seed": 3, "master_weights": True}),
}
STATELESS = ("ZOSGD", {"lr": 1e-2, "eps": 1e-3, "seed": 3})


def _module(kind: str, options: dict):
    import functools

    from peft import LoraConfig

    import helene
    from peftplug.lightning import PeftModule

    torch.manual_seed(0)
    return PeftModule("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                      optimizer=functools.partial(getattr(helene, kind), **options))


def _fit(root: Path, kind: str, options: dict, out: Path, ckpt_path: Path | None = None) -> None:
    """``STEPS`` steps (from ``ckpt_path`` if given), writing checkpoints at steps 2 and 4 into ``out``."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from peftplug.data import CausalLMData

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo",
                                     save_distributed_checkpoint=False)
    saver = ModelCheckpoint(dirpath=out, every_n_train_steps=RESUME_AT, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                        callbacks=[saver], enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root)
    data = CausalLMData(train_file=str(root / "t.jsonl"), validation_file=str(root / "t.jsonl"),
                        prompt_column="prompt", response_column="response", batch_size=2)
    trainer.fit(_module(kind, options), datamodule=data, ckpt_path=None if ckpt_path is None else str(ckpt_path))


def _worker(rank: int, root: str, port: int) -> None:
    os.environ.update(torchrun_env(rank, port), OMP_NUM_THREADS="1")
    root = Path(root)
    errors = {}
    try:
        for name, (kind, options) in RESUMABLE.items():
            _fit(root, kind, options, root / name / "full")
            _fit(root, kind, options, root / name / "resumed",
                 ckpt_path=root / name / "full" / f"epoch=0-step={RESUME_AT}.ckpt")
        # A checkpoint without the "zeroth_order" entry (as FSDP2 runs wrote them before): counters and generator
        # cannot come back, so the first step refuses to run instead of silently leaving the uninterrupted run.
        old = root / "old.ckpt"
        checkpoint = torch.load(root / "zoadam" / "full" / f"epoch=0-step={RESUME_AT}.ckpt", weights_only=False)
        del checkpoint["optimizer_states"][0]["zeroth_order"]
        torch.save(checkpoint, root / f"old{rank}.ckpt")
        os.replace(root / f"old{rank}.ckpt", old)  # both ranks write the same bytes; rank 0's path is read
        try:
            _fit(root, *RESUMABLE["zoadam"], root / "old", ckpt_path=old)
        except Exception as err:  # noqa: BLE001 -- recorded for the test to check
            errors["old"] = f"{type(err).__name__}: {err}"
        _fit(root, *STATELESS, root / "stateless" / "full")
        try:
            _fit(root, *STATELESS, root / "stateless" / "resumed",
                 ckpt_path=root / "stateless" / "full" / f"epoch=0-step={RESUME_AT}.ckpt")
        except Exception as err:  # noqa: BLE001 -- recorded for the test to check
            errors["stateless"] = f"{type(err).__name__}: {err}"
    except Exception:  # noqa: BLE001
        errors["crash"] = traceback.format_exc()
    (root / f"rank{rank}.json").write_text(json.dumps(errors))
    os._exit(0)  # no teardown of the process group: a rank that failed alone would hang the other's


@pytest.fixture(scope="module")
def runs(tmp_path_factory, zygote) -> Path:
    """The folder of every run's checkpoints and each rank's recorded errors (two ranks: tests/gloo_ranks.py)."""
    root = tmp_path_factory.mktemp("zo_fsdp2_resume")
    rows = [{"prompt": f"{i:02d} plus {i:02d} is", "response": f" {2 * i}"} for i in range(16)]
    (root / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_ranks(zygote, _worker, (str(root), free_port()), timeout=300)
    return root


def _checkpoint(root: Path, name: str, run: str, step: int) -> dict:
    return torch.load(root / name / run / f"epoch=0-step={step}.ckpt", map_location="cpu", weights_only=False)


def test_ranks_ran(runs):
    for rank in (0, 1):
        assert "crash" not in json.loads((runs / f"rank{rank}.json").read_text()), rank


@pytest.mark.parametrize("name", list(RESUMABLE))
def test_resumed_run_equals_uninterrupted(runs, name):
    full, resumed = _checkpoint(runs, name, "full", STEPS), _checkpoint(runs, name, "resumed", STEPS)
    start = _checkpoint(runs, name, "full", RESUME_AT)
    # It did resume: its first checkpoint is the one at STEPS (a run from scratch would equal `full` trivially).
    assert sorted(p.name for p in (runs / name / "resumed").iterdir()) == [f"epoch=0-step={STEPS}.ckpt"]
    assert full["state_dict"].keys() == resumed["state_dict"].keys()
    for key, value in full["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    assert any(not torch.equal(v, start["state_dict"][k]) for k, v in full["state_dict"].items()), "nothing trained"
    # The saved optimizer state is the optimizer's whole state_dict(): counters and generator included.
    zo_full = full["optimizer_states"][0]["zeroth_order"]
    zo_resumed = resumed["optimizer_states"][0]["zeroth_order"]
    assert zo_full["step_count"] == zo_resumed["step_count"] == STEPS
    assert torch.equal(zo_full["generator_state"], zo_resumed["generator_state"])
    for key, value in full["optimizer_states"][0]["state"].items():
        for field, tensor in value.items():
            assert torch.equal(tensor, resumed["optimizer_states"][0]["state"][key][field]), (key, field)


def test_stateless_optimizer_resume_is_refused_in_one_line(runs):
    for rank in (0, 1):
        error = json.loads((runs / f"rank{rank}.json").read_text()).get("stateless", "")
        assert error.startswith("ConfigError: ZOSGD keeps no per-parameter state"), error
        assert "master_weights=True" in error and "\n" not in error


def test_checkpoint_without_zeroth_order_entry_refuses_to_step(runs):
    for rank in (0, 1):
        error = json.loads((runs / f"rank{rank}.json").read_text()).get("old", "")
        assert error.startswith("ConfigError: the optimizer state was loaded without its 'zeroth_order' entry"), error
        assert "\n" not in error
    assert not (runs / "old").exists() or not any((runs / "old").iterdir())  # no step was taken
