"""A tiny byte-level BPE tokenizer trained on a few sentences (`TRAINING_TEXT`): the tokenizer of the tests'
tiny random models and of bench.gpu's, which need no model hub.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TRAINING_TEXT = [
    "The capital of France is Paris.",
    "Paris is a city on the Seine, famous for its museums.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, astronauts landed on the Moon for the first time.",
    "Mozart wrote more than six hundred works of music.",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences: real offsets, real multi-byte handling."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 5, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
