"""Fourth review of ``peftplug generate`` / ``chat`` / ``predict``:

- Ctrl-C in ``peftplug chat`` (at the prompt, or while a long answer is generated) ended the session with a
  15-line ``KeyboardInterrupt`` traceback; now Ctrl-C at the prompt ends the session as Ctrl-D does, and during an
  answer it drops that message and the session goes on.
- The parameter line counted a bitsandbytes 4-bit weight by its packed storage (two values per byte): an nf4 model
  reported about half its size, and a QOFT/QLoRA run a trainable share about twice too large.
- ``peftplug predict`` (predictions on stdout) printed Lightning's progress bar on stdout too, so the first line of
  ``peftplug predict ... > predictions.jsonl`` was not JSON.
"""

from __future__ import annotations

import io
import json
import signal

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
from test_gen_review3_generate import _parameter_lines

from peftplug.cli import main
from peftplug.generate_cli import Generator, chat_loop

LORA = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}


class _CtrlC(io.StringIO):
    """Standard input whose reads, once its lines are used up, are interrupted by a real SIGINT (Ctrl-C in a
    terminal): Python's default handler raises ``KeyboardInterrupt`` inside ``readline``, as it does there."""

    def readline(self, *args) -> str:
        line = super().readline(*args)
        if not line:
            signal.raise_signal(signal.SIGINT)
        return line


@pytest.fixture
def _default_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt), as in a terminal: a test run before may have left another."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("_default_sigint")
def test_ctrl_c_stops_an_answer_or_ends_the_session_without_a_traceback():
    generator = Generator(model="tiny:llama")
    first, second = "Tell me a long story.", "Name a colour."
    calls = []

    def interrupt_first_answer(module, args):  # SIGINT arrives while the first answer is being generated
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)

    handle = generator.module.model.register_forward_pre_hook(interrupt_first_answer)
    out = io.StringIO()
    try:
        chat_loop(generator, 8, 0.0, _CtrlC(f"{first}\n{second}\n"), out)
    except KeyboardInterrupt:
        pytest.fail(f"Ctrl-C escaped the chat as a traceback; it printed {out.getvalue()!r}")
    finally:
        handle.remove()
    assert len(calls) > 3, "the interrupt did not reach the first answer; the test would not see it"
    lines = out.getvalue().splitlines()
    assert "peftplug: answer interrupted (Ctrl-C); the conversation goes on without that message" in lines
    # The interrupted message is not part of the conversation: the second answer is that of the second alone.
    expected = generator.answer([generator.encode([{"role": "user", "content": second}])], 8)[0].strip()
    assert [line for line in lines if "model> " in line] == [f"you> model> {expected}"]
    assert out.getvalue().endswith("you> \n")  # Ctrl-C at the prompt ended the session, as Ctrl-D does


def test_an_nf4_model_reports_the_parameters_of_its_unquantized_self(info_lines):
    from peftplug.lightning import PeftModule
    from peftplug.parameter_report import for_generation

    full = PeftModule("tiny:llama", peft=LORA)
    trainable = sum(p.numel() for p in full.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in full.model.parameters())
    quantized = PeftModule("tiny:llama", quantization="nf4", peft=LORA)
    assert any(type(p).__name__ == "Params4bit" for p in quantized.model.parameters())  # packed: what is counted
    line = f"peftplug: trainable parameters {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)"
    assert _parameter_lines(info_lines) == [line, line]  # the full-precision module's line, and the nf4 one's
    # PEFT's own count of the quantized model agrees.
    assert quantized.model.get_nb_trainable_parameters() == (trainable, total)
    info_lines.clear()
    with for_generation():
        PeftModule("tiny:llama", quantization="nf4")
    bare = total - trainable
    assert _parameter_lines(info_lines) == [f"peftplug: generating with the model as it is ({bare:,} parameters, no adapter)"]


def test_predict_on_stdout_prints_json_lines_only_with_the_progress_bar_on(tmp_path, capsys):
    """Needs the one-line change to peftplug/cli.py's ``predict`` (run ``trainer.predict`` under
    ``contextlib.redirect_stdout(sys.stderr)``) reported by the fourth review."""
    from tests.tiny_recipes import causal_recipe

    rows = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(8)]
    recipe = causal_recipe(tmp_path, rows, peft=LORA, trainer={"max_steps": 1, "limit_val_batches": 0},
                           data={"batch_size": 4, "val_fraction": 0.25})
    assert main(["fit", "--config", str(recipe)]) == 0
    (ckpt,) = (tmp_path / "runs").rglob("*.ckpt")
    capsys.readouterr()
    assert main(["predict", "--config", str(recipe), "--ckpt_path", str(ckpt), "--model.max_new_tokens", "3",
                 "--trainer.enable_progress_bar", "true"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not not_json, f"stdout holds lines that are not JSON: {not_json}"
    assert [json.loads(line)["index"] for line in lines] == [0, 1]  # 2 validation rows of 8
    assert "Predicting" in captured.err  # the progress bar is still shown, on stderr
