"""Prompt datasets (JSONL, validated per row), resumable batching, synthetic tasks."""

from .dataset import DatasetError, PromptDataset, PromptIterator, PromptRecord, parse_row
from .tasks import GENERATORS, addition, mixed, multiplication, reverse, write_jsonl

__all__ = [
    "DatasetError", "GENERATORS", "PromptDataset", "PromptIterator", "PromptRecord", "addition",
    "mixed", "multiplication", "parse_row", "reverse", "write_jsonl",
]
