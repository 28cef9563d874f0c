"""Online KTO (Ethayarajh et al. 2024, eq. 8) as a researcher adds it, outside alignlit, on the online base.

The base samples ``n`` responses per prompt, scores them and builds their Trajectory (reference and old
log-probs included); this stage only labels and trains. A sample scoring above its group's mean is
desirable, one below undesirable (ties carry no label and are left out). With the implied reward
``r = Σ_t (log π_θ - log π_ref)`` and the reference point ``z = max(0, KL(π_old ‖ π_ref))`` of the rollout:
``L = λ_D·(1 - σ(β(r - z)))`` for a desirable sample, ``λ_U·(1 - σ(β(z - r)))`` for an undesirable one.

    alignlit fit --config configs/quickstart/grpo.yaml --model.class_path examples.online_kto.OnlineKTOModule
"""

from __future__ import annotations

import torch

from alignlit.models.forward import response_logprobs
from alignlit.modules import OnlineModule, Trajectory


class OnlineKTOModule(OnlineModule):
    """Online KTO. Args: ``beta`` (β), ``desirable_weight`` (λ_D), ``undesirable_weight`` (λ_U), and the
    online base's arguments (``rollout.samples_per_prompt`` >= 2)."""

    stage = "online_kto"

    def __init__(self, policy, reward, beta: float = 0.1, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, **kwargs):  # fmt: skip
        super().__init__(policy, reward, **kwargs)
        self.beta, self.weights = beta, (desirable_weight, undesirable_weight)

    def kto_loss(self, mb: Trajectory, z: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logprobs = response_logprobs(self.policy, *mb.ids, temperature=self.rollout.sampling.temperature)
        r = ((logprobs - mb.ref_logprobs) * mb.loss_mask).sum(-1)  # (m,) implied rewards
        desirable = mb.advantages > 0
        value = torch.sigmoid(self.beta * torch.where(desirable, r - z, z - r))
        weight = torch.where(desirable, self.weights[0], self.weights[1])
        loss = (weight * (1 - value)).mean()
        return loss, {"loss": loss.detach(), "desirable": desirable.float().mean(), "reward": r.detach().mean()}

    def train_on(self, trajectory: Trajectory) -> dict[str, float]:
        grouped = trajectory.rewards.view(-1, trajectory.n)  # (B, n)
        trajectory.advantages = (grouped - grouped.mean(-1, keepdim=True)).flatten()  # the label's sign
        kl = ((trajectory.old_logprobs - trajectory.ref_logprobs) * trajectory.action_mask).sum(-1)
        z = kl.mean().clamp(min=0)  # the reference point, detached (computed without gradient)
        batch = self.trainable(trajectory)
        batch = batch.select((batch.advantages != 0).nonzero().flatten())  # ties carry no label
        if len(batch) == 0:
            return self.skip("every group's rewards are equal (no desirable or undesirable sample)")
        records = []
        for rows in self.minibatches(len(batch)):
            loss, metrics = self.kto_loss(batch.select(rows), z)
            metrics["grad_norm"] = self.update("policy", loss)
            records.append(metrics)
        return {f"kto/{k}": float(torch.stack([r[k] for r in records]).mean()) for k in records[0]} | {
            "kto/z": float(z)
        }
