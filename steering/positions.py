"""Which token positions a steering vector acts on, decided once per forward pass.

A forward pre-hook on the module that owns the decoder blocks (e.g. ``LlamaModel``) records, for the chunk
of tokens being processed: the *cache position* of each token (how many tokens precede it in the sequence,
padding included: the cache length before this forward plus the offset in the chunk), the attention mask of
the chunk, the prompt length and, per row, the index of the last real prompt token. ``position_ids`` are
deliberately not used: under left padding they are shifted per row, and under KV-cache decoding they say
nothing about where the prompt ended.

The prompt length is known exactly inside ``generate`` (the steering model's ``generate`` sets it to the
prompt width) or inside :meth:`SteeringContext.prompt_length`. Otherwise a forward that starts at cache
position 0 is a fresh prompt (all its tokens are prompt), and later chunks continuing that cache are
generated tokens, which is what step-by-step manual decoding with a cache expects.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

# Returned by SteeringContext.mask when a policy selects no token of the current chunk.
NOTHING = False

# Names under which transformers passes the KV cache / the explicit cache positions to a base model.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


def _past_length(cache) -> int:
    """Number of tokens already in a KV cache (0 when there is none)."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and cache[0] is not None:  # legacy tuple-of-tuples cache
        return int(cache[0][0].shape[-2])
    return 0


def _padding_mask(attention_mask) -> torch.Tensor | None:
    """The 2-D ``[batch, keys]`` padding mask among what a model received as ``attention_mask``, or ``None``.

    Usually a 2-D tensor. Under a static cache, generate hands the base model prepared 4-D masks instead, and
    for models mixing sliding-window and full attention (Gemma-2/3) a dict of them keyed by attention type: neither
    says which tokens are padding without decoding the causal and window structure, so they count as "no padding
    information" (as a 4-D tensor always has). A dict holding a 2-D tensor is used.
    """
    if isinstance(attention_mask, dict):
        masks = [m for m in attention_mask.values() if torch.is_tensor(m) and m.dim() == 2]
        return masks[0] if masks else None
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
        return attention_mask
    return None


