"""Record formats, tokenisation with an explicit truncation policy, and DataModules."""

from alignlit.data.base import AlignDataModule, read_split, resolve_tokenizer, split_indices
from alignlit.data.chat import Prompt, encode_conversation, make_prompt, prompt_columns, render_messages
from alignlit.data.encoding import Encoded, LMBatch, Truncation, collate_lm, pad_left, pad_right
from alignlit.data.pair_records import PairError, parse_pairs
from alignlit.data.pairs_from_rm import RankedGroup, best_of_n_records, best_worst_pairs, read_ranked
from alignlit.data.preference import PairEncoder, PreferenceBatch, PreferenceDataModule
from alignlit.data.processing import Pair, balance_lengths, drop_cycles, drop_duplicates, drop_ties
from alignlit.data.prompts import PromptTruncation, truncate_prompts
from alignlit.data.ranking import RankingBatch, RankingDataModule
from alignlit.data.records import (
    DataError,
    Record,
    parse_prompt,
    parse_prompt_response,
    read_records,
    records_from_memory,
    split_hh,
)
from alignlit.data.sampler import ResumableDataLoader, ResumableSampler, make_loader
from alignlit.data.sft import PromptDataModule, SFTDataModule
from alignlit.data.tokenizer import load_tokenizer
from alignlit.data.unpaired import UnpairedBatch, UnpairedDataModule

__all__ = [
    "AlignDataModule",
    "DataError",
    "Encoded",
    "LMBatch",
    "Pair",
    "PairEncoder",
    "PairError",
    "PreferenceBatch",
    "PreferenceDataModule",
    "Prompt",
    "PromptDataModule",
    "PromptTruncation",
    "RankedGroup",
    "RankingBatch",
    "RankingDataModule",
    "Record",
    "ResumableDataLoader",
    "ResumableSampler",
    "SFTDataModule",
    "Truncation",
    "UnpairedBatch",
    "UnpairedDataModule",
    "balance_lengths",
    "best_of_n_records",
    "best_worst_pairs",
    "collate_lm",
    "drop_cycles",
    "drop_duplicates",
    "drop_ties",
    "encode_conversation",
    "load_tokenizer",
    "make_loader",
    "make_prompt",
    "pad_left",
    "pad_right",
    "parse_pairs",
    "parse_prompt",
    "parse_prompt_response",
    "prompt_columns",
    "read_ranked",
    "read_records",
    "read_split",
    "records_from_memory",
    "render_messages",
    "resolve_tokenizer",
    "split_hh",
    "split_indices",
    "truncate_prompts",
]
