"""Interrupted runs resume exactly (issue 29): a `peftplug fit` stopped by a real SIGINT/SIGTERM at step k, then
resumed with `--ckpt_path last`, ends with the same adapter tensors as the uninterrupted run — mid-epoch, with
several batches per epoch, first-order (AdamW, an LR scheduler, dropout on) and zeroth-order (MeZO, FZOO).

Also here: the training loader's order and position (peftplug.data.resumable), the RNG round trip through a
weights-only checkpoint, `--ckpt_path last` resolution, and checkpoint writes that a kill cannot corrupt.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import lightning
import pytest
import torch
from tiny_recipes import causal_recipe
from torch.utils.data import DataLoader

from peftplug.cli import cli, main
from peftplug.data.resumable import EpochShuffleSampler, ResumableDataLoader

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(20)]
MAX_STEPS = 13  # 18 training rows in batches of 2: 9 batches per epoch, so the run crosses an epoch boundary

OPTIMIZERS = {
    "adamw": ({"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
              {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 3, "gamma": 0.7}}),
    "mezo": ({"class_path": "helene.ZOSGD", "init_args": {"lr": 0.05, "eps": 0.001, "seed": 3}},
             {"class_path": "torch.optim.lr_scheduler.LinearLR",
              "init_args": {"start_factor": 1.0, "end_factor": 0.2, "total_iters": MAX_STEPS}}),
    "fzoo": ({"class_path": "helene.FZOO", "init_args": {"lr": 0.05, "eps": 0.001, "n_probes": 3, "seed": 3}}, None),
}


class SignalAtStep(lightning.Callback):
    """Sends a real signal to this process while training step ``step`` (from 0) runs: mid-step, as a user would."""

    def __init__(self, step: int, signum: int = signal.SIGINT) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _recipe(root: Path, optimizer: str) -> Path:
    opt, scheduler = OPTIMIZERS[optimizer]
    return causal_recipe(
        root, ROWS, optimizer=opt, lr_scheduler=scheduler,
        peft={"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1,
              "init_lora_weights": False},
        trainer={"max_steps": MAX_STEPS, "val_check_interval": 4, "limit_val_batches": 1},
        data={"val_fraction": 0.1})


def _adapter(done) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in done.model.state_dict().items()
            if k in set(done.model.adapter_state_keys())}


def assert_same_adapter(full, resumed) -> dict[str, torch.Tensor]:
    """Asserts the two runs ended with the same adapter tensors, bit for bit; returns the first run's."""
    want, got = _adapter(full), _adapter(resumed)
    assert want.keys() == got.keys() and want
    for name in want:
        assert torch.equal(want[name], got[name]), name
    return want


