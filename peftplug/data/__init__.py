"""peftplug's LightningDataModules, one file each, on one public base class.

- :class:`TokenizedDataModule` (:mod:`peftplug.data.base`): the base: tokenizer lookup, loaders, padding.
- :class:`TextClassificationData`, :class:`BBCNewsData` (:mod:`peftplug.data.classification`).
- :class:`CausalLMData` (:mod:`peftplug.data.causal_lm`): plain text and instruction pairs, causal LM or seq2seq.
- :class:`ChatData`, :class:`BBCNewsChatData` (:mod:`peftplug.data.chat`): prompt/response through a chat template.
- :class:`PromptClassificationData` (:mod:`peftplug.data.prompt_cls`): k-shot tasks as prompts with label words;
  its task catalogue is :mod:`peftplug.data.prompt_tasks`, its templates :mod:`peftplug.data.prompt_templates`, its
  k-shot file reading :mod:`peftplug.data.kshot` (the scoring is :mod:`peftplug.prompt_scoring`).

Local files are read with ``datasets`` (JSON, JSONL, CSV, TSV, Parquet; :mod:`peftplug.data.files`). Tokenization
happens in ``setup``; when no tokenizer is configured, the tokenizer of the trainer's
:class:`peftplug.lightning.PeftModule` is used, so a recipe names the model once.

Recipes and saved configs name these classes by their historical paths (``peftplug.data.BBCNewsData``,
``peftplug.chat_data.ChatData``, ``peftplug.prompt_cls.PromptClassificationData``): all keep resolving.
"""

from peftplug.data.base import TokenizedDataModule, pad_batch
from peftplug.data.causal_lm import CausalLMData
from peftplug.data.chat import BBCNewsChatData, ChatData, encode_chat
from peftplug.data.classification import BBCNewsData, TextClassificationData
from peftplug.data.files import check_val_fraction, read_splits, read_table
from peftplug.data.prompt_cls import PromptClassificationData

# The name of the base class when it was private (peftplug.data was one module); kept for code that imports it.
_TokenizedDataModule = TokenizedDataModule

__all__ = [
    "BBCNewsChatData",
    "BBCNewsData",
    "CausalLMData",
    "ChatData",
    "PromptClassificationData",
    "TextClassificationData",
    "TokenizedDataModule",
    "check_val_fraction",
    "encode_chat",
    "pad_batch",
    "read_splits",
    "read_table",
]
