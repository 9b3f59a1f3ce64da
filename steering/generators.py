"""Steering-vector generators: CAA, PCA-diff, PCA-center, vector-prompt and a gradient-trained vector.

All generators read the *output of decoder block L* (the same hook point the applier writes to), from the
base model (adapters disabled), in batches with a progress bar. Pairs are ``(positive_text, negative_text)``.

Where activations are read (``read``):

- ``"answer"`` (CAA's default, as in EasyEdit2): the mean over the tokens after the longest common token
  prefix of the two texts of a pair -- the "answer" that distinguishes them (at least the last token);
- ``"last"``: the last token (repeng's choice);
- ``"mean"``: the mean over all tokens;
- ``"second_to_last"``: the token before the last (EasyEdit2's multiple-choice CAA, whose texts end in
  ``"\nAnswer: X"``).

Besides ``(positive_text, negative_text)`` pairs, :func:`train_steering_vector` takes EasyEdit2's rows
(``{"question", "matching", "not_matching"}``, or ``{"input", "output", "prompt"?}`` for vector-prompt), tokenized
as EasyEdit2 does (:mod:`steering.easyedit_data`), so the CAA vector is exactly EasyEdit2's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from steering.config import TRAINABLE_POSITIONS, check_trainable_positions
from steering.easyedit_data import TokenizedPairs, caa_rows, is_rows, vector_prompt_rows
from steering.families import find_blocks
from steering.layer import SteeringLayer, check_no_zero_ablation
from steering.model import refuse_training_on_repacked_4bit
from steering.padding import pad_sequences, pad_token_id

METHODS = ("caa", "pca_diff", "pca_center", "vector_prompt", "trainable")
READ_POSITIONS = ("answer", "last", "mean", "second_to_last")
OBJECTIVES = ("preference", "lm")


# --------------------------------------------------------------------------------------------- plumbing
def _validate_pairs(pairs) -> list[tuple[str, str]]:
    if pairs is None or len(pairs) == 0:
        raise ValueError("pairs is empty: steering vectors need at least one (positive_text, negative_text) pair")
    out = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"pairs[{i}] must be a (positive_text, negative_text) pair, got {pair!r}")
        pos, neg = pair
        if not isinstance(pos, str) or not isinstance(neg, str) or not pos or not neg:
            raise ValueError(f"pairs[{i}] must hold two non-empty strings, got {pair!r}")
        out.append((pos, neg))
    return out


def _validate_layers(model, layers, blocks_path: str | None = None) -> list[int]:
    _, blocks = find_blocks(model, blocks_path)
    if layers is None:
        raise ValueError(f"layers must be given (0-based decoder block indices, 0..{len(blocks) - 1})")
    layers = [layers] if isinstance(layers, int) else list(layers)
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < len(blocks)]
    if not layers or bad:
        raise ValueError(f"layers {layers} invalid: the model has {len(blocks)} blocks (0..{len(blocks) - 1})")
    return sorted(set(layers))


@contextlib.contextmanager
def _base_forward(model):
    """Runs the base model: adapters disabled (if any), eval mode, no grad."""
    disable = getattr(model, "disable_adapter", None)
    was_training = model.training
    model.eval()
    try:
        with (disable() if callable(disable) else contextlib.nullcontext()), torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _encode(tokenizer, texts: Sequence) -> list[list[int]]:
    """Token ids per text; a text given as a list of ids is taken as it is (already tokenized)."""
    seqs = [list(t) if isinstance(t, (list, tuple)) else list(tokenizer(t)["input_ids"]) for t in texts]
    for t, s in zip(texts, seqs):
        if not s:
            raise ValueError(f"text {t!r} encodes to no tokens")
    return seqs


def _device(model) -> torch.device:
    ref = next(model.parameters(), None)
    return ref.device if ref is not None else torch.device("cpu")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def extract_activations(
    model,
    tokenizer,
    texts: Sequence[str],
    layers: Sequence[int],
    read: str = "last",
    starts: Sequence[int] | None = None,
    batch_size: int = 8,
    progress: bool = True,
    desc: str = "extracting activations",
    blocks_path: str | None = None,
) -> dict[int, torch.Tensor]:
    """Reads decoder-block outputs of the base model, one vector per text and layer.

    Args:
        model: A transformers model or a ``PeftModel`` (its adapters are disabled while reading).
        tokenizer: Its tokenizer (each text is encoded on its own, then right-padded).
        texts: The texts (strings, or lists of token ids taken as they are).
        layers: 0-based block indices.
        read: ``"last"``, ``"mean"``, ``"second_to_last"`` or ``"answer"`` (needs ``starts``).
        starts: For ``"answer"``: per text, the index of the first answer token.
        batch_size: Texts per forward pass.
        progress: Show a progress bar.
        desc: Progress-bar label.
        blocks_path: ``SteeringConfig.blocks_path`` of the adapter the vectors are for (``None``: the family
            registry), so that they are read where they will be added.

    Returns:
        ``{layer: tensor [len(texts), hidden]}`` in fp32 on the CPU.
    """
    if read not in READ_POSITIONS:
        raise ValueError(f"read must be one of {READ_POSITIONS}, got {read!r}")
    if not texts:
        raise ValueError("texts is empty")
    if read == "answer" and (starts is None or len(starts) != len(texts)):
        raise ValueError("read='answer' needs one start index per text")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    layers = _validate_layers(model, layers, blocks_path)
    _, blocks = find_blocks(model, blocks_path)
    seqs = _encode(tokenizer, texts)
    device = _device(model)
    captured: dict[int, torch.Tensor] = {}

    def make_hook(layer):
        def hook(module, args, output):
            captured[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [blocks[layer].register_forward_hook(make_hook(layer)) for layer in layers]
    out = {layer: [] for layer in layers}
    try:
        with _base_forward(model):
            bar = tqdm(range(0, len(seqs), batch_size), desc=desc, disable=not progress, leave=False)
            for lo in bar:
                chunk = seqs[lo:lo + batch_size]
                ids, mask = (t.to(device) for t in pad_sequences(chunk, pad_token_id(tokenizer)))
                model(input_ids=ids, attention_mask=mask, use_cache=False)
                for j, s in enumerate(chunk):
                    n = len(s)
                    if read == "last":
                        lo_i, hi_i = n - 1, n
                    elif read == "second_to_last":
                        lo_i = max(n - 2, 0)
                        hi_i = lo_i + 1
                    elif read == "mean":
                        lo_i, hi_i = 0, n
                    else:
                        lo_i, hi_i = min(int(starts[lo + j]), n - 1), n
                    for layer in layers:
                        out[layer].append(captured[layer][j, lo_i:hi_i].float().mean(dim=0).cpu())
    finally:
        for h in handles:
            h.remove()
    return {layer: torch.stack(vs) for layer, vs in out.items()}


def _pair_activations(model, tokenizer, pairs, layers, read, batch_size, progress, blocks_path=None):
    if isinstance(pairs, TokenizedPairs):
        # EasyEdit2 rows: the answer span is fixed by the tokenized question, not by a common prefix.
        read = pairs.read if read in (None, "answer", pairs.read) else read
        pos = extract_activations(model, tokenizer, pairs.pos, layers, read, pairs.pos_start, batch_size, progress,
                                  desc="matching", blocks_path=blocks_path)
        neg = extract_activations(model, tokenizer, pairs.neg, layers, read, pairs.neg_start, batch_size, progress,
                                  desc="not matching", blocks_path=blocks_path)
        return pos, neg
    pairs = _validate_pairs(pairs)
    pos_texts, neg_texts = [p for p, _ in pairs], [n for _, n in pairs]
    starts_pos = starts_neg = None
    if read == "answer":
        pos_ids, neg_ids = _encode(tokenizer, pos_texts), _encode(tokenizer, neg_texts)
        common = [_common_prefix(a, b) for a, b in zip(pos_ids, neg_ids)]
        starts_pos, starts_neg = common, common
    pos = extract_activations(model, tokenizer, pos_texts, layers, read, starts_pos, batch_size, progress,
                              desc="positive texts", blocks_path=blocks_path)
    neg = extract_activations(model, tokenizer, neg_texts, layers, read, starts_neg, batch_size, progress,
                              desc="negative texts", blocks_path=blocks_path)
    return pos, neg


# --------------------------------------------------------------------------------------------- generators
def caa_vectors(model, tokenizer, pairs, layers, read: str = "answer", batch_size: int = 8, progress: bool = True,
                blocks_path: str | None = None):
    """Contrastive activation addition: ``v_L = mean_i (h_L(pos_i) - h_L(neg_i))``.

    Args:
        model: Model (or PeftModel; adapters disabled while reading).
        tokenizer: Tokenizer.
        pairs: ``(positive_text, negative_text)`` pairs, or :class:`~steering.easyedit_data.TokenizedPairs`
            (EasyEdit2 rows; then ``read`` defaults to the rows' own read position).
        layers: Block indices.
        read: Where to read activations (see module docstring).
        batch_size: Texts per forward.
        progress: Show progress bars.
        blocks_path: The adapter's ``blocks_path`` (see :func:`extract_activations`).

    Returns:
        ``{layer: vector}``.
    """
    pos, neg = _pair_activations(model, tokenizer, pairs, layers, read, batch_size, progress, blocks_path)
    return {layer: (pos[layer] - neg[layer]).mean(dim=0) for layer in pos}


def _top_direction(x: torch.Tensor) -> torch.Tensor:
    """First right-singular vector of ``x`` (rows = samples); no centering (callers centre if they mean to)."""
    _, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return vh[0].float()


def pca_vectors(
    model, tokenizer, pairs, layers, mode: str = "diff", read: str = "last", batch_size: int = 8,
    progress: bool = True, blocks_path: str | None = None,
):
    """repeng's PCA generators.

    ``mode="diff"``: first principal component of the pair differences ``pos_i - neg_i`` (centred, as repeng's
    sklearn PCA does: the direction along which the differences vary most);
    ``mode="center"``: first principal direction of the activations centred on each pair's mean
    (``pos_i - c_i`` and ``neg_i - c_i``, ``c_i = (pos_i + neg_i) / 2``; equivalently the top right-singular
    vector of the uncentred differences, so it is dominated by the mean difference). The sign is chosen so positives
    project above negatives, and the unit direction is scaled by the mean projected difference, so that
    multiplier 1 shifts activations about as much as the CAA vector does.

    Args:
        model: Model (or PeftModel).
        tokenizer: Tokenizer.
        pairs: ``(positive_text, negative_text)`` pairs.
        layers: Block indices.
        mode: ``"diff"`` or ``"center"``.
        read: Where to read activations.
        batch_size: Texts per forward.
        progress: Show progress bars.
        blocks_path: The adapter's ``blocks_path`` (see :func:`extract_activations`).
    """
    if mode not in ("diff", "center"):
        raise ValueError(f"mode must be 'diff' or 'center', got {mode!r}")
    pos, neg = _pair_activations(model, tokenizer, pairs, layers, read, batch_size, progress, blocks_path)
    out = {}
    for layer in pos:
        diff = pos[layer] - neg[layer]
        if mode == "diff":
            # repeng fits sklearn's PCA, which centres: the axis along which the pair differences vary most.
            x = diff - diff.mean(dim=0) if diff.shape[0] > 1 else diff
        else:
            center = (pos[layer] + neg[layer]) / 2
            x = torch.cat([pos[layer] - center, neg[layer] - center])
        u = _top_direction(x)
        scale = (diff @ u).mean()
        if scale < 0:
            u, scale = -u, -scale
        out[layer] = u * scale
    return out


def vector_prompt_vectors(
    model, tokenizer, texts: Sequence[str], prompt: str, layers, read: str = "last", batch_size: int = 8,
    progress: bool = True, separator: str = " ", blocks_path: str | None = None,
):
    """Vector-prompt: the mean activation difference with vs without a steering prompt before each text.

    Args:
        model: Model (or PeftModel).
        tokenizer: Tokenizer.
        texts: Inputs (e.g. neutral questions or story openings).
        prompt: The steering prompt (e.g. ``"Write a happy story."``).
        layers: Block indices.
        read: Where to read activations (``"last"``: the text's last token in both variants).
        batch_size: Texts per forward.
        progress: Show progress bars.
        separator: Joined between prompt and text.
        blocks_path: The adapter's ``blocks_path`` (see :func:`extract_activations`).
    """
    if not prompt:
        raise ValueError("vector_prompt needs a non-empty steering prompt")
    if not texts:
        raise ValueError("texts is empty: vector_prompt needs at least one input text")
    pairs = [(prompt + separator + t, t) for t in texts]
    return caa_vectors(model, tokenizer, pairs, layers, read=read, batch_size=batch_size, progress=progress,
                       blocks_path=blocks_path)


# --------------------------------------------------------------------------------------------- training
def collate_pairs(tokenizer, pairs, device=None) -> dict[str, torch.Tensor]:
    """Tokenises pairs for :func:`steering_loss` (right-padded; answer = tokens after the common prefix).

    Args:
        tokenizer: Tokenizer.
        pairs: ``(positive_text, negative_text)`` pairs, or :class:`~steering.easyedit_data.TokenizedPairs`
            (then the answer is what follows each row's question).
        device: Target device.

    Returns:
        Dict with ``pos_ids, pos_mask, pos_answer, neg_ids, neg_mask, neg_answer`` (``*_answer`` marks the
        tokens whose log-probability is scored).
    """
    if isinstance(pairs, TokenizedPairs):
        pos, neg = pairs.pos, pairs.neg
        starts = {"pos": pairs.pos_start, "neg": pairs.neg_start}
    else:
        pairs = _validate_pairs(pairs)
        pos = _encode(tokenizer, [p for p, _ in pairs])
        neg = _encode(tokenizer, [n for _, n in pairs])
        common = [_common_prefix(a, b) for a, b in zip(pos, neg)]
        starts = {"pos": common, "neg": common}
    batch = {}
    for key, seqs in (("pos", pos), ("neg", neg)):
        ids, mask = (t.to(device or "cpu") for t in pad_sequences(seqs, pad_token_id(tokenizer)))
        answer = torch.zeros_like(mask)
        for i, s in enumerate(seqs):
            start = max(1, min(starts[key][i], len(s) - 1))
            answer[i, start:len(s)] = 1
        batch[f"{key}_ids"], batch[f"{key}_mask"], batch[f"{key}_answer"] = ids, mask, answer
    return batch


def _sequence_logprob(model, ids, mask, answer) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logp * answer[:, 1:]).sum(dim=1)


def steering_loss(model, batch: dict, objective: str = "preference", beta: float = 1.0) -> torch.Tensor:
    """Loss of a steering adapter on a batch from :func:`collate_pairs`.

    ``"lm"``: mean negative log-likelihood of the positive answers under steering (per answer token).
    ``"preference"`` (BiPO-style DPO with the unsteered model as reference):
    ``-log sigmoid(beta * [(log p_v(pos) - log p_0(pos)) - (log p_v(neg) - log p_0(neg))])``.

    Args:
        model: A ``PeftModel`` with the steering adapter active (``disable_adapter`` gives the reference).
        batch: Output of :func:`collate_pairs`.
        objective: One of :data:`OBJECTIVES`.
        beta: Inverse temperature of the preference loss.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "lm":
        lp = _sequence_logprob(model, batch["pos_ids"], batch["pos_mask"], batch["pos_answer"])
        return -(lp.sum() / batch["pos_answer"][:, 1:].sum().clamp_min(1))
    lp_pos = _sequence_logprob(model, batch["pos_ids"], batch["pos_mask"], batch["pos_answer"])
    lp_neg = _sequence_logprob(model, batch["neg_ids"], batch["neg_mask"], batch["neg_answer"])
    with model.disable_adapter(), torch.no_grad():
        ref_pos = _sequence_logprob(model, batch["pos_ids"], batch["pos_mask"], batch["pos_answer"])
        ref_neg = _sequence_logprob(model, batch["neg_ids"], batch["neg_mask"], batch["neg_answer"])
    margin = (lp_pos - ref_pos) - (lp_neg - ref_neg)
    return -F.logsigmoid(beta * margin).mean()


def train_vectors(
    peft_model, tokenizer, pairs, objective: str = "preference", steps: int = 50, lr: float = 0.05,
    batch_size: int = 8, beta: float = 1.0, seed: int = 0, progress: bool = True,
) -> list[float]:
    """Gradient-trains the active steering adapter's vectors (the only trainable parameters touched).

    A deliberately small loop for scripts and tests; the vectors are ordinary PEFT parameters, so
    ``peftplug.lightning`` can train them with :func:`steering_loss` as well.

    Args:
        peft_model: ``PeftModel`` with a steering adapter active.
        tokenizer: Tokenizer.
        pairs: ``(positive_text, negative_text)`` pairs or :class:`~steering.easyedit_data.TokenizedPairs`.
        objective: ``"preference"`` or ``"lm"``.
        steps: Optimizer steps.
        lr: Adam learning rate.
        batch_size: Pairs per step.
        beta: Preference inverse temperature.
        seed: Seed of the minibatch order (private generator).
        progress: Show a progress bar.

    Returns:
        The loss of every step.

    Raises:
        FloatingPointError: If a loss is not finite.
        ValueError: If an active adapter's ``positions`` is not in :data:`TRAINABLE_POSITIONS`.
    """
    if not isinstance(pairs, TokenizedPairs):
        pairs = _validate_pairs(pairs)
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"steps, batch_size must be >= 1 and lr > 0, got {steps}, {batch_size}, {lr}")
    names = set(getattr(peft_model.base_model, "active_adapters", ["default"]))
    for name, config in getattr(peft_model.base_model, "peft_config", {}).items():
        if name in names:
            check_trainable_positions(getattr(config, "positions", "all"), f"adapter {name!r}")
    # From the layers, not by parameter name: the name ends in `.weight`, not the adapter's name.
    params = [p for m in peft_model.modules() if isinstance(m, SteeringLayer)
              for n, p in m.steer_vector.parameter_items() if n in names]
    if not params:
        raise ValueError("no steering vectors found on the model; wrap it with a SteeringConfig first")
    check_no_zero_ablation(peft_model.modules(), names)  # (SteeringModel.train's check: this loop runs in eval mode)
    for p in params:
        p.requires_grad_(True)
    refuse_training_on_repacked_4bit(peft_model)  # (the same: a repacked 4-bit layer passes no gradient back)
    optimizer = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    device = _device(peft_model)
    losses = []
    was_training = peft_model.training
    peft_model.eval()  # dropout off: the vector, not the noise, should explain the loss change
    try:
        for step in tqdm(range(steps), desc=f"training steering vector ({objective})", disable=not progress):
            idx = torch.randperm(len(pairs), generator=gen)[:batch_size].tolist()
            chunk = pairs.subset(idx) if isinstance(pairs, TokenizedPairs) else [pairs[i] for i in idx]
            batch = collate_pairs(tokenizer, chunk, device)
            loss = steering_loss(peft_model, batch, objective, beta)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite steering loss {loss.item()} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        peft_model.train(was_training)
    return losses


def train_steering_vector(
    model,
    tokenizer,
    pairs,
    method: str = "caa",
    layers: Sequence[int] | int | None = None,
    multiplier: float = 1.0,
    operator: str = "add",
    positions: str = "all",
    read: str | None = None,
    batch_size: int = 8,
    progress: bool = True,
    adapter_name: str = "default",
    prompt: str | None = None,
    objective: str = "preference",
    steps: int = 50,
    lr: float = 0.05,
    use_chat_template: bool = False,
    system_prompt: str | None = None,
    multiple_choice: bool = False,
    **config_kwargs,
):
    """Extracts (or trains) steering vectors and returns the model wrapped as a PEFT steering adapter.

    Args:
        model: A transformers causal LM, or a ``PeftModel`` that already has steering adapters (the new
            adapter is added next to them).
        tokenizer: Its tokenizer.
        pairs: ``(positive_text, negative_text)`` pairs. For ``"vector_prompt"`` only the positive texts are
            used, as the inputs the steering ``prompt`` is prepended to. Or EasyEdit2's rows: dicts
            ``{"question", "matching", "not_matching"}`` (any method but ``"vector_prompt"``; the CAA vector is
            then exactly EasyEdit2's: per row the block output averaged over the answer tokens, i.e. the tokens
            after the tokenized question, positive minus negative, averaged over rows), or for
            ``"vector_prompt"`` dicts ``{"input", "output", "prompt"?}`` (EasyEdit2's vector-prompt data); or rows
            already tokenized by :func:`~steering.easyedit_data.caa_rows` / ``vector_prompt_rows``.
        method: One of :data:`METHODS`.
        layers: Decoder blocks (0-based) to extract at and steer.
        multiplier: Steering strength stored in the config.
        operator: ``"add"``, ``"ablate"`` or ``"ablate_then_add"``.
        positions: Position policy (see :class:`~steering.config.SteeringConfig`).
        read: Where activations are read (default ``"answer"`` for CAA, ``"last"`` otherwise).
        batch_size: Texts per forward pass.
        progress: Show progress bars.
        adapter_name: Name of the new adapter.
        prompt: The steering prompt of ``"vector_prompt"``.
        objective: ``"preference"`` or ``"lm"`` for ``"trainable"``.
        steps: Optimizer steps for ``"trainable"``.
        lr: Learning rate for ``"trainable"``.
        use_chat_template: For rows: wrap each question in the tokenizer's chat template (EasyEdit2's option).
            The three row options raise a ``ValueError`` for text pairs and tokenized rows (nothing to format).
        system_prompt: For rows: EasyEdit2's ``system_prompt``.
        multiple_choice: For CAA rows: EasyEdit2's multiple-choice CAA (answers ``"\nAnswer: X"``, read at
            position -2; ``read="answer"`` then means that position too).
        **config_kwargs: Further :class:`~steering.config.SteeringConfig` fields (e.g. ``layer_multipliers``).

    Returns:
        The ``PeftModel`` with the adapter active.
    """
    import peft

    from steering.config import SteeringConfig
    from steering.model import SteeringModel

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "trainable":
        check_trainable_positions(positions, "method='trainable'")
    # Read where the adapter will add: its blocks_path (the fix for a model the registry does not know) used to be
    # ignored here, so vectors were read from whichever block list the heuristic found.
    blocks_path = config_kwargs.get("blocks_path")
    layers = _validate_layers(model, layers, blocks_path)
    # EasyEdit2's formatting options act on rows only; elsewhere they were ignored, so a user asking for, e.g.,
    # multiple_choice got a vector read at the answer mean while believing it was read at position -2.
    row_options = [name for name, value in (("use_chat_template", use_chat_template),
                                            ("system_prompt", system_prompt), ("multiple_choice", multiple_choice))
                   if value]
    if isinstance(pairs, TokenizedPairs) or not is_rows(pairs):
        if row_options:
            given = "already tokenized rows (TokenizedPairs)" if isinstance(pairs, TokenizedPairs) else \
                "(positive_text, negative_text) pairs, used as written"
            raise ValueError(
                f"{', '.join(row_options)} only apply to EasyEdit2 rows (dicts {{question, matching, not_matching}}), "
                f"which they format; got {given}: format the texts yourself (read='second_to_last' reads position -2 "
                "as multiple_choice does), or pass the rows"
            )
    elif method == "vector_prompt" and multiple_choice:
        raise ValueError("multiple_choice applies to CAA rows only: EasyEdit2's vector_prompt rows have no "
                         "multiple-choice form (read the output tokens, the default)")
    if isinstance(pairs, TokenizedPairs):
        # Their own answer span is what "answer" means for them (see _pair_activations): record what is read.
        read = pairs.read if read in (None, "answer") else read
    elif is_rows(pairs) and method == "vector_prompt":
        pairs = vector_prompt_rows(tokenizer, pairs, prompt, use_chat_template, system_prompt)
        read = read or pairs.read
    elif is_rows(pairs):
        pairs = caa_rows(tokenizer, pairs, use_chat_template, system_prompt, multiple_choice)
        read = pairs.read if read in (None, "answer") else read
    else:
        pairs = _validate_pairs(pairs)
    read = read or ("answer" if method in ("caa", "trainable") else "last")
    config = SteeringConfig(
        layers=layers, multiplier=multiplier, operator=operator, positions=positions, method=method,
        read_position=None if method == "trainable" else read, num_pairs=len(pairs),
        task_type=config_kwargs.pop("task_type", "CAUSAL_LM"), **config_kwargs,
    )
    if method == "caa" or (method == "vector_prompt" and isinstance(pairs, TokenizedPairs)):
        vectors = caa_vectors(model, tokenizer, pairs, layers, read, batch_size, progress, blocks_path)
    elif method in ("pca_diff", "pca_center"):
        vectors = pca_vectors(model, tokenizer, pairs, layers, method.split("_")[1], read, batch_size, progress,
                              blocks_path)
    elif method == "vector_prompt":
        if prompt is None:
            raise ValueError("method='vector_prompt' needs prompt=... (the steering prompt)")
        vectors = vector_prompt_vectors(model, tokenizer, [p for p, _ in pairs], prompt, layers, read, batch_size,
                                        progress, blocks_path=blocks_path)
    else:
        vectors = None

    if isinstance(getattr(model, "base_model", None), SteeringModel):
        model.add_adapter(adapter_name, config)
        peft_model = model
        peft_model.base_model.set_adapter(adapter_name)
    else:
        peft_model = peft.get_peft_model(model, config, adapter_name=adapter_name)
    steer = peft_model.base_model
    if vectors is not None:
        steer.set_vectors(vectors, adapter_name)
    else:
        train_vectors(peft_model, tokenizer, pairs, objective, steps, lr, batch_size, progress=progress)
    if not all(torch.isfinite(v).all() for v in steer.get_vectors(adapter_name).values()):
        raise FloatingPointError("extracted steering vectors contain non-finite values")
    return peft_model


__all__ = [
    "METHODS", "OBJECTIVES", "READ_POSITIONS", "TRAINABLE_POSITIONS", "caa_vectors", "collate_pairs", "extract_activations",
    "pca_vectors", "steering_loss", "train_steering_vector", "train_vectors", "vector_prompt_vectors",
]
