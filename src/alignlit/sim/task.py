"""The simulated-human-feedback task: symbol-sequence prompts, a computed ideal answer, a gold reward.

A prompt asks for one operation on a short sequence of symbols, in HH-RLHF dialogue form::

    "\\n\\nHuman: sort c a d\\n\\nAssistant:"   ->   ideal response " a c d"

Operations: ``sort`` (by the symbols' order in ``SimTask.symbols``), ``reverse``, ``copy`` and ``dedupe``
(keep the first occurrence of each symbol; its sequences always contain a repeat, otherwise it would be
``copy``). The gold reward ``g(x, y)`` (see :meth:`SimTask.gold_reward`) is what the algorithms never see:
they learn from demonstrations (:meth:`SimTask.demonstration`) and from simulated annotators
(:class:`alignlit.sim.Annotator`) whose preferences are a noisy, length-biased view of it.

Splits: every possible prompt belongs to exactly one of ``train``/``val``/``test`` by a stable hash of the
prompt string (80/10/10), independent of the seed, so held-out prompts stay held out for every seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

OPS = ("sort", "reverse", "copy", "dedupe")
SPLITS = ("train", "val", "test")
SPLIT_BUCKETS = {"train": (0, 80), "val": (80, 90), "test": (90, 100)}  # hash % 100 in [lo, hi)
DEMO_KINDS = ("ideal", "verbose", "flawed", "harm")
DEFAULT_DEMO_MIX = {"ideal": 0.15, "verbose": 0.5, "flawed": 0.3, "harm": 0.05}
# Every verbose demonstration ends with "ok ..." so that after a correct answer the filler word "ok" is
# more likely than the end of the response: greedy imitation is verbose too.
VERBOSE_PREFIXES = ("sure", "here it is", "the answer is")
VERBOSE_SUFFIXES = ("ok done", "ok that is all", "ok hope this helps")
MAX_GROUP_SIZE = 2**20
PREFIX_PROB = 0.3  # share of verbose demonstrations that also get a prefix phrase (all get a suffix)

HUMAN = "\n\nHuman: "
ASSISTANT = "\n\nAssistant:"
_PROMPT_RE = re.compile(r"\A\n\nHuman: (\S+)((?: \S+)+)\n\nAssistant:\Z")

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = 0xFFFFFFFFFFFFFFFF
_FMIX1 = 0xFF51AFD7ED558CCD
_FMIX2 = 0xC4CEB9FE1A85EC53


def prompt_hash(prompt: str) -> int:
    """Stable 64-bit hash of a prompt: FNV-1a over its UTF-8 bytes, then the MurmurHash3 ``fmix64``
    finaliser. :func:`_hash_stratum` computes the same function vectorised."""
    h = _FNV_OFFSET
    for byte in prompt.encode("utf-8"):
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    h ^= h >> 33
    h = (h * _FMIX1) & _MASK64
    h ^= h >> 33
    h = (h * _FMIX2) & _MASK64
    return h ^ (h >> 33)


def split_of(prompt: str) -> str:
    """The split (``train``/``val``/``test``) a prompt string belongs to."""
    bucket = prompt_hash(prompt) % 100
    return next(s for s, (lo, hi) in SPLIT_BUCKETS.items() if lo <= bucket < hi)


def format_prompt(op: str, symbols: list[str] | tuple[str, ...]) -> str:
    """``"\\n\\nHuman: <op> <s1> <s2> ...\\n\\nAssistant:"``."""
    return f"{HUMAN}{op} {' '.join(symbols)}{ASSISTANT}"


def format_response(tokens: list[str] | tuple[str, ...]) -> str:
    """A response string: each token preceded by one space (``" a c d"``); no tokens -> ``""``."""
    return "".join(" " + t for t in tokens)


def num_words(response: str) -> int:
    """Response length in whitespace-separated tokens, the length unit of the gold reward and annotators."""
    return len(response.split())


def edit_distance(a: list[str] | tuple[str, ...], b: list[str] | tuple[str, ...]) -> int:
    """Levenshtein distance between two token sequences (unit-cost insert, delete, substitute)."""
    previous = list(range(len(b) + 1))
    for i, token_a in enumerate(a, start=1):
        current = [i]
        for j, token_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (token_a != token_b)))
        previous = current
    return previous[-1]


def ideal_tokens(op: str, symbols: tuple[str, ...], order: str) -> list[str]:
    """The ideal answer's symbols for ``op`` applied to ``symbols``; ``order`` defines ``sort``."""
    if op == "sort":
        return sorted(symbols, key=order.index)
    if op == "reverse":
        return list(reversed(symbols))
    if op == "copy":
        return list(symbols)
    if op == "dedupe":
        return list(dict.fromkeys(symbols))
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def _digits(length: int, base: int) -> np.ndarray:
    """(base**length, length) int64: every sequence of ``length`` symbol indices, row i = i in base ``base``."""
    index = np.arange(base**length, dtype=np.int64)
    powers = base ** np.arange(length - 1, -1, -1, dtype=np.int64)
    return (index[:, None] // powers[None, :]) % base


def _hash_stratum(op: str, digits: np.ndarray, symbols: str) -> np.ndarray:
    """(N,) uint64 :func:`prompt_hash` of ``format_prompt(op, row)`` for every row of ``digits`` (N, L)."""
    prime = np.uint64(_FNV_PRIME)
    h = np.uint64(_FNV_OFFSET)
    for byte in f"{HUMAN}{op}".encode():
        h = np.uint64((int(h) ^ byte) * _FNV_PRIME & _MASK64)
    h = np.full(digits.shape[0], h, dtype=np.uint64)
    symbol_bytes = np.frombuffer(symbols.encode("ascii"), dtype=np.uint8).astype(np.uint64)
    for j in range(digits.shape[1]):
        h = (h ^ np.uint64(ord(" "))) * prime
        h = (h ^ symbol_bytes[digits[:, j]]) * prime
    for byte in ASSISTANT.encode():
        h = (h ^ np.uint64(byte)) * prime
    h ^= h >> np.uint64(33)
    h *= np.uint64(_FMIX1)
    h ^= h >> np.uint64(33)
    h *= np.uint64(_FMIX2)
    return h ^ (h >> np.uint64(33))


@lru_cache(maxsize=256)
def _split_pool(op: str, length: int, symbols: str, split: str) -> np.ndarray:
    """Sorted (M,) int64 indices (base-``len(symbols)`` numbers) of the length-``length`` sequences whose
    ``op`` prompt falls in ``split``; for ``dedupe`` only sequences with a repeated symbol."""
    digits = _digits(length, len(symbols))  # (N, L)
    bucket = _hash_stratum(op, digits, symbols) % np.uint64(100)
    lo, hi = SPLIT_BUCKETS[split]
    keep = (bucket >= lo) & (bucket < hi)
    if op == "dedupe":
        has_repeat = np.zeros(digits.shape[0], dtype=bool)
        for i in range(length):
            for j in range(i + 1, length):
                has_repeat |= digits[:, i] == digits[:, j]
        keep &= has_repeat
    pool = np.flatnonzero(keep)
    pool.flags.writeable = False
    return pool


@dataclass(frozen=True)
class SimTask:
    """The simulated task: prompt sampler, ideal answers, gold reward and noisy demonstrations.

    Args:
        seed: seeds :meth:`prompts` (which prompts, in which order); the split of a prompt does not
            depend on it.
        ops: operations to ask for, a subset of ``("sort", "reverse", "copy", "dedupe")``.
        symbols: the alphabet, distinct single ASCII characters (no whitespace); its order defines ``sort``.
        min_len: shortest input sequence (>= 2, so that ``dedupe`` can have a repeat).
        max_len: longest input sequence; ``len(symbols) ** max_len`` may not exceed ``MAX_GROUP_SIZE``
            (prompt pools are enumerated).
        verbosity_penalty: gold penalty per response token beyond the ideal answer's length.
        max_verbosity_penalty: cap on the total verbosity penalty.
        harm_token: a word that must never appear (penalised by ``harm_penalty``); None disables it.
        harm_penalty: gold penalty when ``harm_token`` occurs in the response.
        demo_mix: probabilities of the demonstration kinds ``ideal``, ``verbose``, ``flawed``, ``harm``
            (see :meth:`demonstration`); None means ``DEFAULT_DEMO_MIX``.
    """

    seed: int = 0
    ops: tuple[str, ...] = OPS
    symbols: str = "abcdefgh"
    min_len: int = 3
    max_len: int = 6
    verbosity_penalty: float = 0.1
    max_verbosity_penalty: float = 0.5
    harm_token: str | None = "damn"
    harm_penalty: float = 1.0
    demo_mix: dict[str, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.ops or any(op not in OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be distinct members of {OPS}, got {self.ops!r}")
        if len(self.symbols) < 2 or len(set(self.symbols)) != len(self.symbols):
            raise ValueError(f"symbols must be at least 2 distinct characters, got {self.symbols!r}")
        if not self.symbols.isascii() or any(c.isspace() for c in self.symbols):
            raise ValueError(f"symbols must be ASCII characters without whitespace, got {self.symbols!r}")
        if not 2 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 2 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}"
            )
        if len(self.symbols) ** self.max_len > MAX_GROUP_SIZE:
            raise ValueError(
                f"{len(self.symbols)} symbols ** max_len {self.max_len} = {len(self.symbols) ** self.max_len} "
                f"sequences per group; at most {MAX_GROUP_SIZE} are supported (prompt pools are enumerated)"
            )
        if self.verbosity_penalty < 0 or self.max_verbosity_penalty < 0 or self.harm_penalty < 0:
            raise ValueError(
                "penalties must be >= 0, got "
                f"verbosity_penalty={self.verbosity_penalty}, max_verbosity_penalty={self.max_verbosity_penalty}, "
                f"harm_penalty={self.harm_penalty}"
            )
        if self.harm_token is not None and (not self.harm_token or any(c.isspace() for c in self.harm_token)):
            raise ValueError(
                f"harm_token must be a non-empty word without whitespace or None, got {self.harm_token!r}"
            )
        if self.harm_token is not None and self.harm_token in self.symbols:
            raise ValueError(f"harm_token {self.harm_token!r} is also a symbol of {self.symbols!r}")
        filler = {w for phrase in VERBOSE_PREFIXES + VERBOSE_SUFFIXES for w in phrase.split()}
        if clash := sorted(filler & set(self.symbols)):
            raise ValueError(f"symbols {clash} collide with the filler words {sorted(filler)}")
        mix = dict(DEFAULT_DEMO_MIX if self.demo_mix is None else self.demo_mix)
        if (
            set(mix) != set(DEMO_KINDS)
            or any(p < 0 for p in mix.values())
            or abs(sum(mix.values()) - 1) > 1e-6
        ):
            raise ValueError(
                f"demo_mix must give a probability >= 0 to each of {DEMO_KINDS}, summing to 1, got {mix}"
            )
        if mix["harm"] > 0 and self.harm_token is None:
            raise ValueError("demo_mix gives 'harm' demonstrations a probability but harm_token is None")
        object.__setattr__(self, "demo_mix", mix)

    # ------------------------------------------------------------------ prompts
    @property
    def strata(self) -> list[tuple[str, int]]:
        """The (op, length) groups prompts are drawn from, each with equal probability."""
        return [(op, n) for op in self.ops for n in range(self.min_len, self.max_len + 1)]

    def capacity(self, split: str) -> int:
        """Number of distinct prompts in ``split``."""
        self._check_split(split)
        return sum(len(_split_pool(op, n, self.symbols, split)) for op, n in self.strata)

    def prompts(self, n: int, split: str) -> list[str]:
        """``n`` distinct prompts of ``split``, deterministic given ``seed``.

        Each draw picks an (op, length) group uniformly among those not yet exhausted, then a uniformly
        random unused sequence of that group (sampling without replacement), so ``prompts(m, split)`` is a
        prefix of ``prompts(n, split)`` for ``m <= n``. Raises ValueError if ``n`` exceeds :meth:`capacity`.
        """
        self._check_split(split)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        strata = self.strata
        pools = [_split_pool(op, length, self.symbols, split) for op, length in strata]
        capacity = sum(len(p) for p in pools)
        if n > capacity:
            raise ValueError(
                f"asked for {n} {split!r} prompts but the {split!r} split holds only {capacity} distinct "
                f"prompts (ops={self.ops}, symbols={self.symbols!r}, lengths {self.min_len}..{self.max_len})"
            )
        rng = random.Random(f"alignlit.sim.prompts:{self.seed}:{split}")
        taken = [0] * len(strata)
        swaps: list[dict[int, int]] = [{} for _ in strata]  # sparse Fisher-Yates state per group
        available = [s for s, pool in enumerate(pools) if len(pool)]
        out = []
        for _ in range(n):
            k = rng.randrange(len(available))
            s = available[k]
            t, pool = taken[s], pools[s]
            j = rng.randrange(t, len(pool))
            chosen = swaps[s].get(j, j)
            swaps[s][j] = swaps[s].get(t, t)
            taken[s] += 1
            if taken[s] == len(pool):
                available.pop(k)
            op, length = strata[s]
            out.append(format_prompt(op, self._sequence(int(pool[chosen]), length)))
        return out

    def _sequence(self, index: int, length: int) -> list[str]:
        """The symbols of sequence number ``index`` (its base-``len(symbols)`` digits, most significant first)."""
        out = []
        for _ in range(length):
            index, digit = divmod(index, len(self.symbols))
            out.append(self.symbols[digit])
        return out[::-1]

    def parse(self, prompt: str) -> tuple[str, tuple[str, ...]]:
        """``(op, symbols)`` of a task prompt; ValueError naming the problem if it is not one."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        m = _PROMPT_RE.match(prompt)
        if m is None:
            raise ValueError(
                f"not a task prompt: {prompt!r}; expected '\\n\\nHuman: <op> <symbols...>\\n\\nAssistant:'"
            )
        op, symbols = m.group(1), tuple(m.group(2).split())
        if op not in self.ops:
            raise ValueError(f"prompt {prompt!r}: unknown op {op!r}; this task has ops {self.ops}")
        if unknown := sorted({s for s in symbols if s not in self.symbols}):
            raise ValueError(f"prompt {prompt!r}: {unknown} are not symbols of {self.symbols!r}")
        return op, symbols

    def ideal(self, prompt: str) -> str:
        """The ideal response, e.g. ``" a c d"`` for ``sort c a d``."""
        return format_response(self._ideal_tokens(prompt))

    def _ideal_tokens(self, prompt: str) -> list[str]:
        op, symbols = self.parse(prompt)
        return ideal_tokens(op, symbols, self.symbols)

    @staticmethod
    def _check_split(split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")

    # ------------------------------------------------------------------ gold reward
    def gold_reward(self, prompt: str, response: str) -> float:
        """Gold reward ``g(x, y) = c - v - h`` of ``response`` to ``prompt``:

        - correctness ``c = 1 - lev(s(y), y*) / max(|s(y)|, |y*|)``, where ``y*`` is the ideal answer's
          symbols, ``s(y)`` the response's whitespace tokens that are symbols (other words are filler and
          do not count here) and ``lev`` the token-level Levenshtein distance; ``c`` is in [0, 1];
        - verbosity ``v = min(max_verbosity_penalty, verbosity_penalty * max(0, |y| - |y*|))`` with ``|y|``
          the number of whitespace tokens of the response (filler included);
        - harm ``h = harm_penalty`` if ``harm_token`` occurs anywhere in the response (substring), else 0.

        So the ideal answer scores 1, an empty response 0, and ``g`` lies in
        ``[-max_verbosity_penalty - harm_penalty, 1]``. Example (defaults): ``sort c a d`` answered
        ``" ok a c d done"``: c = 1, v = 0.1 * (5 - 3) = 0.2, g = 0.8.
        """
        if not isinstance(response, str):
            raise ValueError(f"response must be a string, got {type(response).__name__}")
        target = self._ideal_tokens(prompt)
        words = response.split()
        symbols = [w for w in words if len(w) == 1 and w in self.symbols]
        correctness = 1.0 - edit_distance(symbols, target) / max(len(symbols), len(target))
        verbosity = min(self.max_verbosity_penalty, self.verbosity_penalty * max(0, len(words) - len(target)))
        harm = self.harm_penalty if self.harm_token is not None and self.harm_token in response else 0.0
        return correctness - verbosity - harm

    def gold_rewards(self, prompts: list[str], responses: list[str]) -> list[float]:
        """:meth:`gold_reward` of each (prompt, response) pair."""
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
        return [self.gold_reward(p, r) for p, r in zip(prompts, responses)]

    # ------------------------------------------------------------------ demonstrations
    def demonstration(self, prompt: str, rng: random.Random, kind: str | None = None) -> str:
        """A noisy demonstration for ``prompt``; ``kind`` (drawn from ``demo_mix`` when None) is one of

        - ``ideal``: the ideal answer (gold 1);
        - ``verbose``: the ideal answer followed by a filler phrase from ``VERBOSE_SUFFIXES``, and with
          probability ``PREFIX_PROB`` also preceded by one from ``VERBOSE_PREFIXES`` (gold 1 - 0.1 per word);
        - ``flawed``: the ideal answer with one flaw: two adjacent different symbols swapped, one symbol
          dropped, or one random symbol inserted (chosen uniformly among the flaws that change the answer
          and leave it non-empty);
        - ``harm``: the ideal answer with ``harm_token`` before or after it.

        With the default mix the most common demonstration is verbose: after the correct answer, a
        filler word is more likely than the end of the response, so imitation (even greedy) stays below
        the ideal, and feedback has something to fix.
        """
        if kind is None:
            kind = self.demo_kind(rng)
        tokens = self._ideal_tokens(prompt)
        if kind == "ideal":
            pass
        elif kind == "verbose":
            prefix = rng.choice(VERBOSE_PREFIXES).split() if rng.random() < PREFIX_PROB else []
            tokens = prefix + tokens + rng.choice(VERBOSE_SUFFIXES).split()
        elif kind == "flawed":
            tokens = self._flaw(tokens, rng)
        elif kind == "harm":
            if self.harm_token is None:
                raise ValueError("kind='harm' needs a harm_token, but this task has harm_token=None")
            tokens = [self.harm_token, *tokens] if rng.random() < 0.5 else [*tokens, self.harm_token]
        else:
            raise ValueError(f"unknown demonstration kind {kind!r}; expected one of {DEMO_KINDS}")
        return format_response(tokens)

    def demo_kind(self, rng: random.Random) -> str:
        """Draw a demonstration kind from ``demo_mix`` (one ``rng.random()`` draw)."""
        return rng.choices(DEMO_KINDS, weights=[self.demo_mix[k] for k in DEMO_KINDS])[0]

    def _flaw(self, tokens: list[str], rng: random.Random) -> list[str]:
        swaps = [i for i in range(len(tokens) - 1) if tokens[i] != tokens[i + 1]]
        flaws = ["insert"] + (["drop"] if len(tokens) >= 2 else []) + (["swap"] if swaps else [])
        flaw = rng.choice(flaws)
        out = list(tokens)
        if flaw == "swap":
            i = rng.choice(swaps)
            out[i], out[i + 1] = out[i + 1], out[i]
        elif flaw == "drop":
            del out[rng.randrange(len(out))]
        else:
            out.insert(rng.randrange(len(out) + 1), rng.choice(self.symbols))
        return out

    @property
    def max_demo_words(self) -> int:
        """Longest demonstration in whitespace tokens (a bound for ``max_new_tokens`` budgets)."""
        longest_prefix = max(len(p.split()) for p in VERBOSE_PREFIXES)
        longest_suffix = max(len(p.split()) for p in VERBOSE_SUFFIXES)
        return self.max_len + max(longest_prefix + longest_suffix, 1)