class SteeringContext:
    """Per-forward position bookkeeping shared by all steering layers of one model.

    Args:
        None. Call :meth:`install` on the module whose forward receives ``attention_mask`` and the cache.
    """

    def __init__(self):
        self._explicit_prompt_len: list[list] = []  # [length or None, generating]
        self._auto_prompt_len: int | None = None
        self._auto_last_prompt: torch.Tensor | None = None
        self._signature: inspect.Signature | None = None
        self._handle = None
        self.reset()

    def reset(self) -> None:
        """Forgets the current forward's state (masks are recomputed on the next forward)."""
        self.active = False
        self.positions: torch.Tensor | None = None
        self.chunk_mask: torch.Tensor | None = None
        self.prompt_len: int = 0
        self.last_prompt: torch.Tensor | None = None
        self._cache: dict = {}

    # ----------------------------------------------------------------------------------------- installation
    def install(self, owner: torch.nn.Module) -> None:
        """Registers the forward pre-hook on ``owner`` (idempotent).

        Args:
            owner: The module that calls the decoder blocks (``LlamaModel``, ``GPT2Model``, ...).
        """
        if self._handle is not None:
            return
        self._signature = inspect.signature(owner.forward)
        self._handle = owner.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def uninstall(self) -> None:
        """Removes the pre-hook."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pre_hook(self, module, args, kwargs):
        if args:
            bound = self._signature.bind_partial(*args, **kwargs).arguments
            extra = bound.pop("kwargs", None)
            if isinstance(extra, dict):
                bound.update(extra)
        else:
            bound = kwargs
        ids = bound.get("input_ids")
        ref = ids if ids is not None else bound.get("inputs_embeds")
        if ref is None:
            self.reset()
            return
        cache_position = bound.get("cache_position")
        if cache_position is not None:
            past = int(cache_position.reshape(-1)[0])
        else:
            past = 0
            for key in _CACHE_KWARGS:
                if bound.get(key) is not None:
                    past = _past_length(bound[key])
                    break
        self.begin_forward(ref.shape[0], ref.shape[1], past, bound.get("attention_mask"), ref.device)
        return

    # ------------------------------------------------------------------------------------------- state
    @contextlib.contextmanager
    def prompt_length(self, length: int, generating: bool = False):
        """Declares the prompt length for the forwards inside the block (``generate`` uses this).

        Args:
            length: Number of prompt tokens (the padded prompt width for a batch), or ``None``: the width of the
                first forward inside the block (an encoder-decoder's decoder inside ``generate``, whose prompt is
                its start token(s), not the encoder input; the first decoder forward holds exactly them, with or
                without a KV cache).
            generating: The forwards are ``generate``'s: every token after the prompt is then a real token
                (``generate`` extends the attention mask with ones), so those chunks need no padding mask.
        """
        if length is not None and int(length) < 0:
            raise ValueError(f"prompt length must be >= 0, got {length}")
        self._explicit_prompt_len.append([None if length is None else int(length), bool(generating)])
        try:
            yield
        finally:
            self._explicit_prompt_len.pop()

    def begin_forward(self, batch: int, length: int, past: int, attention_mask, device) -> None:
        """Records a chunk of ``length`` tokens that follows ``past`` cached tokens.

        Nothing is computed here (this runs on every decoding step); :meth:`mask` builds what a policy needs.

        Args:
            batch: Batch size.
            length: Number of tokens in this forward.
            past: Number of tokens before them in the sequence (cache length).
            attention_mask: The model's ``attention_mask`` (2-D ``[batch, past + length]`` or
                ``[batch, length]``), or ``None``. 4-D masks and dicts of them (hybrid sliding-window models under
                a static cache) are ignored (no padding information assumed).
            device: Device of the hidden states.
        """
        self._cache = {}
        self._past, self._length, self._device, self._batch = past, length, device, batch
        self.positions = None
        mask2d = _padding_mask(attention_mask)
        generating = False
        if self._explicit_prompt_len:
            declared = self._explicit_prompt_len[-1]
            if declared[0] is None:  # "the first forward's width": this is the first forward
                declared[0] = past + length
            prompt_len, generating = declared
        elif past == 0:
            prompt_len = length
            self._auto_prompt_len = length
        else:
            prompt_len = self._auto_prompt_len if self._auto_prompt_len is not None else past
        self.prompt_len = prompt_len
        chunk = None
        # A chunk of generated tokens inside ``generate`` has no padding (``generate`` extends the attention mask
        # with ones), so it needs no padding mask: "all" is then a plain add on the decoding hot path.
        if mask2d is not None and not (generating and past >= prompt_len):
            if mask2d.shape[1] >= past + length:
                chunk = mask2d[:, past:past + length]
            elif mask2d.shape[1] == length:
                chunk = mask2d
        self.chunk_mask = chunk
        self.active = True
        # The last real prompt token per row is only needed by "from_last_prompt": computed lazily.
        self._mask2d = mask2d
        self._fresh = past == 0 and not self._explicit_prompt_len
        self.last_prompt = None

    def _last_prompt_index(self) -> torch.Tensor:
        """Per row, the index of the last 1 of the attention mask among the first ``prompt_len`` columns."""
        if self.last_prompt is not None:
            return self.last_prompt
        prompt_len, mask2d, device = self.prompt_len, self._mask2d, self._device
        if mask2d is not None and mask2d.shape[1] >= prompt_len > 0:
            prompt_mask = mask2d[:, :prompt_len].to(device=device, dtype=torch.bool)
            idx = torch.arange(prompt_len, device=device).expand_as(prompt_mask)
            last = torch.where(prompt_mask, idx, torch.full_like(idx, -1)).amax(dim=1)
            last = torch.where(last < 0, torch.full_like(last, prompt_len - 1), last)
        elif not self._fresh and self._auto_last_prompt is not None \
                and self._auto_last_prompt.shape[0] == self._batch:
            last = self._auto_last_prompt.to(device)
        else:
            last = torch.full((self._batch,), max(prompt_len - 1, 0), device=device, dtype=torch.long)
        self.last_prompt = last
        if self._fresh:
            self._auto_last_prompt = last
        return last

    def _whole_chunk(self, policy: str) -> bool | None:
        """``True``/``False`` when ``policy`` selects every / no token of this chunk by position, else ``None``."""
        start, end, prompt_len = self._past, self._past + self._length, self.prompt_len
        if policy == "generated":
            return True if start >= prompt_len else (False if end <= prompt_len else None)
        if policy == "prompt":
            return True if end <= prompt_len else (False if start >= prompt_len else None)
        if policy == "from_last_prompt":
            # The last real prompt token is at most prompt_len - 1, so a chunk past the prompt is all selected.
            return True if start >= prompt_len else None
        return None

    def mask(self, policy: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The ``[batch, length, 1]`` 0/1 mask of positions steered under ``policy``.

        ``None`` means every position, :data:`NOTHING` no position (the layer then skips the adapter).

        Args:
            policy: One of ``steering.config.POSITIONS``.
            dtype: dtype of the returned mask (that of the hidden states).
        """
        key = (policy, dtype)
        if key in self._cache:
            return self._cache[key]
        if not self.active:
            # No bookkeeping (the blocks were called without their owner): steer everything.
            out = None
        elif policy == "all":
            out = None if self.chunk_mask is None else self.chunk_mask.to(device=self._device, dtype=dtype)[..., None]
        elif (span := self._whole_chunk(policy)) is not None:
            # The whole chunk is on one side of the prompt boundary (every KV-cache decoding step is): the policy
            # reduces to "all" or to "nothing", without building a position mask each step.
            out = self.mask("all", dtype) if span else NOTHING
        else:
            if self.positions is None:
                self.positions = torch.arange(self._past, self._past + self._length, device=self._device)
            pos = self.positions[None, :]
            if policy == "prompt":
                sel = pos < self.prompt_len
            elif policy == "generated":
                sel = pos >= self.prompt_len
            elif policy == "from_last_prompt":
                sel = pos >= self._last_prompt_index()[:, None]
            else:
                raise ValueError(f"unknown position policy {policy!r}")
            if self.chunk_mask is not None:
                sel = sel & self.chunk_mask.to(device=self._device, dtype=torch.bool)
            out = sel.to(dtype)[..., None]
        self._cache[key] = out
        return out
