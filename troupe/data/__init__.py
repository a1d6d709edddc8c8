"""Pretraining data: corpora, the byte tokenizer, deterministic batches, and the
data-efficiency schedules (curriculum learning, random-LTD)."""

from troupe.data.corpus import file_documents, stdlib_documents
from troupe.data.dataset import DataConfig, TokenDataset
from troupe.data.schedules import CurriculumConfig, RandomLTDConfig
from troupe.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "CurriculumConfig", "DataConfig", "RandomLTDConfig", "TokenDataset",
           "file_documents", "stdlib_documents"]
