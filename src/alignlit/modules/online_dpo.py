"""Online iterative DPO (RLHF-Workflow §3; algorithms.md §6) on the online-stage base.

One ``training_step`` is one iteration ``t``: the DataModule's next prompt batch is the iteration's
fresh slice of prompts, the base samples ``n`` responses per prompt from the current policy through
the :class:`~alignlit.rollout.RolloutLoop` and scores them, and :meth:`OnlineDPOModule.train_on` pairs
the best of ``n`` with the worst of ``n``, writes the iteration's data as JSONL and trains a registered
preference loss on the pairs for ``minibatches.epochs`` passes. ``T`` is the run's length in training steps.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from alignlit.data.pair_records import parse_pairs
from alignlit.data.pairs_from_rm import RankedGroup, best_worst_pairs, write_jsonl
from alignlit.data.preference import PairEncoder, PairExample, collate_preference
from alignlit.data.processing import Pair
from alignlit.data.records import read_records
from alignlit.hub import Pretrained
from alignlit.lightning_internals import attached_trainer
from alignlit.losses import PreferenceLoss
from alignlit.models.tiny import TinyLlama
from alignlit.modules.online import OnlineModule
from alignlit.modules.online_parts import mean_metrics
from alignlit.modules.preference_objective import PreferenceObjective
from alignlit.modules.trajectory import Minibatches, Trajectory
from alignlit.rollout.reward_protocol import Reward

LengthUnit = Literal["tokens", "characters"]


class OnlineDPOModule(OnlineModule):
    """Online iterative DPO (RLHF-Workflow §3.3; algorithms.md §6): one training step is one iteration.

    Iteration ``t`` samples ``rollout.samples_per_prompt = n >= 2`` responses for each prompt of the
    DataModule's next batch, scores them with the reward (a reward-model directory, any reward callable,
    or a preference model through :class:`~alignlit.rewards.PreferenceRanking`), optionally length-penalised
    ``r - λ|y|`` (RLHF-Workflow eq. 8), and pairs the best of ``n`` with the worst of ``n``
    (:func:`~alignlit.data.best_worst_pairs`; pairs of identical responses and pairs whose penalised
    gap is ``<= min_gap`` are dropped and counted). The policy, continuing from the last iterate, then
    trains ``loss_type`` (any registered preference loss, plus the RPO SFT term) on the training pairs
    for ``minibatches.epochs`` shuffled passes of ``minibatches.size`` pairs, one optimizer step each.
    Pairs are re-tokenised from their texts (``prompt + response + EOS``, as offline DPO reads them).
    Each iteration's data is written to ``data_dir`` as ``iter_<t>.ranked.jsonl`` (``{"prompt",
    "responses", "scores", "lengths"}``, raw scores, token lengths, best first, blank samples left out)
    and ``iter_<t>.pairs.jsonl`` (``{"prompt", "chosen", "rejected", "chosen_score",
    "rejected_score"}``, penalised scores), both readable by alignlit's data modules. Logged every
    iteration: the length diagnostics (mean length, per-prompt reward-length correlation), pair counts
    and the loss's metrics (``dpo/*``). An iteration without any training pair is skipped and counted.
    Single process only (ranks would keep different numbers of pairs, so take different numbers of
    optimizer steps).

    Args:
        policy: see :class:`~alignlit.modules.online.OnlineModule`.
        reward: see :class:`~alignlit.modules.online.OnlineModule`; or a :class:`~alignlit.rewards.PreferenceRanking`.
        loss_type: a registered preference loss (``dpo``, ``ipo``, ``hinge``, ``simpo``, ``slic``), a
            dotted path or a ``class_path`` (see :class:`~alignlit.modules.DPOModule`).
        loss_args: hyperparameters of a registered loss (dpo: ``{beta: 0.1, label_smoothing: 0.0}``).
        beta: shortcut for ``loss_args: {beta: ...}``.
        sft_weight: ``α`` of the RPO term ``α·NLL(y_w|x)/|y_w|``.
        length_penalty: ``λ >= 0`` of ``r - λ|y|`` used to choose best and worst.
        length_unit: what ``|y|`` counts: ``"tokens"`` (the sampled response tokens) or ``"characters"``
            (of the response text, as in RLHF-Workflow eq. 8).
        min_gap: pairs whose penalised reward gap is ``<= min_gap`` are dropped.
        pairs_from: train on the pairs of ``"all"`` iterations so far (algorithms.md §6) or only the
            ``"newest"`` iteration's.
        offline_pairs: a preference file (any format :class:`~alignlit.data.PreferenceDataModule` reads)
            whose pairs are mixed into every iteration's training pairs (hybrid learning).
        offline_pairs_per_iteration: offline pairs per iteration, consecutive slices of one seeded
            permutation (wrapping around); None: all of them every iteration.
        minibatches: passes (``epochs``, default 2) of minibatches (``size`` pairs) over an iteration's
            training pairs; with ``token_budget``, a step's pairs run in micro-batches of at most that many
            padded tokens (a pair: 2 × its longer sequence), each loss weighted by its share of the pairs
            (the loss must be a mean over pairs, as every registered one is).
        reference_update: ``"initial"`` keeps ``π_0`` as the reference; ``"last_iterate"`` sets it to the
            policy at the start of each iteration ``t >= 2`` (its weights are then saved in checkpoints,
            and ``val/kl`` is measured against it).
        train_max_length: longest ``prompt + response`` of a training pair in tokens (responses are cut).
        train_max_prompt_length: prompts of training pairs are left-truncated to this many tokens.
        data_dir: where the iterations' JSONL files go (default: ``<log dir>/online_dpo_data``).
        **kwargs: the arguments of :class:`~alignlit.modules.online.OnlineModule` (reference, rollout,
            optim, max_grad_norm, ptx, prompt_filter, gold, val_sampling, reward_batch_size, dtype,
            curves_file, export_dir); ``tis_cap`` does not apply (no policy-gradient loss).
    """

    stage = "online_dpo"
    hparams_ignore = (*OnlineModule.hparams_ignore, "loss_type")
    needs_logprobs = False  # the pairs are re-read from their texts; the loss runs its own forwards
    min_loss_tokens = 0  # a rollout is skipped when it yields no pair
    curve_panels = (
        ("reward/raw", "reward (raw)"),
        ("response/length", "response length (tokens)"),
        ("length/reward_corr", "per-prompt corr(reward, length)"),
        ("pairs/new", "pairs kept this iteration"),
        ("pairs/train", "training pairs"),
        ("dpo/loss", "preference loss"),
        ("dpo/rewards/accuracy", "implicit reward accuracy"),
        ("dpo/rewards/margin", "implicit reward margin"),
        ("val/gold", "held-out gold reward"),
        ("val/kl", "held-out KL to the reference"),
        ("val/length", "held-out length (tokens)"),
        ("time/rollout_s", "rollout time (s)"),
    )

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        reward: str | Reward,
        loss_type: str | PreferenceLoss = "dpo",
        loss_args: dict[str, Any] | None = None,
        beta: float | None = None,
        sft_weight: float = 0.0,
        length_penalty: float = 0.0,
        length_unit: LengthUnit = "tokens",
        min_gap: float = 0.0,
        pairs_from: Literal["all", "newest"] = "all",
        offline_pairs: str | None = None,
        offline_pairs_per_iteration: int | None = None,
        minibatches: Minibatches = Minibatches(epochs=2),
        reference_update: Literal["initial", "last_iterate"] = "initial",
        train_max_length: int = 512,
        train_max_prompt_length: int = 256,
        data_dir: str | None = None,
        **kwargs,
    ):
        choices = {
            "length_unit": (length_unit, ("tokens", "characters")),
            "pairs_from": (pairs_from, ("all", "newest")),
            "reference_update": (reference_update, ("initial", "last_iterate")),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if not (length_penalty >= 0 and min_gap >= 0):
            raise ValueError(f"length_penalty and min_gap must be >= 0, got {length_penalty}, {min_gap}")
        if offline_pairs_per_iteration is not None and (
            offline_pairs is None or offline_pairs_per_iteration < 1
        ):
            raise ValueError("offline_pairs_per_iteration must be >= 1 and needs offline_pairs")
        if kwargs.get("tis_cap") is not None or kwargs.get("rollout_correction") is not None:
            raise ValueError(
                "tis_cap / rollout_correction weight policy-gradient token losses; online DPO has none"
            )
        if kwargs.get("lora") is not None and reference_update == "last_iterate":
            raise ValueError(
                "reference_update 'last_iterate' copies the policy's weights into a reference model of its "
                "own; with lora the reference is the policy with its adapter disabled: use 'initial'"
            )
        if kwargs.get("kl") is not None:
            raise ValueError(
                "kl penalises a reward the policy gradient follows; online DPO's KL control is its β"
            )
        objective = PreferenceObjective(loss_type, loss_args, beta=beta, sft_weight=sft_weight)
        super().__init__(policy, reward, minibatches=minibatches, **kwargs)
        if self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "online DPO pairs the best with the worst of n samples: rollout.samples_per_prompt must be >= 2, "
                f"got {self.rollout.samples_per_prompt}"
            )
        self.objective = objective
        self.hparams["loss_type"] = objective.name
        self.encoder = PairEncoder(
            self.tokenizer, max_length=train_max_length, max_prompt_length=train_max_prompt_length
        )
        self.data_dir = data_dir
        self.offline: list[Pair] = []
        if offline_pairs is not None:
            pairs = [p for r in read_records(offline_pairs) for p in parse_pairs(r, self.tokenizer)[0]]
            self.offline = [p for p in pairs if p.chosen != p.rejected]
            if not self.offline:
                raise ValueError(f"offline_pairs {offline_pairs!r}: no pair with two different responses")
            if len(self.offline) < len(pairs):
                print(f"alignlit: offline_pairs: dropped {len(pairs) - len(self.offline)} identical pairs")
        self.iteration_pairs: list[list[dict]] = []
        """The kept pairs of every iteration so far (online state)."""

    # ------------------------------------------------------------------ setup and state
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if attached_trainer(self) is not None and self.trainer.world_size > 1:
            raise ValueError(
                f"online DPO runs in a single process: the {self.trainer.world_size} ranks would keep different "
                "numbers of pairs and take different numbers of optimizer steps"
            )

    def frozen_prefixes(self) -> list[str]:
        moving = self.hparams.reference_update == "last_iterate"
        return [p for p in super().frozen_prefixes() if not (moving and p == "reference.")]

    def online_state_dict(self) -> dict[str, Any]:
        return {"iteration_pairs": [list(pairs) for pairs in self.iteration_pairs]}

    def load_online_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration_pairs = [list(pairs) for pairs in state["iteration_pairs"]]

    # ------------------------------------------------------------------ one iteration
    def groups(self, trajectory: Trajectory) -> list[RankedGroup]:
        """One group per prompt: its ``n`` samples, raw scores and lengths in ``length_unit``."""
        rollout, n = trajectory, trajectory.n
        tokens = trajectory.action_mask.sum(-1).tolist()
        scores = trajectory.scores.tolist()
        by_chars = self.hparams.length_unit == "characters"
        return [
            RankedGroup(
                rollout.prompts[i * n],
                rollout.texts[i * n : (i + 1) * n],
                scores[i * n : (i + 1) * n],
                [len(t) for t in rollout.texts[i * n : (i + 1) * n]]
                if by_chars
                else tokens[i * n : (i + 1) * n],
                source=f"iteration {self.rollout.rollouts}, prompt {i}",
            )
            for i in range(len(rollout) // n)
        ]

    def data_path(self, t: int) -> Path | None:
        """Where iteration ``t``'s files go (None: no trainer and no ``data_dir``, nothing is written)."""
        root = self.data_dir
        if root is None and attached_trainer(self) is not None:
            root = str(Path(self.trainer.log_dir or self.trainer.default_root_dir) / f"{self.stage}_data")
        return None if root is None else Path(root) / f"iter_{t:04d}"

    def write_iteration(self, t: int, trajectory: Trajectory, pairs: list[dict]) -> None:
        """Write iteration ``t``'s ranked samples and pairs as JSONL, atomically."""
        path = self.data_path(t)
        if path is None or (attached_trainer(self) is not None and not self.trainer.is_global_zero):
            return
        rollout, n = trajectory, trajectory.n
        tokens, scores = trajectory.action_mask.sum(-1).tolist(), trajectory.scores.tolist()
        ranked = []
        for i in range(len(rollout) // n):
            rows = [j for j in range(i * n, (i + 1) * n) if rollout.texts[j].strip()]
            if rows:
                group = RankedGroup(
                    rollout.prompts[i * n], [rollout.texts[j] for j in rows], [scores[j] for j in rows],
                    [tokens[j] for j in rows],
                )  # fmt: skip
                ranked.append(group.ranked().to_record())
        write_jsonl(ranked, path.with_name(path.name + ".ranked.jsonl"))
        write_jsonl(pairs, path.with_name(path.name + ".pairs.jsonl"))

    def offline_slice(self, t: int) -> list[Pair]:
        """The offline pairs of iteration ``t``: all, or slice ``t`` of a seeded permutation."""
        k = self.hparams.offline_pairs_per_iteration
        if k is None or not self.offline:
            return list(self.offline)
        order = torch.randperm(len(self.offline), generator=torch.Generator().manual_seed(self.rollout.seed))
        start = (t - 1) * k
        return [self.offline[int(order[(start + i) % len(order)])] for i in range(k)]

    def encode(self, pairs: list[Pair]) -> list[PairExample]:
        return [
            PairExample(
                self.encoder.encode(p.prompt, p.chosen, f"{p.source}, chosen"),
                self.encoder.encode(p.prompt, p.rejected, f"{p.source}, rejected"),
                p.margin,
                p,
            )
            for p in pairs
        ]

    def pair_loss(
        self, examples: list[PairExample], reference: torch.nn.Module | None, items: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective's loss and metrics on the pairs ``items`` of ``examples``: a mean over the pairs
        (every registered loss, and the SFT term), so a token-budget micro-batch's share is its pairs'."""
        batch = collate_preference([examples[i] for i in items.tolist()], self.tokenizer.pad_token_id)
        batch.input_ids, batch.attention_mask, batch.loss_mask = (
            x.to(self.device) for x in (batch.input_ids, batch.attention_mask, batch.loss_mask)
        )
        return self.objective(self.policy, batch, reference)

    def train_on(self, trajectory: Trajectory) -> dict[str, float]:
        hp, t = self.hparams, self.rollout.rollouts
        groups, metrics = self.groups(trajectory), {}
        if hp.length_penalty > 0:
            metrics["reward/penalised"] = sum(
                sum(g.penalised_scores(hp.length_penalty)) for g in groups
            ) / len(trajectory)
        pairs, counts = best_worst_pairs(groups, length_penalty=hp.length_penalty, min_gap=hp.min_gap)
        self.iteration_pairs.append(pairs)
        self.write_iteration(t, trajectory, pairs)
        online = [p for it in self.iteration_pairs for p in it] if hp.pairs_from == "all" else pairs
        offline = self.offline_slice(t)
        train = [Pair(p["prompt"], p["chosen"], p["rejected"], 0.0, f"iteration {t}") for p in online]
        metrics.update(
            {f"pairs/{k}": float(v) for k, v in counts.items() if k != "kept"}
            | {"pairs/new": float(len(pairs)), "pairs/offline": float(len(offline))}
            | {"pairs/train": float(len(train) + len(offline))}
        )
        if hp.reference_update == "last_iterate" and t >= 2:
            self.reference.load_state_dict(self.policy.state_dict())
        if not train + offline:
            return {**metrics, **self.skip(f"no preference pair to train on ({dict(counts)})")}
        before = dict(self.encoder.counts)
        examples = self.encode(train + offline)
        metrics.update(
            {f"pairs/{k}": float(v - before.get(k, 0)) for k, v in self.encoder.counts.items()}
        )  # responses cut or prompts shortened to train_max_length / train_max_prompt_length
        reference = self.reference if self.objective.needs_reference else None
        records, what = [], f"online {self.objective.name} loss"
        for rows in self.minibatches(len(examples)):
            step = [examples[i] for i in rows.tolist()]
            lengths = torch.tensor([e.length for e in step])  # both sequences padded to the longer one
            tokens = torch.tensor([len(e.chosen.input_ids) + len(e.rejected.input_ids) for e in step])
            loss_fn = partial(self.pair_loss, step, reference)
            pairs = torch.full_like(lengths, 2)
            step_metrics = self.updates.step_over(
                "policy", lengths, loss_fn, sizes=pairs, tokens=tokens, what=what, ptx=True
            )
            records.append(step_metrics)
        metrics.update({f"dpo/{k}": v for k, v in mean_metrics(records).items()})
        return metrics
