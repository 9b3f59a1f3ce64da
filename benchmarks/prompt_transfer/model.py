"""all-MiniLM-L6-v2 with the pooling it was trained with (mean over tokens) under a linear classification head.

``BertForSequenceClassification`` classifies the pooler output of the first position. all-MiniLM-L6-v2 was
trained as a sentence-transformer with *mean* pooling, so its first-position/pooler features are weak (a linear
probe on them stays near chance on 16-shot MR). This subclass keeps the same modules and parameter names (so PEFT's
``SEQ_CLS`` path, ``modules_to_save=["classifier"]`` and saving work unchanged) and only changes the readout:
masked mean of the last hidden states (virtual prompt tokens included, as PEFT extends the attention mask) →
dropout → ``classifier``.
"""

from __future__ import annotations

import torch
from transformers import BertForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput


class MeanPoolBertForSequenceClassification(BertForSequenceClassification):
    """BERT classifier on the attention-masked mean of the last hidden states (sentence-transformers pooling)."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs):
        """Same inputs as ``BertForSequenceClassification.forward``; returns logits (and loss with labels).

        Args:
            input_ids: Token ids (or pass ``inputs_embeds``).
            attention_mask: ``[batch, seq]`` mask.
            token_type_ids: Segment ids.
            inputs_embeds: Input embeddings (PEFT prompt learning passes these).
            labels: Class ids.
            **kwargs: Ignored extras PEFT may pass (``output_attentions`` etc.).
        """
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                           inputs_embeds=inputs_embeds).last_hidden_state
        if attention_mask is None:
            pooled = hidden.mean(1)
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)
