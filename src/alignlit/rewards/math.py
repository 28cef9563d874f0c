"""Math answers checked with ``math-verify`` (GSM8K / MATH style), as a reward (the ``env`` extra).

:class:`MathVerifyReward` scores 1.0 when a response's final answer equals its prompt's gold answer, else
0.0 (plus an optional format bonus). What is compared:

- the gold: a GSM8K solution (``... #### 1,234``) is reduced to what follows the last ``####``, thousands
  separators dropped (``1234``); any other gold (``\\frac{1}{2}``, ``(1,2)``) is taken as it is. An empty gold,
  or ``####`` with nothing after it, is a :class:`~alignlit.data.records.DataError` naming the row; a gold
  math-verify cannot read at all is one too, on its first use;
- the response's final answer: the last ``\\boxed{...}``, else the last ``#### N`` line, else what
  math-verify extracts from the whole text (``the answer is 18``, else the last number or expression), else
  the whole text as one expression (a bare ``(1,2)``);
- Unicode digits (``٧٢``, ``७२``, full-width ``７２``) count as their ASCII digits on both sides;
- equal: the two answers' texts are the same once stripped of ``$``, a final ``.`` and thousands commas (a
  fast exact path, also for numbers of any length: 10,000-digit answers compare as text), else
  math-verify's mathematical equality (``1/2 = 0.5 = \\frac{1}{2}``, ``\\sqrt{8} = 2\\sqrt{2}``, ``(1,2)`` is
  the open interval, so ``(1, 2) = (1,2) != [1,2]``).

Every math-verify call runs in a worker process (:class:`~alignlit.rewards.verify_pool.VerifierPool`)
with a deadline per sample (``timeout_s``): a sample past it (``\\boxed{10^{10^{10}}}``) scores
``timeout_score``, one whose check raises or kills its worker scores ``error_score``; each is counted
(:attr:`MathVerifyReward.counts`, :meth:`MathVerifyReward.metrics`) and logged with its row. So the reward
never hangs a run, in the main thread or the asynchronous producer.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from alignlit.data.records import DataError, read_records
from alignlit.rewards._verify_worker import boxed_span, clean_answer, final_answer, normalize_digits
from alignlit.rewards.verify_pool import VerifierPool

log = logging.getLogger(__name__)

_TRAILING = re.compile(r"(?:\\\]|\\\)|[\s.$])*\Z")
_HASHES_END = re.compile(r"####[ \t]*[^\n]*\S\Z")


def gold_answer(gold, where: str = "gold answer") -> str:
    """The answer of a gold solution: what follows GSM8K's last ``####`` (thousands separators dropped),
    else the whole text; Unicode digits as ASCII. A ``DataError`` naming ``where`` when there is none."""
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold = str(gold)
    if not isinstance(gold, str):
        raise DataError(f"{where}: expected the gold answer as a string, got {type(gold).__name__}")
    text = normalize_digits(gold).strip()
    if "####" in text:
        text = clean_answer(text.rsplit("####", 1)[1])
        if not text:
            raise DataError(f"{where}: gold answer {gold[-80:]!r} has nothing after '####'")
    elif not text:
        raise DataError(f"{where}: the gold answer is empty")
    return text


def has_final_answer_format(response: str) -> bool:
    """Whether ``response`` ends with its final answer in the expected form: a ``\\boxed{...}`` or a
    ``#### N`` line (then only spaces, ``.``, ``$``, ``\\]`` or ``\\)`` may follow)."""
    tail = _TRAILING.sub("", response)
    if _HASHES_END.search(tail.rsplit("\n", 1)[-1]):
        return True
    span = boxed_span(tail)
    return span is not None and span[1] == len(tail) - 1


