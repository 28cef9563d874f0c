"""Online RRHF (RRHF §5, online sampling OP-k; algorithms.md §7) on the online-stage base.

One ``training_step`` is one resample: ``k`` responses per prompt of the DataModule's next batch are
sampled from the current policy and scored (optionally ``r - β·KL(π‖π_0)``), responses from other
sources are added, and :meth:`OnlineRRHFModule.train_on` takes ``resample_every`` optimizer steps of
the RRHF loss on that set before the next resample.
"""

from __future__ import annotations

import torch

from alignlit.data.encoding import Encoded, Truncation, pad_left, pad_right
from alignlit.data.records import read_records
from alignlit.hub import Pretrained
from alignlit.lightning_internals import attached_trainer
from alignlit.losses import rrhf_loss
from alignlit.models.forward import token_logprobs
from alignlit.models.tiny import TinyLlama
from alignlit.modules.online import OnlineModule
from alignlit.modules.online_parts import mean_metrics
from alignlit.modules.trajectory import Minibatches, Trajectory
from alignlit.ops import kl_estimate
from alignlit.rollout.reward_protocol import Reward, score_texts


def read_extra_responses(path: str) -> dict[str, list[str]]:
    """Responses from other sources by prompt: ranked ``{"prompt", "responses"}``, pair
    ``{"prompt", "chosen", "rejected"}`` or SFT ``{"prompt", "response"}`` records (any scores are
    ignored: the stage scores every response with its own reward). Repeats are kept once."""
    extras: dict[str, list[str]] = {}
    for record in read_records(path):
        fields = record.fields
        if "responses" in fields:
            texts = fields["responses"]
            if not isinstance(texts, list) or not all(isinstance(t, str) and t.strip() for t in texts):
                raise record.error("responses", "expected a list of non-empty strings")
        else:
            keys = [k for k in ("chosen", "rejected", "response") if k in fields]
            if not keys:
                raise record.error(
                    None, f"expected 'responses', 'chosen'/'rejected' or 'response'; got {sorted(fields)}"
                )
            texts = [record.text(k) for k in keys]
        mine = extras.setdefault(record.text("prompt"), [])
        mine += [t for t in texts if t not in mine]
    return extras


