"""Ctrl-C or SIGTERM during ``peftplug validate``, ``test`` or ``predict`` ends the command with the shell's status
for that signal: 130 for Ctrl-C, 143 for SIGTERM.

Lightning answers SIGTERM outside training by a flag: its evaluation loop then raises ``SIGTERMException``, a
``SystemExit`` without a code, so ``peftplug validate``/``test`` stopped by ``kill PID`` exited 0 (success, with
metrics of the batches done so far), and its prediction loop never reads the flag, so ``peftplug predict`` ignored
``kill`` and ran to its end. Each run here is a separate process that signals itself at its first batch.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from tiny_recipes import causal_recipe

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(16)]
LORA = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}

PROGRAM = """
import os, signal, sys
import lightning, torch

torch.set_num_threads(1)
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal leaves it (a background run ignores it)


class SignalAtFirstBatch(lightning.Callback):
    def _first(self, batch_idx):
        if batch_idx == 0:
            print("signalled", flush=True)
            os.kill(os.getpid(), int(sys.argv[1]))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._first(batch_idx)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._first(batch_idx)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._first(batch_idx)


from peftplug.cli import main
sys.modules["signal_at_first_batch"] = sys.modules[__name__]  # the class_path the callback is named by
sys.exit(main(sys.argv[2:] + ["--trainer.callbacks+=signal_at_first_batch.SignalAtFirstBatch"]))
"""


@pytest.mark.parametrize(("command", "signum"), [
    ("validate", signal.SIGTERM), ("test", signal.SIGTERM), ("predict", signal.SIGTERM), ("validate", signal.SIGINT),
], ids=["validate-SIGTERM", "test-SIGTERM", "predict-SIGTERM", "validate-SIGINT"])
def test_a_signal_during_evaluation_exits_with_the_shells_status_for_it(tmp_path, zygote, command, signum):
    # 8 held-out rows in batches of 2: the signal at the first batch comes with 3 batches still to go.
    recipe = causal_recipe(tmp_path, ROWS, peft=LORA, data={"val_fraction": 0.5, "batch_size": 2})
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = zygote().run(PROGRAM, [str(int(signum)), command, "--config", str(recipe)], env, tmp_path, timeout=300)
    assert "signalled" in done.stdout + done.stderr, done.stderr[-3000:]
    assert done.returncode == 128 + signum, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    if command == "predict":  # stopped after the batch it was signalled in, not after all four
        assert done.stdout.count('"index"') <= 2, done.stdout
