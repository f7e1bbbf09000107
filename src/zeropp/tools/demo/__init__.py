"""Demo workload: a small byte-level GPT and a shipped public-domain corpus."""

from zeropp.tools.demo.data import ByteTokenizer, corpus_tokens, get_batch, load_corpus, train_val_split
from zeropp.tools.demo.model import GPT, GPTConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "ByteTokenizer",
    "load_corpus",
    "corpus_tokens",
    "train_val_split",
    "get_batch",
]
