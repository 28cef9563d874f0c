"""Reward-model and pairwise-preference-model losses (algorithms.md §1-2).

Scores are one scalar per (prompt, response) pair: ``chosen_scores`` ``r(x, y_w)`` and
``rejected_scores`` ``r(x, y_l)``, both (B,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignlit.ops.stats import check_ndim, check_same_shape


def _check_pair(chosen: torch.Tensor, rejected: torch.Tensor, names: tuple[str, str]) -> None:
    check_ndim(names[0], chosen, 1, "(B,)")
    check_same_shape(**{names[0]: chosen, names[1]: rejected})


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry pairwise loss ``-log σ(r_w - r_l - m)``, mean over the batch.

    ChatGLM-RLHF eq. 1 (with margin), RLHF-Workflow eq. 4. Computed with ``logsigmoid`` (stable for
    any score gap).

    Args:
        chosen_scores: (B,) ``r(x, y_w)``.
        rejected_scores: (B,) ``r(x, y_l)``.
        margin: optional ``m ≥ 0``, a number or a (B,) tensor (per pair, from data).

    Returns:
        ``(loss, metrics)``; metrics ``bt_loss``, ``accuracy`` (fraction with ``r_w > r_l``, ties count
        as wrong), ``margin`` (mean ``r_w - r_l``), ``chosen`` and ``rejected`` (mean scores).
    """
    _check_pair(chosen_scores, rejected_scores, ("chosen_scores", "rejected_scores"))
    gap = chosen_scores - rejected_scores  # (B,)
    logits = gap
    if margin is not None:
        if isinstance(margin, torch.Tensor) and margin.dim() != 0:
            check_same_shape(chosen_scores=chosen_scores, margin=margin)
        logits = gap - margin
    loss = -F.logsigmoid(logits).mean()
    gap = gap.detach()
    metrics = {
        "bt_loss": loss.detach(),
        "accuracy": (gap > 0).to(gap.dtype).mean(),
        "margin": gap.mean(),
        "chosen": chosen_scores.detach().mean(),
        "rejected": rejected_scores.detach().mean(),
    }
    return loss, metrics


def score_l2_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score regulariser ``r_w² + r_l²``, mean over the batch (ChatGLM-RLHF eq. 2).

    Returns:
        ``(loss, {"l2_loss": loss})``.
    """
    _check_pair(chosen_scores, rejected_scores, ("chosen_scores", "rejected_scores"))
    loss = (chosen_scores**2 + rejected_scores**2).mean()
    return loss, {"l2_loss": loss.detach()}


def pearson_correlation(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Differentiable Pearson correlation of two (N,) tensors; 0 when either is constant (a batch whose
    responses all have one length carries no length signal)."""
    check_ndim("x", x, 1, "(N,)")
    check_same_shape(x=x, y=y)
    y = y.to(x.dtype)
    dx, dy = x - x.mean(), y - y.mean()
    sx, sy = dx.pow(2).sum().sqrt(), dy.pow(2).sum().sqrt()
    if float(sx.detach()) <= eps or float(sy.detach()) <= eps:
        return (x * 0).sum()  # keeps the graph (zero gradient)
    return (dx * dy).sum() / (sx * sy)


