"""Small tokenizers trained in a second, for tests that need real text round trips."""

from __future__ import annotations


def byte_bpe(text: str, vocab_size: int = 400):
    """A small byte-level BPE trained on `text` (any bytes tokenize)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t)