class MathVerifyReward:
    """``(prompts, responses, answer=None) -> (N,)``: 1.0 when a response's final answer equals its gold
    (see the module docstring), else 0.0; plus ``format_weight`` when it ends in the expected form.

    The gold of each row is, in this order: ``answer[i]`` (the prompts' ``answer`` column, passed by
    :func:`~alignlit.rollout.reward_protocol.score_texts` when the prompts carry it: the reference travels with the
    prompt), else the gold of the prompt's text in ``answers_file`` / ``answers``.

    Args:
        answers_file: records with ``prompt_field`` and ``answer_field`` (JSONL, JSON, Parquet; e.g. GSM8K
            written as ``{"prompt": ..., "answer": "... #### 72"}``). Optional: without it and ``answers``
            every call needs ``answer``.
        answers: or the prompt → gold answer mapping itself.
        prompt_field: the prompt's field in ``answers_file``.
        answer_field: the gold answer's field in ``answers_file``.
        timeout_s: the most seconds math-verify may take on one sample.
        timeout_score: the score of a sample past ``timeout_s`` (counted as ``timeouts``).
        error_score: the score of a sample whose check raised or killed its worker (``errors``, ``crashes``).
        format_weight: added to the score of a response that ends with its final answer as ``\\boxed{...}``
            or ``#### N`` (:func:`has_final_answer_format`); 0 (the default) scores correctness only.
        num_workers: math-verify worker processes (started on the first call).
        memory_mb: address-space limit of a worker (0: none).
    """

    def __init__(
        self,
        answers_file: str | None = None,
        answers: Mapping[str, str] | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        timeout_s: float = 5.0,
        timeout_score: float = 0.0,
        error_score: float = 0.0,
        format_weight: float = 0.0,
        num_workers: int = 1,
        memory_mb: int = 4096,
    ):
        if answers_file is not None and answers is not None:
            raise ValueError("MathVerifyReward: give at most one of answers_file and answers")
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(
                f"MathVerifyReward: timeout_s > 0 and num_workers >= 1 (got {timeout_s}, {num_workers})"
            )
        self.answers_file = answers_file
        self.answers: dict[str, str] = {}
        self.sources: dict[str, str] = {}
        if answers_file is not None:
            self._load(Path(answers_file), prompt_field, answer_field)
        for prompt, gold in (answers or {}).items():
            where = f"answers[{prompt!r:.60}]"
            self.answers[prompt], self.sources[prompt] = gold_answer(gold, where), where
        self.timeout_s, self.timeout_score, self.error_score = timeout_s, timeout_score, error_score
        self.format_weight, self.num_workers, self.memory_mb = format_weight, num_workers, memory_mb
        self.counts: Counter = Counter()
        self._pool: VerifierPool | None = None
        self._lock = threading.Lock()

    def _load(self, path: Path, prompt_field: str, answer_field: str) -> None:
        for r in read_records(path):
            if isinstance(r.fields.get(prompt_field), list):
                raise r.error(
                    prompt_field,
                    "a list of messages cannot key an answers file (the policy sees its chat rendering): drop "
                    "answers_file and keep the gold in the prompt records' `answer` column, which travels with each "
                    "prompt to the reward",
                )
            prompt = r.text(prompt_field)
            if answer_field not in r.fields:
                raise r.error(answer_field, f"missing: no gold answer (record has {sorted(r.fields)})")
            gold = gold_answer(r.fields[answer_field], f"{r.source}, field {answer_field!r}")
            if prompt in self.answers and self.answers[prompt] != gold:
                raise DataError(
                    f"{path}: prompt {prompt!r:.60} has two different gold answers: "
                    f"{self.answers[prompt]!r:.40} at {self.sources[prompt]} and {gold!r:.40} at {r.source}"
                )
            self.answers.setdefault(prompt, gold)
            self.sources.setdefault(prompt, r.source)

    # the pool (processes, pipes, a lock) is rebuilt on first use after unpickling
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pool"], state["_lock"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def pool(self) -> VerifierPool:
        """The worker processes (started on the first check)."""
        with self._lock:
            if self._pool is None:
                self._pool = VerifierPool(self.num_workers, self.timeout_s, memory_mb=self.memory_mb)
            return self._pool

    def close(self) -> None:
        """Stop the worker processes (they also stop when the reward is collected and at exit)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _golds(self, prompts: Sequence[str], answer: Sequence | None) -> tuple[list[str], list[str]]:
        golds, wheres = [], []
        for i, prompt in enumerate(prompts):
            where = getattr(prompt, "source", None) or f"row {i}"
            if answer is not None:
                where = f"{where}, column 'answer'"
                golds.append(gold_answer(answer[i], where))
            elif str(prompt) in self.answers:
                golds.append(self.answers[str(prompt)])
                where = f"{where} (gold from {self.sources[str(prompt)]})"
            else:
                raise DataError(
                    f"MathVerifyReward: no gold answer for prompt row {i} ({str(prompt)[:80]!r}): pass the "
                    "gold as the prompts' `answer` column (PromptDataModule columns) or give answers_file; if "
                    "prompts are truncated (max_prompt_length) or chat-templated, a lookup by prompt text "
                    "fails — use the answer column"
                    + (
                        f" ({len(self.answers)} prompts in {self.answers_file or 'answers'})"
                        if self.answers
                        else ""
                    )
                )
            wheres.append(where)
        return golds, wheres

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], answer: Sequence | None = None
    ) -> torch.Tensor:
        if len(prompts) != len(responses) or (answer is not None and len(answer) != len(prompts)):
            got = "" if answer is None else f" and {len(answer)} answers"
            raise ValueError(f"MathVerifyReward: {len(prompts)} prompts but {len(responses)} responses{got}")
        golds, wheres = self._golds(prompts, answer)
        scores = self.check(golds, responses, wheres)
        if self.format_weight:
            scores = [s + self.format_weight * has_final_answer_format(r) for s, r in zip(scores, responses)]
        return torch.tensor(scores, dtype=torch.float32)

    def check(
        self, golds: Sequence[str], responses: Sequence[str], wheres: Sequence[str] | None = None
    ) -> list[float]:
        """1.0/0.0 per ``(gold, response)`` (golds already reduced by :func:`gold_answer`): the fast exact
        path here, the rest in the worker processes with the timeout/error policy of the class."""
        wheres = list(wheres) if wheres is not None else [f"row {i}" for i in range(len(golds))]
        scores: list[float] = [0.0] * len(golds)
        todo = []
        for i, (gold, response) in enumerate(zip(golds, responses)):
            response = normalize_digits(response)
            found = final_answer(response)
            candidate = found[1] if found is not None else response
            if clean_answer(candidate) == clean_answer(gold):
                scores[i] = 1.0
                self.counts["exact"] += 1
            else:
                todo.append((i, gold, response))
        results = self.pool.run([(g, r) for _, g, r in todo]) if todo else []
        for (i, gold, response), result in zip(todo, results):
            if result.status == "ok":
                scores[i] = result.score
                self.counts["verified"] += 1
                continue
            if result.status == "bad_gold":
                raise DataError(f"{wheres[i]}: math-verify cannot read the gold answer {gold!r:.80}")
            key = {"timeout": "timeouts", "crash": "crashes"}.get(result.status, "errors")
            scores[i] = self.timeout_score if key == "timeouts" else self.error_score
            self.counts[key] += 1
            log.warning(
                "MathVerifyReward: %s, response %r: math-verify %s (%s); scored %g (%d %s so far)",
                wheres[i],
                response[:80],
                result.status,
                result.detail,
                scores[i],
                self.counts[key],
                key,
            )
        return scores

    def metrics(self) -> dict[str, float]:
        """The counts so far: ``exact`` (equal texts), ``verified`` (math-verify's verdict), ``timeouts``,
        ``errors`` and ``crashes`` (scored by ``timeout_score`` / ``error_score``)."""
        return {f"math_verify/{k}": float(v) for k, v in self.counts.items()}


_SHARED: MathVerifyReward | None = None


def math_verify_score(gold: str, response: str) -> float:
    """1.0 if ``response``'s final answer equals ``gold`` (a number, an expression or LaTeX, or a GSM8K
    solution), else 0.0; bounded as :class:`MathVerifyReward` with its defaults (one shared worker)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = MathVerifyReward()
    return _SHARED.check([gold_answer(gold)], [response])[0]