def length_decorrelation_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Disentanglement term for the quality head: ``|ρ(r_Q(y_w) - r_Q(y_l), |y_w| - |y_l|)|``, the absolute
    Pearson correlation over the batch's pairs of the quality head's score gap with the length gap.

    ODIN (Chen et al. 2024, eq. 3) decorrelates the scores of all responses with their lengths; here the
    correlation is taken within pairs, which is what a Bradley-Terry model ranks by: on the simulated task
    a quality head uncorrelated with length over all responses still preferred the longer response of a
    pair (most length variation is between prompts), and reached 0.38 accuracy against gold.

    Returns:
        ``(loss, {"length_corr": ρ})``.
    """
    _check_pair(chosen_scores, rejected_scores, ("chosen_scores", "rejected_scores"))
    check_same_shape(chosen_scores=chosen_scores, chosen_lengths=chosen_lengths)
    check_same_shape(rejected_scores=rejected_scores, rejected_lengths=rejected_lengths)
    rho = pearson_correlation(chosen_scores - rejected_scores, chosen_lengths - rejected_lengths)
    return rho.abs(), {"length_corr": rho.detach()}


def reward_model_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    *,
    margin: torch.Tensor | float | None = None,
    l2_weight: float = 0.0,
    lm_loss: torch.Tensor | None = None,
    lm_weight: float = 0.0,
    length_scores: tuple[torch.Tensor, torch.Tensor] | None = None,
    lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
    decorrelation_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model objective ``L = L_BT + λ_reg·L_REG + β_lm·L_LM (+ λ_ρ·|ρ(r_Q, L)|)`` (algorithms.md §1).

    With a length head (ODIN-style disentanglement), the scores are the quality head's ``r_Q`` and
    ``length_scores`` the length head's ``r_L`` of the same rows: the Bradley-Terry term is taken on
    ``r_Q + r_L`` (the annotators' preferences, length bias included), the regulariser and the
    decorrelation term on ``r_Q`` alone, which is what the model is used with.

    Args:
        chosen_scores: (B,) ``r(x, y_w)`` (the quality head's, with a length head).
        rejected_scores: (B,) ``r(x, y_l)``.
        margin: optional per-pair margin for :func:`bradley_terry_loss`.
        l2_weight: ``λ_reg``, weight of :func:`score_l2_loss`.
        lm_loss: scalar next-token NLL of ``y_w`` from the backbone's LM head (PPO-max RM), e.g.
            from :func:`alignlit.losses.lm.masked_nll`; required when ``lm_weight > 0``.
        lm_weight: ``β_lm``.
        length_scores: ``(r_L(y_w), r_L(y_l))``, each (B,): the length head's scores (None: no head).
        lengths: ``(|y_w|, |y_l|)``, each (B,): response lengths, for the decorrelation term.
        decorrelation_weight: ``λ_ρ``, weight of :func:`length_decorrelation_loss` (needs ``lengths``).

    Returns:
        ``(loss, metrics)``: the Bradley-Terry metrics (of ``r_Q + r_L`` with a length head, whose
        ``accuracy`` is then also given for ``r_Q`` alone as ``quality_accuracy``), ``l2_loss``,
        ``lm_loss`` (when given), ``length_corr`` (when ``lengths`` are given) and ``loss`` (the total).
    """
    if lm_weight != 0.0 and lm_loss is None:
        raise ValueError(
            f"lm_weight is {lm_weight} but lm_loss is None; pass the LM NLL of the chosen responses"
        )
    if lm_loss is not None and lm_loss.dim() != 0:
        raise ValueError(f"lm_loss must be a scalar tensor, got shape {tuple(lm_loss.shape)}")
    if decorrelation_weight != 0.0 and lengths is None:
        raise ValueError(
            f"decorrelation_weight is {decorrelation_weight} but lengths is None; pass the response lengths"
        )
    if length_scores is None:
        bt, metrics = bradley_terry_loss(chosen_scores, rejected_scores, margin)
    else:
        _check_pair(chosen_scores, rejected_scores, ("chosen_scores", "rejected_scores"))
        check_same_shape(chosen_scores=chosen_scores, chosen_length_scores=length_scores[0])
        check_same_shape(rejected_scores=rejected_scores, rejected_length_scores=length_scores[1])
        bt, metrics = bradley_terry_loss(
            chosen_scores + length_scores[0], rejected_scores + length_scores[1], margin
        )
        gap = (chosen_scores - rejected_scores).detach()
        metrics["quality_accuracy"] = (gap > 0).to(gap.dtype).mean()
    l2, l2_metrics = score_l2_loss(chosen_scores, rejected_scores)
    metrics.update(l2_metrics)
    loss = bt + l2_weight * l2
    if lengths is not None:
        decorrelation, corr_metrics = length_decorrelation_loss(chosen_scores, rejected_scores, *lengths)
        metrics.update(corr_metrics)
        loss = loss + decorrelation_weight * decorrelation
    if lm_loss is not None:
        loss = loss + lm_weight * lm_loss
        metrics["lm_loss"] = lm_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def ab_probability(logit_a: torch.Tensor, logit_b: torch.Tensor) -> torch.Tensor:
    """``softmax(logit_A, logit_B)[A] = σ(logit_A - logit_B)``: the pairwise model's ``P(A ≻ B)``.

    RLHF-Workflow §2.2; the logits are the LM's next-token logits of the tokens ``A`` and ``B``.
    """
    check_same_shape(logit_a=logit_a, logit_b=logit_b)
    return torch.sigmoid(logit_a - logit_b)


def ab_order_averaged_probability(
    logit_a_forward: torch.Tensor,
    logit_b_forward: torch.Tensor,
    logit_a_swapped: torch.Tensor,
    logit_b_swapped: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-debiased ``P(y_1 ≻ y_2) = ½(P(A | y_1, y_2) + 1 - P(A | y_2, y_1))`` (algorithms.md §2).

    Args:
        logit_a_forward, logit_b_forward: logits of ``A``/``B`` with ``y_1`` shown as response A.
        logit_a_swapped, logit_b_swapped: the same with the two responses swapped.

    Returns:
        ``(probability, consistent)``: the averaged ``P(y_1 ≻ y_2)`` and a bool tensor, True where both
        orders prefer the same response (``P(A | y_1, y_2) > ½`` iff ``P(A | y_2, y_1) < ½``).
    """
    forward = ab_probability(logit_a_forward, logit_b_forward)
    swapped = ab_probability(logit_a_swapped, logit_b_swapped)
    check_same_shape(logit_a_forward=logit_a_forward, logit_a_swapped=logit_a_swapped)
    consistent = (forward > 0.5) == (swapped < 0.5)
    return 0.5 * (forward + 1.0 - swapped), consistent


def ab_preference_loss(
    logit_a: torch.Tensor, logit_b: torch.Tensor, label_is_a: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy of the 2-way softmax over ``(logit_A, logit_B)`` against the preferred label.

    RLHF-Workflow §2.2: equals ``-log σ(logit_A - logit_B)`` when A is preferred and
    ``-log σ(logit_B - logit_A)`` when B is; mean over the batch.

    Args:
        logit_a: (B,) next-token logit of ``A``.
        logit_b: (B,) next-token logit of ``B``.
        label_is_a: (B,) bool, True where response A is the preferred one.

    Returns:
        ``(loss, metrics)``; metrics ``ab_loss``, ``accuracy`` (``P(A) > ½`` matches the label; exact
        ties count as wrong) and ``prob_a`` (mean ``P(A)``).
    """
    check_ndim("logit_a", logit_a, 1, "(B,)")
    check_same_shape(logit_a=logit_a, logit_b=logit_b, label_is_a=label_is_a)
    if label_is_a.dtype != torch.bool:
        raise ValueError(f"label_is_a must be a bool tensor, got dtype {label_is_a.dtype}")
    sign = label_is_a.to(logit_a.dtype) * 2 - 1  # +1 where A is preferred, -1 where B is
    gap = logit_a - logit_b  # (B,)
    loss = -F.logsigmoid(sign * gap).mean()
    gap = gap.detach()
    metrics = {
        "ab_loss": loss.detach(),
        "accuracy": (sign * gap > 0).to(gap.dtype).mean(),
        "prob_a": torch.sigmoid(gap).mean(),
    }
    return loss, metrics