class OnlineRRHFModule(OnlineModule):
    """Online RRHF (RRHF §5; algorithms.md §7): rank responses sampled from the policy itself, resampled
    every ``minibatches.steps`` optimizer steps.

    A training step samples ``k = rollout.samples_per_prompt`` responses for each prompt of the
    DataModule's next batch and adds the prompt's responses from ``extra_responses``; every response is
    scored with the reward, minus ``β·KL`` when ``kl`` is set: ``KL = Σ_t kl_t`` over the response's
    tokens with the per-token estimator ``kl.estimator`` of ``log π_θ`` (the policy at sampling time)
    against ``log π_0`` (the sampled tokens for samples, the re-tokenised text for extra responses).
    Then ``minibatches.steps`` updates, each of :func:`~alignlit.losses.rrhf_loss` on ``minibatches.size``
    prompts of the set (shuffled passes), ``L = rank_weight·L_rank + sft_weight·L_ft`` averaged over
    prompts. Responses are re-tokenised from their texts (``prompt + response + EOS``, as offline RRHF
    reads them; cuts are counted as ``set/*truncated``). Logged every resample: the length diagnostics of
    the samples, ``kl/ref`` (``k1`` per sample), the shaped reward and ``rrhf/*``. Single process only.

    Args:
        policy: see :class:`~alignlit.modules.online.OnlineModule`.
        reward: see :class:`~alignlit.modules.online.OnlineModule` (with ``extra_responses``, one that
            scores texts: a reward-model directory or a callable).
        rank_weight: weight of the ranking loss.
        sft_weight: weight of the summed NLL of the best response.
        minibatches: ``steps`` optimizer steps on one sampled set before the next resample (RRHF's OP-k,
            default 8), each on ``size`` prompts; with ``token_budget``, a step's prompts run in
            micro-batches of at most that many padded tokens (a prompt: its responses × the longest
            sequence), each loss weighted by its share of the prompts.
        extra_responses: a file of responses from other sources added to their prompt's set (see
            :func:`read_extra_responses`); prompts it lacks get only their samples. Without it
            ``rollout.samples_per_prompt`` must be >= 2 (one response per prompt ranks nothing).
        train_max_length: longest ``prompt + response`` in tokens (responses are cut).
        train_max_prompt_length: prompts are left-truncated to this many tokens.
        **kwargs: the arguments of :class:`~alignlit.modules.online.OnlineModule` (reference, rollout,
            kl (the penalty ``β·KL(π‖π_0)`` subtracted from each response's reward, fixed or adapted to a
            target after every resample), optim, max_grad_norm, dynamic_sampling, ptx, prompt_filter,
            gold, val_sampling, reward_batch_size, dtype, curves_file, export_dir); ``tis_cap`` does not
            apply.
    """

    stage = "online_rrhf"
    min_loss_tokens = 0  # the set is re-read from its texts
    curve_panels = (
        ("reward/raw", "reward (raw)"),
        ("reward/shaped", "reward - β·KL"),
        ("kl/ref", "KL(π‖π0) per response"),
        ("response/length", "response length (tokens)"),
        ("length/reward_corr", "per-prompt corr(reward, length)"),
        ("rrhf/loss", "RRHF loss"),
        ("rrhf/rank_loss", "ranking loss"),
        ("rrhf/ranking_accuracy", "ranking accuracy"),
        ("val/gold", "held-out gold reward"),
        ("val/kl", "held-out KL to π0"),
        ("val/length", "held-out length (tokens)"),
        ("time/rollout_s", "rollout time (s)"),
    )

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        reward: str | Reward,
        rank_weight: float = 1.0,
        sft_weight: float = 1.0,
        minibatches: Minibatches = Minibatches(steps=8),
        extra_responses: str | None = None,
        train_max_length: int = 512,
        train_max_prompt_length: int = 256,
        **kwargs,
    ):
        if not (rank_weight >= 0 and sft_weight >= 0):
            raise ValueError(f"rank_weight and sft_weight must be >= 0, got {rank_weight}, {sft_weight}")
        if kwargs.get("tis_cap") is not None or kwargs.get("rollout_correction") is not None:
            raise ValueError(
                "tis_cap / rollout_correction weight policy-gradient token losses; RRHF has none"
            )
        super().__init__(policy, reward, minibatches=minibatches, **kwargs)
        if self.rollout.samples_per_prompt < 2 and not extra_responses:
            raise ValueError(
                "online RRHF ranks each prompt's responses: with rollout.samples_per_prompt 1 and no "
                "extra_responses every set holds one response, the ranking loss is 0 and the run is SFT on "
                "the policy's own samples; set samples_per_prompt >= 2"
            )
        self.truncation = Truncation(
            self.tokenizer, max_length=train_max_length, max_prompt_length=train_max_prompt_length
        )
        self.extras = read_extra_responses(extra_responses) if extra_responses else {}
        if self.extras and not callable(self.reward) and not hasattr(self.reward, "score"):
            raise ValueError(
                "extra_responses need a reward that scores texts (a reward-model directory or a callable)"
            )

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if attached_trainer(self) is not None and self.trainer.world_size > 1:
            raise ValueError("online RRHF runs in a single process")

    # ------------------------------------------------------------------ the set of one resample
    def encode(self, prompt: str, text: str, source: str) -> Encoded:
        return self.truncation.encode(prompt, text, source, allow_empty=True)

    def flat_batch(self, encoded: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, loss_mask)``, each (M, T), of right-padded sequences."""
        ids, attention = pad_right([e.input_ids for e in encoded], self.tokenizer.pad_token_id)  # (M, T)
        prompt_len = torch.tensor([e.prompt_length for e in encoded])[:, None]  # (M, 1)
        loss_mask = attention & (torch.arange(ids.shape[1])[None, :] >= prompt_len)
        return ids.to(self.device), attention.to(self.device), loss_mask.to(self.device)

    @torch.no_grad()
    def extra_kl(self, encoded: list[Encoded]) -> torch.Tensor:
        """(M,) ``Σ_t kl_t`` of re-tokenised responses, policy against reference, teacher-forced."""
        pad = self.tokenizer.pad_token_id
        prompts = pad_left([e.input_ids[: e.prompt_length] for e in encoded], pad)  # (M, P) ids and mask
        responses = pad_right([e.input_ids[e.prompt_length :] for e in encoded], pad)  # (M, T)
        ids = (*prompts, *responses)
        policy, reference = self.logprobs(self.policy, ids), self.logprobs(self.reference, ids)  # (M, T)
        mask = responses[1].to(self.device)
        return (kl_estimate(policy, reference, self.kl.estimator) * mask).sum(-1).cpu()

    def response_sets(self, trajectory: Trajectory) -> tuple[list[list[Encoded]], list[torch.Tensor], dict]:
        """Per prompt: its encoded responses (samples, then extras) and their (shaped) rewards."""
        k, before = trajectory.n, dict(self.truncation.counts)
        beta = self.kl_ctl.value if self.kl_ctl is not None else 0.0
        sample_kl = trajectory.kl.sum(-1).cpu() if trajectory.kl is not None else torch.zeros(len(trajectory))
        rewards = trajectory.scores.cpu() - beta * sample_kl  # (N,)
        prompts = trajectory.prompts[::k]
        sets = [
            [self.encode(p, trajectory.texts[j], f"sample {j}") for j in range(i * k, (i + 1) * k)]
            for i, p in enumerate(prompts)
        ]
        scores = [rewards[i * k : (i + 1) * k] for i in range(len(prompts))]
        extras = [(i, text) for i, p in enumerate(prompts) for text in self.extras.get(p, [])]
        if extras:
            encoded = [self.encode(prompts[i], text, f"extra response of prompt {i}") for i, text in extras]
            extra_rewards = score_texts(self.reward, [prompts[i] for i, _ in extras], [t for _, t in extras])
            if self.kl is not None:
                extra_rewards = extra_rewards - beta * self.extra_kl(encoded)
            for (i, _), enc, value in zip(extras, encoded, extra_rewards):
                sets[i].append(enc)
                scores[i] = torch.cat([scores[i], value[None]])
        metrics = {
            "reward/shaped": float(torch.cat(scores).mean()),
            "set/extra_responses": float(len(extras)),
        } | {f"set/{k}": float(v - before.get(k, 0)) for k, v in self.truncation.counts.items()}
        return sets, scores, metrics

    # ------------------------------------------------------------------ updates
    def rrhf(self, sets: list[list[Encoded]], scores: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """RRHF loss averaged over the prompts of a minibatch (prompts grouped by their number of
        responses, one :func:`~alignlit.losses.rrhf_loss` call per group, weighted by its size)."""
        ids, attention, loss_mask = self.flat_batch([e for s in sets for e in s])
        scored = token_logprobs(self.policy, ids, attention, loss_mask)  # (M, T-1)
        starts = torch.tensor([0] + [len(s) for s in sets]).cumsum(0).tolist()
        loss, sums, weights = torch.zeros((), device=self.device), {}, {}
        for k in sorted({len(s) for s in sets}):  # responses per prompt
            members = [b for b, s in enumerate(sets) if len(s) == k]
            rows = torch.tensor([starts[b] + i for b in members for i in range(k)], device=self.device)
            width = scored.logprobs.shape[-1]
            group_loss, metrics = rrhf_loss(
                scored.logprobs[rows].view(len(members), k, width),  # (B_k, k, T-1)
                scored.mask[rows].view(len(members), k, width),
                torch.stack([scores[b] for b in members]).to(self.device),  # (B_k, k)
                rank_weight=self.hparams.rank_weight,
                sft_weight=self.hparams.sft_weight,
            )
            share = len(members) / len(sets)
            loss = loss + share * group_loss
            for name, value in metrics.items():  # ranking_accuracy is NaN when every reward is tied
                if not torch.isnan(value):
                    sums[name] = sums.get(name, 0.0) + share * value
                    weights[name] = weights.get(name, 0.0) + share
        return loss, {name: sums[name] / weights[name] for name in sums}

    def train_on(self, trajectory: Trajectory) -> dict[str, float]:
        sets, scores, metrics = self.response_sets(trajectory)
        records = []
        for rows in self.minibatches(len(sets)):
            step = [sets[b] for b in rows.tolist()]
            sizes = torch.tensor([len(s) for s in step])  # a set's responses padded to the longest
            lengths = torch.tensor([max(len(e.input_ids) for e in s) for s in step])
            tokens = torch.tensor([sum(len(e.input_ids) for e in s) for s in step])

            def loss_fn(items: torch.Tensor, rows: torch.Tensor = rows) -> tuple[torch.Tensor, dict]:
                chosen = rows[items].tolist()
                return self.rrhf([sets[b] for b in chosen], [scores[b] for b in chosen])

            records.append(
                self.updates.step_over(
                    "policy", lengths, loss_fn, sizes=sizes, tokens=tokens, what="online RRHF loss", ptx=True
                )
            )
        metrics.update({f"rrhf/{k}": v for k, v in mean_metrics(records).items()})
        return metrics
