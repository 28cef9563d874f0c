"""Math answers checked with ``math-verify`` (GSM8K / MATH style), as a reward (the ``env`` extra).

``math_verify_score(gold, response)`` is 1.0 when the response's final answer (its last ``\\boxed{}``,
or the last number or expression ``math-verify`` extracts) equals the gold answer mathematically
(``1/2`` = ``0.5`` = ``\\frac{1}{2}``; sets, intervals, matrices as ``math-verify`` compares them), else
0.0. A GSM8K gold solution (``... #### 72``) is reduced to what follows ``####``. Parsing and
verification run without ``math-verify``'s signal-based timeouts, so the reward also works outside the
main thread (the asynchronous rollout producer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from alignlit.data.records import read_records


def _math_verify():
    try:
        import math_verify
    except ImportError as err:
        raise ImportError(f"the math reward needs math-verify: pip install 'alignlit[env]' ({err})") from err
    return math_verify


def gold_answer(gold: str) -> str:
    """The answer of a gold solution: what follows GSM8K's ``####`` (commas dropped), else the text."""
    if "####" in gold:
        return gold.rsplit("####", 1)[1].strip().replace(",", "")
    return gold.strip()


def math_verify_score(gold: str, response: str) -> float:
    """1.0 if ``response``'s final answer equals ``gold`` (a number, an expression or LaTeX), else 0.0."""
    mv = _math_verify()
    answer = gold_answer(gold)
    if "$" not in answer:
        answer = f"${answer}$"
    parsed_gold = mv.parse(answer, parsing_timeout=None)
    parsed = mv.parse(response, parsing_timeout=None)
    if not parsed_gold or not parsed:
        return 0.0
    return float(mv.verify(parsed_gold, parsed, timeout_seconds=None))


class MathVerifyReward:
    """``(prompts, responses) -> (N,)`` 1.0/0.0: each response checked against its prompt's gold answer.

    Args:
        answers_file: records with ``prompt_field`` and ``answer_field`` (JSONL, JSON, Parquet; e.g. GSM8K
            written as ``{"prompt": ..., "answer": "... #### 72"}``).
        answers: or the prompt → gold answer mapping itself.
        prompt_field: the prompt's field.
        answer_field: the gold answer's field.
    """

    def __init__(
        self,
        answers_file: str | None = None,
        answers: Mapping[str, str] | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
    ):
        if (answers_file is None) == (answers is None):
            raise ValueError("MathVerifyReward: give exactly one of answers_file and answers")
        if answers_file is not None:
            answers = {
                r.fields[prompt_field]: str(r.fields[answer_field]) for r in read_records(Path(answers_file))
            }
        self.answers = dict(answers)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"MathVerifyReward: {len(prompts)} prompts but {len(responses)} responses")
        missing = [p for p in prompts if p not in self.answers]
        if missing:
            raise KeyError(f"MathVerifyReward: no gold answer for prompt {missing[0]!r:.80}")
        return torch.tensor([math_verify_score(self.answers[p], r) for p, r in zip(prompts, responses)])
