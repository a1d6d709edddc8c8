"""Pretraining data: corpora, tokenizers (troupe's bytes, a Hugging Face model's), deterministic
batches (in memory, or streamed from shards larger than memory: troupe.data.stream), and the
data-efficiency schedules (curriculum learning, random-LTD)."""

from troupe.data.corpus import file_documents, stdlib_documents
from troupe.data.dataset import (DataConfig, TokenDataset, micro_batches, open_dataset,
                                 token_micro_batches)
from troupe.data.schedules import CurriculumConfig, RandomLTDConfig
from troupe.data.tokenizer import ByteTokenizer, ByteTokens, HFTokens, Tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "ByteTokens", "CurriculumConfig", "DataConfig", "HFTokens",
           "RandomLTDConfig", "TokenDataset", "Tokenizer", "file_documents", "load_tokenizer",
           "micro_batches", "open_dataset", "stdlib_documents", "token_micro_batches"]
