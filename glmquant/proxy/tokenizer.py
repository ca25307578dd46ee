"""The proxy's own byte-level BPE tokenizer, trained on its training split with GLM's special tokens and chat
template (so calibration recipes, the runtime and serve-check treat it like the release's tokenizer)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from glmquant.fixtures.tokenizer import SPECIAL_TOKENS, glm_tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """BPE over bytes (any UTF-8 text round-trips), GLM's special tokens first (ids 0..28), then the 256 bytes
    and merges up to `vocab_size` entries. The same texts in the same order give the same tokenizer."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return glm_tokenizer(core)
