"""A small byte-level BPE tokenizer trained on the bundled corpus in about a second.

For tests and offline smoke runs of the toolkit when no model tokenizer is at hand; real
campaigns use the served model's tokenizer (kvmesh.worker.model.tokenizer.load_tokenizer).
"""

from __future__ import annotations

from kvmesh.load_tests.corpus import load_corpus_text


def train_corpus_tokenizer(vocab_size: int = 1000):
    """A transformers PreTrainedTokenizerFast (byte-level BPE, no special tokens added to
    prompts; '<|endoftext|>' is its EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(load_corpus_text().split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
