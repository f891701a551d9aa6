"""Prompt data sets (JSON Lines / Parquet, `path@[a:b]` row slices) and the resumable prompt source."""

from lichen.data.dataset import PromptRecord, load_prompt_dataset, parse_spec
from lichen.data.source import DataSource, PromptSource

__all__ = ["DataSource", "PromptRecord", "PromptSource", "load_prompt_dataset", "parse_spec"]
