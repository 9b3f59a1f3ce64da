"""Chat finetuning data: moved to :mod:`peftplug.data.chat`. This module keeps the old import path
(``peftplug.chat_data.ChatData`` in recipes, saved ``config.yaml`` files and checkpoints) resolving to the same
objects.
"""

from peftplug.data.base import TokenizedDataModule as _TokenizedDataModule  # noqa: F401
from peftplug.data.base import pad_batch  # noqa: F401
from peftplug.data.chat import (  # noqa: F401
    _ASSISTANT,
    _USER,
    GENERATION_KEYS,
    BBCNewsChatData,
    ChatData,
    _template_pieces,
    encode_chat,
)
from peftplug.data.classification import BBCNewsData  # noqa: F401
from peftplug.data.files import check_val_fraction, read_splits  # noqa: F401

__all__ = ["GENERATION_KEYS", "BBCNewsChatData", "ChatData", "encode_chat"]