@pytest.fixture
def _sigint_default():
    """SIGINT as an interactive shell leaves it (a background shell starts its jobs with it ignored, and an ignored
    SIGINT stays ignored during a fit)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class HandlersDuringFit(lightning.Callback):
    """Records SIGINT's and SIGTERM's handlers while a training step runs."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def test_a_signal_ignored_at_start_stays_ignored_during_fit_and_sigterm_still_stops(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup / `cmd &` start a job
    try:
        seen = HandlersDuringFit()
        cut = cli(["fit", "--config", str(_recipe(tmp_path, "adamw"))],
                  trainer_defaults={"callbacks": [seen, SignalAtStep(1, signal.SIGINT), SignalAtStep(3, signal.SIGTERM)]})
        assert seen.seen[signal.SIGINT] is signal.SIG_IGN and seen.seen[signal.SIGTERM] is not signal.SIG_IGN
        # SIGINT at step 1 was ignored; SIGTERM at step 3 stopped the run after that step, with a checkpoint.
        assert cut.interrupted_by() == signal.SIGTERM and cut.trainer.global_step == 4
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("optimizer, stop_at", [("adamw", 5), ("adamw", 10), ("mezo", 6), ("fzoo", 11)])
def test_interrupted_fit_resumes_to_the_uninterrupted_adapter(tmp_path, optimizer, stop_at, _sigint_default):
    before = signal.getsignal(signal.SIGINT)
    full = cli(["fit", "--config", str(_recipe(tmp_path / "full", optimizer))])
    assert full.trainer.global_step == MAX_STEPS and full.interrupted_by() is None

    recipe = _recipe(tmp_path / "cut", optimizer)
    cut = cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [SignalAtStep(stop_at)]})
    # The signal arrived during step `stop_at`: that step finished, then the run stopped with a checkpoint.
    assert cut.interrupted_by() == signal.SIGINT and cut.trainer.global_step == stop_at + 1
    saved = torch.load(tmp_path / "cut" / "runs" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == stop_at + 1 and saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert signal.getsignal(signal.SIGINT) is before  # handlers given back
    # After the interrupt only last.ckpt: the stopped epoch's end must not write one that marks it complete.
    names = [p.name for p in (tmp_path / "cut" / "runs" / "checkpoints").iterdir()]
    assert "last.ckpt" in names and not [n for n in names if f"step={stop_at + 1}" in n], names

    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == MAX_STEPS
    want = assert_same_adapter(full, resumed)
    start = _adapter(cut)
    assert any(not torch.equal(start[n], want[n]) for n in want)  # the resumed part did train


def test_a_run_stopped_by_max_steps_mid_epoch_extends_to_the_uninterrupted_adapter(tmp_path):
    """Training longer from a finished run's checkpoint: max_steps stopped it mid-epoch, and Lightning counts that
    checkpoint's epoch as finished; the next epoch must still follow epoch 1's order, not epoch 2's."""
    no_val = ["--trainer.limit_val_batches", "0"]  # then ModelCheckpoint saves when max_steps ends the run
    full = cli(["fit", "--config", str(_recipe(tmp_path / "full", "adamw")), *no_val])
    recipe = _recipe(tmp_path / "short", "adamw")
    short = cli(["fit", "--config", str(recipe), "--trainer.max_steps", "5", *no_val])  # epoch 0 has 9 batches
    assert short.trainer.global_step == 5
    (path,) = (tmp_path / "short" / "runs").rglob("*.ckpt")
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == 5 and saved["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"] == 1
    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", str(path), *no_val])
    assert resumed.trainer.global_step == MAX_STEPS  # crosses into epoch 1 at step 9
    assert_same_adapter(full, resumed)


def test_without_the_data_position_the_resume_would_differ(tmp_path, _sigint_default):
    """The test above can fail: resuming with the loader position dropped from the checkpoint changes the
    adapter (the epoch would start again from its first batch)."""
    full = cli(["fit", "--config", str(_recipe(tmp_path / "full", "adamw"))])
    recipe = _recipe(tmp_path / "cut", "adamw")
    cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [SignalAtStep(5)]})
    path = tmp_path / "cut" / "runs" / "checkpoints" / "last.ckpt"
    saved = torch.load(path, weights_only=True)
    saved["loops"]["fit_loop"]["state_dict"].pop("combined_loader")
    torch.save(saved, path)
    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", str(path)])
    want, got = _adapter(full), _adapter(resumed)
    assert any(not torch.equal(want[n], got[n]) for n in want)


