"""Data and templates shared by the TRL tests (a uniquely named module: several test folders have a conftest.py)."""

from __future__ import annotations

# The tiny tokenizer's ChatML template (peftplug.tiny.CHAT_TEMPLATE) with the assistant's answer and its end-of-turn
# token inside {% generation %} ... {% endgeneration %}: what TRL's assistant_only_loss needs. SmolLM2's own template
# is this ChatML without the markers (docs/trl.md).
GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SUMS = [(i, j) for i in range(4) for j in range(4)]


def messages_rows() -> list[dict]:
    """Conversational rows (``messages``), two turns each, so that more than one assistant answer is masked in."""
    return [
        {"messages": [
            {"role": "user", "content": f"add {i} {j}"}, {"role": "assistant", "content": str(i + j)},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": f"={i + j}"},
        ]}
        for i, j in SUMS
    ]


def prompt_completion_rows() -> list[dict]:
    """Conversational prompt/completion rows (TRL masks the prompt by default)."""
    return [
        {"prompt": [{"role": "user", "content": f"add {i} {j}"}],
         "completion": [{"role": "assistant", "content": str(i + j)}]}
        for i, j in SUMS
    ]


def preference_rows() -> list[dict]:
    """Conversational preference rows for DPO."""
    return [
        {"prompt": [{"role": "user", "content": f"add {i} {j}"}],
         "chosen": [{"role": "assistant", "content": str(i + j)}],
         "rejected": [{"role": "assistant", "content": str(i * j + 7)}]}
        for i, j in SUMS
    ]
