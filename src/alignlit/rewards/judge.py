"""An LLM judge as a reward: a served model grades each response against a rubric (or a reference).

:class:`JudgeReward` sends one chat request per response to an OpenAI-compatible endpoint (``alignlit
serve``, ``vllm serve``, any server with ``POST /v1/chat/completions``), with the prompt ``template``
formatted from the row: ``{prompt}``, ``{response}`` and any column the prompts carry
(:class:`~alignlit.data.Prompt` fields, e.g. ``{answer}``). The score is the last number matched by
``score_pattern`` in the judge's answer, checked to lie in ``[min_score, max_score]`` and mapped to
``[0, 1]`` (``normalize``). Requests run concurrently (``max_concurrency`` threads), each with a
``timeout_s`` and up to ``retries`` retries (connection errors, HTTP 429/5xx, timeouts), with backoff.

A row whose judgement fails after the retries (the server is down, or the answer holds no valid score)
either raises a ``JudgeError`` naming the row, the endpoint and the judge's answer (``on_failure:
"error"``, the default), or scores ``default_score`` and is counted (``on_failure: "default"``;
:attr:`JudgeReward.counts`, :meth:`JudgeReward.metrics`). Identical requests are answered from a cache
(``cache_size`` entries). The judge's raw answers of the last call are kept (:attr:`last_answers`) and,
with ``log_file``, every judgement is appended as a JSON line (prompt, response, answer, score) for
inspection.

In a config::

    reward:
      class_path: alignlit.rewards.judge.JudgeReward
      init_args:
        endpoint: http://127.0.0.1:8000
        model: Qwen/Qwen2.5-7B-Instruct
        template: "Question: {prompt}\\nReference: {answer}\\nAnswer: {response}\\nGrade 0-10. Reply 'Score: N'."
        max_score: 10
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from string import Formatter
from typing import Any, Literal

DEFAULT_TEMPLATE = (
    "You are grading an assistant's answer.\n\nQuestion:\n{prompt}\n\nAnswer:\n{response}\n\n"
    "Rate how helpful, correct and harmless the answer is on a scale from 0 to 10. "
    "End your reply with 'Score: N'."
)
DEFAULT_PATTERN = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"


class JudgeError(RuntimeError):
    """A judgement that failed (endpoint, row and what came back are in the message)."""


class _Retryable(Exception):
    pass


class JudgeReward:
    """``(prompts, responses, **columns) -> (N,)`` scores from an LLM judge (see the module docstring).

    Args:
        endpoint: the server's base URL (``http://host:port``; ``/v1/chat/completions`` is appended).
        model: the ``model`` field of the requests (the served model's name).
        template: the judge's prompt, formatted with ``{prompt}``, ``{response}`` and prompt columns.
        score_pattern: a regular expression whose first group is the score; the last match counts.
        min_score, max_score: the valid range of the judge's scores (a score outside it is a failure).
        normalize: map scores to ``(s - min_score) / (max_score - min_score)``.
        system_prompt: an optional system message before the template.
        temperature, max_tokens: sampling of the judge's answer (greedy by default).
        api_key: sent as ``Authorization: Bearer``; default the ``ALIGNLIT_JUDGE_API_KEY`` variable.
        max_concurrency: requests in flight at once.
        timeout_s: seconds per request.
        retries: retries of a request after a connection error, HTTP 429/5xx or a timeout.
        on_failure: ``"error"`` (raise naming the row) or ``"default"`` (score ``default_score``, counted).
        default_score: the score of a failed row under ``on_failure: default`` (after normalisation).
        cache_size: identical requests answered from memory (0: no cache).
        log_file: append every judgement as a JSON line (None: not written).
    """

    def __init__(
        self,
        endpoint: str,
        model: str,
        template: str = DEFAULT_TEMPLATE,
        score_pattern: str = DEFAULT_PATTERN,
        min_score: float = 0.0,
        max_score: float = 10.0,
        normalize: bool = True,
        system_prompt: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 512,
        api_key: str | None = None,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        retries: int = 2,
        on_failure: Literal["error", "default"] = "error",
        default_score: float = 0.0,
        cache_size: int = 100_000,
        log_file: str | None = None,
    ):
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"JudgeReward: endpoint must be http(s)://host:port, got {endpoint!r}")
        if not max_score > min_score:
            raise ValueError(f"JudgeReward: max_score ({max_score}) must be > min_score ({min_score})")
        if on_failure not in ("error", "default"):
            raise ValueError(f"JudgeReward: on_failure must be 'error' or 'default', got {on_failure!r}")
        for name, value, low in (("max_concurrency", max_concurrency, 1), ("retries", retries, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"JudgeReward: {name} must be an integer >= {low}, got {value!r}")
        if not timeout_s > 0:
            raise ValueError(f"JudgeReward: timeout_s must be > 0, got {timeout_s}")
        self.pattern = re.compile(score_pattern)
        if self.pattern.groups < 1:
            raise ValueError(f"JudgeReward: score_pattern {score_pattern!r} has no group for the score")
        self.fields = {f for _, f, _, _ in Formatter().parse(template) if f}
        missing = {"response"} - self.fields
        if missing:
            raise ValueError(
                f"JudgeReward: the template must contain {{response}} (it names {sorted(self.fields)})"
            )
        self.url = endpoint.rstrip("/") + "/v1/chat/completions"
        self.model, self.template, self.system_prompt = model, template, system_prompt
        self.min_score, self.max_score, self.normalize = float(min_score), float(max_score), normalize
        self.temperature, self.max_tokens = temperature, max_tokens
        self.api_key = api_key if api_key is not None else os.environ.get("ALIGNLIT_JUDGE_API_KEY")
        self.max_concurrency, self.timeout_s, self.retries = max_concurrency, timeout_s, retries
        self.on_failure, self.default_score = on_failure, float(default_score)
        self.cache_size, self.log_file = cache_size, log_file
        self._cache: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.last_answers: list[str | None] = []

    def __getstate__(self) -> dict[str, Any]:  # the reward travels to worker processes without its lock
        state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ one request
    def _request_body(self, text: str) -> bytes:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": text})
        body = {
            "model": self.model, "messages": messages, "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }  # fmt: skip
        return json.dumps(body, sort_keys=True).encode()

    def _post(self, body: bytes) -> str:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode(errors="replace")
            if e.code == 429 or e.code >= 500:
                raise _Retryable(f"HTTP {e.code}: {detail}") from None
            raise JudgeError(f"HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        try:
            return str(json.loads(raw)["choices"][0]["message"]["content"])
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise JudgeError(
                f"not an OpenAI chat completion: {raw[:200].decode(errors='replace')!r}"
            ) from None

    def _score(self, answer: str) -> float:
        matches = self.pattern.findall(answer)
        if not matches:
            raise JudgeError(
                f"no score in the judge's answer {answer[-300:]!r} (score_pattern {self.pattern.pattern!r})"
            )
        last = matches[-1][0] if isinstance(matches[-1], tuple) else matches[-1]
        score = float(last)
        if not self.min_score <= score <= self.max_score:
            raise JudgeError(
                f"score {score:g} outside [{self.min_score:g}, {self.max_score:g}] in {answer[-300:]!r}"
            )
        if self.normalize:
            score = (score - self.min_score) / (self.max_score - self.min_score)
        return score

    def judge(self, text: str) -> tuple[float, str]:
        """``(score, the judge's answer)`` for one rendered template, with the cache and retries."""
        body = self._request_body(text)
        key = hashlib.sha256(body).hexdigest()
        with self._lock:
            if key in self._cache:
                self.counts["cache_hits"] += 1
                self._cache.move_to_end(key)
                return self._cache[key]
        error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.counts["retries"] += 1
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            with self._lock:
                self.counts["requests"] += 1
            try:
                answer = self._post(body)
            except _Retryable as e:
                error = e
                continue
            result = (self._score(answer), answer)  # a malformed answer is not retried: the judge is greedy
            with self._lock:
                if self.cache_size:
                    self._cache[key] = result
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
            return result
        raise JudgeError(f"no answer after {self.retries + 1} tries ({error})")

    # ------------------------------------------------------------------ a batch
    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], **columns: Sequence[Any]
    ) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"JudgeReward: {len(prompts)} prompts but {len(responses)} responses")
        needed = self.fields - {"prompt", "response"}
        missing = sorted(needed - set(columns))
        if missing:
            raise ValueError(
                f"JudgeReward: the template names {missing}, which the prompts do not carry (give them as "
                "columns of the prompt data, e.g. PromptDataModule columns)"
            )
        texts = [
            self.template.format(prompt=p, response=r, **{k: columns[k][i] for k in needed})
            for i, (p, r) in enumerate(zip(prompts, responses))
        ]

        def one(i: int) -> tuple[float, str | None]:
            try:
                return self.judge(texts[i])
            except JudgeError as e:
                where = getattr(prompts[i], "source", None) or f"row {i}"
                if self.on_failure == "error":
                    raise JudgeError(
                        f"JudgeReward {self.url}: {where} (prompt {str(prompts[i])[:60]!r}): {e}"
                    ) from None
                with self._lock:
                    self.counts["failed_default_score"] += 1
                return self.default_score, f"<failed: {e}>"

        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            results = list(pool.map(one, range(len(texts))))
        self.last_answers = [a for _, a in results]
        if self.log_file:
            path = Path(self.log_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for p, r, (score, answer) in zip(prompts, responses, results):
                    f.write(
                        json.dumps({"prompt": str(p), "response": r, "answer": answer, "score": score}) + "\n"
                    )
        return [s for s, _ in results]

    def metrics(self) -> dict[str, float]:
        """The counts so far (requests, cache hits, retries, rows scored by default)."""
        return {f"judge/{k}": float(v) for k, v in self.counts.items()}
