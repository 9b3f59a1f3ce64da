"""A second Ctrl-C (or SIGTERM) during a fit aborts at once: what the process exits with and what it leaves behind.

The first signal makes :class:`~peftplug.interrupt.GracefulInterrupt` finish the step and write a checkpoint; the
second raises ``KeyboardInterrupt``, which Lightning's ``_call_and_handle_interrupt`` answers by ignoring SIGINT while
it tears down and then calling ``exit(1)``. ``peftplug fit`` then exited 1, like a crash, where the first-signal stop
exits 130 (143 for SIGTERM), the shell's status for a run ended by that signal. Both runs here are separate
processes that get the signals from outside, as from a terminal or ``kill``.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
from tiny_recipes import causal_recipe

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(16)]
LORA = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}

# Waits inside step 2 for the first signal, announces it was seen, then waits (up to 120 s) for the second. A marker
# file tells the test when to send each one: then neither can come before the handler is in place or race the step.
PAUSE = """
import time, lightning
from peftplug.interrupt import GracefulInterrupt

def _wait(done, seconds=120):
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)

class TwoSignalsInStep(lightning.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != 2:
            return
        stop = next(c for c in trainer.callbacks if isinstance(c, GracefulInterrupt))
        open({first!r}, "w").close()
        _wait(lambda: stop.signal_received is not None)
        open({second!r}, "w").close()
        _wait(lambda: False)  # the second signal's KeyboardInterrupt ends this wait
"""


def _send_when(process, marker: Path, signum: int) -> None:
    deadline = time.monotonic() + 300
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), process.communicate()[1][-3000:]
    process.send_signal(signum)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_exits_with_the_shells_status_for_it(tmp_path, zygote, second):
    recipe = causal_recipe(tmp_path, ROWS, peft=LORA, trainer={"max_steps": 6, "limit_val_batches": 0})
    first, again = tmp_path / "first", tmp_path / "second"
    (tmp_path / "two_signals.py").write_text(textwrap.dedent(PAUSE.format(first=str(first), second=str(again))))
    program = tmp_path / "fit_main.py"
    # SIGINT as a terminal leaves it (a test run started in the background would hand the child an ignored one).
    program.write_text("import signal, sys, torch; signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "torch.set_num_threads(1); from peftplug.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = zygote().start(program, ["fit", "--config", str(recipe),
                                       "--trainer.callbacks+=two_signals.TwoSignalsInStep"], env, tmp_path)
    _send_when(process, first, signal.SIGINT)
    _send_when(process, again, second)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 128 + second, err[-3000:]
    assert "SIGINT received" in err and "Traceback" not in err, err[-3000:]
    # Aborted inside step 2: nothing more was written (the checkpoint the first signal announced included).
    assert "checkpoint written" not in err and not (tmp_path / "runs" / "checkpoints" / "last.ckpt").exists()


def test_python_api_gets_its_sigint_handler_back_after_an_abort(tmp_path, run_fresh):
    """A notebook-style caller of ``trainer.fit``: after the second Ctrl-C, its own SIGINT handler is back (Lightning
    sets SIGINT to ignored while it tears down; had it stayed so, Ctrl-C would no longer work in the session)."""
    proc = run_fresh(f"""
        import json, os, signal, torch
        import lightning as L
        from peft import LoraConfig
        from peftplug.data import CausalLMData
        from peftplug.interrupt import GracefulInterrupt
        from peftplug.lightning import PeftModule

        torch.set_num_threads(1)
        rows = [{{"prompt": f"Q{{i}}", "response": f" {{i}}"}} for i in range(12)]
        path = {str(tmp_path / "rows.jsonl")!r}
        open(path, "w").write("\\n".join(json.dumps(r) for r in rows))
        caught = []
        def session_handler(signum, frame):  # what an interactive session has installed
            caught.append(signum)
        signal.signal(signal.SIGINT, session_handler)

        class TwoCtrlC(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == 1:
                    os.kill(os.getpid(), signal.SIGINT)
                    os.kill(os.getpid(), signal.SIGINT)

        data = CausalLMData(train_file=path, prompt_column="prompt", response_column="response", batch_size=4)
        module = PeftModule("tiny:llama", peft=LoraConfig(r=2, target_modules=["q_proj"]))
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            max_steps=4, default_root_dir={str(tmp_path / "runs")!r},
                            callbacks=[TwoCtrlC(), GracefulInterrupt()])
        try:
            trainer.fit(module, datamodule=data)
        except SystemExit as stop:
            print("exit", stop.code)
        print("handler back", signal.getsignal(signal.SIGINT) is session_handler)
        os.kill(os.getpid(), signal.SIGINT)
        print("ctrl-c reaches it", caught == [signal.SIGINT])
    """)
    assert "exit 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "handler back True" in proc.stdout and "ctrl-c reaches it True" in proc.stdout, proc.stdout
