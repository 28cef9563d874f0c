"""Record formats, tokenisation with an explicit truncation policy, and DataModules."""

from alignlit.data.encoding import Encoded, LMBatch, Truncation, collate_lm, pad_left, pad_right
from alignlit.data.records import (
    DataError,
    Record,
    parse_prompt,
    parse_prompt_response,
    read_records,
    split_hh,
)
from alignlit.data.sampler import ResumableDataLoader, ResumableSampler, make_loader
from alignlit.data.sft import PromptDataModule, SFTDataModule, split_indices

__all__ = [
    "DataError",
    "Encoded",
    "LMBatch",
    "PromptDataModule",
    "Record",
    "ResumableDataLoader",
    "ResumableSampler",
    "SFTDataModule",
    "Truncation",
    "collate_lm",
    "make_loader",
    "pad_left",
    "pad_right",
    "parse_prompt",
    "parse_prompt_response",
    "read_records",
    "split_hh",
    "split_indices",
]

from alignlit.data.preference import (
    PairEncoder,
    PairError,
    PreferenceBatch,
    PreferenceDataModule,
    parse_pairs,
)
from alignlit.data.processing import Pair, balance_lengths, drop_cycles, drop_duplicates, drop_ties

__all__ += [
    "Pair",
    "PairEncoder",
    "PairError",
    "PreferenceBatch",
    "PreferenceDataModule",
    "balance_lengths",
    "drop_cycles",
    "drop_duplicates",
    "drop_ties",
    "parse_pairs",
]

from alignlit.data.pairs_from_rm import (  # noqa: E402
    RankedGroup,
    best_of_n_records,
    best_worst_pairs,
    read_ranked,
)
from alignlit.data.ranking import RankingBatch, RankingDataModule  # noqa: E402

__all__ += [
    "RankedGroup",
    "RankingBatch",
    "RankingDataModule",
    "best_of_n_records",
    "best_worst_pairs",
    "read_ranked",
]
