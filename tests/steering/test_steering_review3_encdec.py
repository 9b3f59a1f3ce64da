"""Third review: steering the DECODER blocks of an encoder-decoder model (tiny T5) inside ``generate``.

``SteeringModel.generate`` declared the encoder input's width as the prompt length, but the decoder's prompt is
its start token: with a 6-token encoder input, ``positions="generated"`` left the first 6 generated tokens
unsteered and ``"prompt"`` steered them. The reference here is a plain T5 decoded greedily by full forwards, with
forward hooks adding ``m * v`` at the decoder positions the policy names (position 0 is the start token)."""

from __future__ import annotations

import peft
import pytest
import torch

from peftplug.tiny import tiny_model
from steering import SteeringConfig
from steering.model import steering_model_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MULTIPLIER, NEW_TOKENS = 30.0, 8


def _vectors() -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {i: torch.randn(64, generator=generator) for i in (0, 1)}


def _reference(encoder_ids: torch.Tensor, steered) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding of the plain model, full forwards, ``m * v`` added where ``steered(position)`` holds."""
    model = tiny_model("t5", "seq2seq").eval()
    vectors = _vectors()

    def hook(index):
        def add(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            select = torch.tensor([steered(p) for p in range(hidden.shape[1])], dtype=hidden.dtype)[None, :, None]
            hidden = hidden + select * MULTIPLIER * vectors[index].to(hidden.dtype)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return add

    handles = [model.decoder.block[i].register_forward_hook(hook(i)) for i in (0, 1)]
    decoder = torch.full((1, 1), model.config.decoder_start_token_id)
    scores = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=encoder_ids, decoder_input_ids=decoder, use_cache=False).logits[:, -1]
            scores.append(logits)
            decoder = torch.cat([decoder, logits.argmax(-1, keepdim=True)], dim=1)
    for handle in handles:
        handle.remove()
    return decoder[0].tolist(), scores


@pytest.mark.parametrize(("positions", "steered"), [("generated", lambda p: p >= 1), ("prompt", lambda p: p < 1),
                                                     ("from_last_prompt", lambda p: p >= 0)])
@pytest.mark.parametrize("use_cache", [True, False])
def test_decoder_blocks_are_steered_by_decoder_positions_in_generate(positions, steered, use_cache):
    encoder_ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    model = peft.get_peft_model(tiny_model("t5", "seq2seq"),
                                SteeringConfig(layers=[0, 1], positions=positions, task_type="SEQ_2_SEQ_LM",
                                               blocks_path="decoder.block", multiplier=MULTIPLIER))
    steering_model_of(model).set_vectors(_vectors())
    model.eval()
    out = model.generate(input_ids=encoder_ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=use_cache,
                         output_scores=True, return_dict_in_generate=True)
    sequence, scores = _reference(encoder_ids, steered)
    assert out.sequences[0].tolist() == sequence
    for got, want in zip(out.scores, scores):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The steering is visible: the unsteered model's first scores differ from the steered ones.
    with model.disable_adapter():
        base = model.generate(input_ids=encoder_ids, max_new_tokens=2, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
    assert (base.scores[1] - out.scores[1]).abs().max() > 1e-3


def test_encoder_blocks_keep_the_encoder_width_as_the_prompt():
    # Steering the encoder under "prompt": every encoder token is prompt, as before.
    encoder_ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    model = peft.get_peft_model(tiny_model("t5", "seq2seq"),
                                SteeringConfig(layers=[0, 1], positions="prompt", task_type="SEQ_2_SEQ_LM",
                                               blocks_path="encoder.block", multiplier=MULTIPLIER))
    steering_model_of(model).set_vectors(_vectors())
    model.eval()
    everywhere = peft.get_peft_model(tiny_model("t5", "seq2seq"),
                                     SteeringConfig(layers=[0, 1], positions="all", task_type="SEQ_2_SEQ_LM",
                                                    blocks_path="encoder.block", multiplier=MULTIPLIER))
    steering_model_of(everywhere).set_vectors(_vectors())
    everywhere.eval()
    kwargs = {"input_ids": encoder_ids, "max_new_tokens": 4, "do_sample": False, "output_scores": True,
              "return_dict_in_generate": True}
    for got, want in zip(model.generate(**kwargs).scores, everywhere.generate(**kwargs).scores):
        torch.testing.assert_close(got, want)