def test_sigterm_to_a_peftplug_fit_process_then_resume(tmp_path, zygote):
    """A real `peftplug fit` process (a child of the suite's fork server: its own pid, nothing of peftplug loaded)
    gets SIGTERM from outside while it trains; it exits with 143 after writing a checkpoint, and `--ckpt_path last`
    completes the run to the uninterrupted adapter."""
    recipe = _recipe(tmp_path / "cut", "mezo")
    marker = tmp_path / "training"
    # A callback that announces step 4 and waits there (inside the step) until the signal has been received.
    (tmp_path / "pause_at_step.py").write_text(textwrap.dedent(f"""
        import time, lightning
        from peftplug.interrupt import GracefulInterrupt
        class PauseAtStep(lightning.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step != 4:
                    return
                open({str(marker)!r}, "w").close()
                stop = next(c for c in trainer.callbacks if isinstance(c, GracefulInterrupt))
                deadline = time.monotonic() + 120
                while stop.signal_received is None and time.monotonic() < deadline:
                    time.sleep(0.05)
    """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    program = tmp_path / "fit_main.py"
    program.write_text("import sys, torch; torch.set_num_threads(1); from peftplug.cli import main; "
                       "sys.exit(main(sys.argv[1:]))")
    process = zygote().start(program, ["fit", "--config", str(recipe), "--trainer.callbacks+=pause_at_step.PauseAtStep"],
                             env, tmp_path)
    deadline = time.monotonic() + 300
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), process.communicate()[1][-3000:]
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM received" in err and "stopped at step 5" in err and "Traceback" not in err

    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", "last"])
    full = cli(["fit", "--config", str(_recipe(tmp_path / "full", "mezo"))])
    for name, want in _adapter(full).items():
        assert torch.equal(want, _adapter(resumed)[name]), name


class CrashAtStep(lightning.Callback):
    """A machine that dies during step ``step``: no checkpoint is written then (as under SIGKILL)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("the machine is gone")


def test_a_lost_machine_resumes_from_the_last_periodic_checkpoint(tmp_path):
    """The documented recipe line (ModelCheckpoint every_n_train_steps + save_last) bounds what a kill loses; the
    run resumed from it ends where the uninterrupted run does."""
    periodic = ('--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
                '"init_args": {"every_n_train_steps": 3, "save_last": true}}]')
    full = cli(["fit", "--config", str(_recipe(tmp_path / "full", "adamw"))])
    recipe = _recipe(tmp_path / "cut", "adamw")
    with pytest.raises(RuntimeError, match="the machine is gone"):
        cli(["fit", "--config", str(recipe), periodic], trainer_defaults={"callbacks": [CrashAtStep(8)]})
    last = tmp_path / "cut" / "runs" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 6  # steps 7 and 8 are lost
    resumed = cli(["fit", "--config", str(recipe), periodic, "--ckpt_path", "last"])
    assert resumed.trainer.global_step == MAX_STEPS
    for name, want in _adapter(full).items():
        assert torch.equal(want, _adapter(resumed)[name]), name


# ---------------------------------------------------------------- the training loader
def test_epoch_order_is_the_former_loaders_and_a_function_of_seed_and_epoch():
    data = list(range(11))
    former = DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(7))
    expected = [[b.tolist() for b in former] for _ in range(4)]
    for epoch in (3, 0, 2, 1):  # any epoch, in any order, in a fresh sampler
        sampler = EpochShuffleSampler(data, seed=7)
        sampler.set_epoch(epoch)
        loader = ResumableDataLoader(data, batch_size=3, sampler=sampler)
        assert [b.tolist() for b in loader] == expected[epoch]
    assert expected[0] != expected[1]


def test_loader_position_round_trip_mid_epoch_and_at_the_end():
    data = list(range(10))
    sampler = EpochShuffleSampler(data, seed=1)
    sampler.set_epoch(2)
    loader = ResumableDataLoader(data, batch_size=3, sampler=sampler)
    batches = [b.tolist() for b in loader]
    iterator = iter(loader)
    next(iterator), next(iterator)
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches": 2}

    fresh = ResumableDataLoader(data, batch_size=3, sampler=EpochShuffleSampler(data, seed=1))
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == batches[2:]
    assert fresh.state_dict() == {"epoch": 3, "batches": 0}  # a finished epoch resumes at the next one's start
    limited = ResumableDataLoader(data, batch_size=3, sampler=EpochShuffleSampler(data, seed=1),
                                  epoch_batches=lambda: 2)  # limit_train_batches=2
    it = iter(limited)
    next(it), next(it)
    assert limited.state_dict() == {"epoch": 1, "batches": 0}


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np

    from peftplug.resume import restore_rng, rng_state

    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.save({"rng": rng_state()}, tmp_path / "rng.pt")
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_last_is_the_newest_checkpoint_under_default_root_dir(tmp_path, capsys):
    from peftplug.errors import ConfigError
    from peftplug.resume import find_last_checkpoint

    with pytest.raises(ConfigError, match="found no checkpoint under trainer.default_root_dir"):
        find_last_checkpoint(tmp_path)
    older = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt"
    newer = tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    for i, path in enumerate((older, newer)):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, ns=(10**18 + i, 10**18 + i))
    (tmp_path / ".last.ckpt.abc.tmp").write_bytes(b"partial")  # an unfinished write is never a candidate
    assert find_last_checkpoint(tmp_path) == newer
    recipe = _recipe(tmp_path / "none", "adamw")
    assert main(["fit", "--config", str(recipe), "--ckpt_path", "last"]) == 2
    assert "ckpt_path: 'last' found no checkpoint under trainer.default_root_dir" in capsys.readouterr().err


# ---------------------------------------------------------------- atomic checkpoint writes
_KILLED_WRITER = r"""
import resource, signal, sys, torch
from peftplug.checkpoint_io import AtomicCheckpointIO
limit = int(sys.argv[2])
# The write dies half-way: past the size limit the kernel sends SIGXFSZ, whose default action (Python ignores it
# unless told otherwise) kills the process on the spot, leaving whatever was written.
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
AtomicCheckpointIO().save_checkpoint({"w": torch.arange(200_000, dtype=torch.float32)}, sys.argv[1])
print("not reached")
"""


def test_a_kill_during_the_checkpoint_write_leaves_the_previous_one(tmp_path, zygote):
    from peftplug.checkpoint_io import AtomicCheckpointIO

    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(3)}, path)
    previous = path.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = zygote().run(_KILLED_WRITER, [str(path), "400000"], env, tmp_path, timeout=300)
    assert done.returncode == -signal.SIGXFSZ, done.stderr[-2000:]  # killed in the middle of writing 800 kB
    assert path.read_bytes() == previous and torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert sorted(p.name for p in path.parent.iterdir() if p.suffix == ".ckpt") == ["last.ckpt"]
    # The partial file the kill left is a hidden temporary one, which `--ckpt_path last` never picks.
    from peftplug.resume import find_last_checkpoint

    assert find_last_checkpoint(tmp_path) == path


def test_fit_writes_checkpoints_atomically(tmp_path):
    from peftplug.checkpoint_io import AtomicCheckpointIO

    done = cli(["fit", "--config", str(_recipe(tmp_path, "adamw")), "--trainer.max_steps", "4"])
    assert isinstance(done.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    (written,) = (tmp_path / "runs").rglob("*.ckpt")  # ModelCheckpoint's, after the validation at step 4
    assert torch.load(written, weights_only=True)["global_step"] == 4
