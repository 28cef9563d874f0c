"""What a policy trained on the answer check can reach at a KL budget: the KL-regularised optimum.

A policy that maximises ``E[v] − β·KL(π‖π_SFT)`` for a reward ``v`` is the tilted SFT policy
``π_β(y|x) ∝ π_SFT(y|x)·exp(v(x, y)/β)`` (the optimum every KL-regularised method, GRPO's KL term and
RLOO's and PPO's KL in the reward, aims at). For each of ``--prompts`` ``prompts_val`` prompts this
script draws ``--n`` responses of the SFT policy at T = 1 and estimates, for a range of ``β``, the tilted
policy on those samples (self-normalised weights ``w_j ∝ exp(v_j/β)``): its KL to SFT per prompt,
``Σ_j w_j log(n·w_j)``, its pass rate ``Σ_j w_j v_j`` and its gold, ``Σ_j w_j g_j``. Two tilts:

- ``v`` = the strict answer check (``alignlit.rewards.SimVerifier``): the highest pass rate any policy
  can have at each KL (up to the sampling estimate), and the gold of that policy. Since the check is 1
  exactly when gold is 1, the tilt moves mass onto gold-1 answers and leaves the other responses in
  SFT's proportions (their mean gold stays SFT's). Its gold is a reference, not a bound: a trained
  policy can reach more gold at the same KL by also changing its rejected responses (shorter, closer
  wrong answers), which the check does not reward but gold does;
- ``v`` = gold itself: the most gold any policy can have at each KL (the gold-selected best-of-n rows
  lie on or below it).

Prompts whose ``n`` samples hold no accepted answer keep SFT's gold in the verifier tilt (an estimate
from ``n`` samples: a policy could find answers SFT puts less than about ``1/n`` mass on). Reads only
``prompts_val``; writes ``verifiable_frontier.{json,md,png}`` (the PNG with the rows of
``verifiable.json`` when it exists). The SFT samples' gold and answer-check values are the cell ``samples``
under ``out/bench/verifiable_frontier/cells`` (``harness.Cells``), read back for the same settings, SFT
export and prompts, so a second run only redoes the tilts.

    python benchmarks/bench_verifiable_frontier.py --root out/bv/root
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from harness import command_line, measurement_cells, write_results  # benchmarks/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
BETAS = [round(10 ** (k / 20), 4) for k in range(-40, 21)]  # 0.01 ... 10
KL_BUDGETS = (0.64, 1.0, 1.5, 1.84)


def tilt(rewards: torch.Tensor, values: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt (rows of ``(P, n)`` samples): KL to the sampling policy and the mean of ``values``
    (``(P, n)`` or ``(K, P, n)``) under the policy ``∝ exp(rewards/β)`` on the samples. Returns the
    (P,) KL and the (P,) or (K, P) means."""
    weights = torch.softmax(rewards / beta, dim=-1)  # (P, n)
    n = rewards.shape[-1]
    kl = (weights * torch.log(weights.clamp_min(1e-30) * n)).sum(-1)
    return kl, (weights * values).sum(-1)


def curve(rewards: torch.Tensor, gold: torch.Tensor, check: torch.Tensor) -> list[dict]:
    """The tilt ``∝ exp(rewards/β)`` for every β of ``BETAS``: its mean KL, gold and pass rate, by KL."""
    points = []
    for beta in BETAS:
        kl, (g, passed) = tilt(rewards, torch.stack([gold, check]), beta)
        points.append(
            {"beta": beta, "kl": kl.mean().item(), "gold": g.mean().item(), "pass_rate": passed.mean().item()}
        )
    return sorted(points, key=lambda p: p["kl"])


def value_at(points: list[dict], budget: float, key: str = "gold") -> float:
    """The highest ``key`` on the curve at KL <= ``budget`` (linear interpolation between its points)."""
    best = max((p[key] for p in points if p["kl"] <= budget), default=float("nan"))
    for a, b in itertools.pairwise(points):
        if a["kl"] <= budget < b["kl"]:
            t = (budget - a["kl"]) / (b["kl"] - a["kl"])
            best = max(best, a[key] + t * (b[key] - a[key]))
    return best


def sample(args, prompts: list[str]) -> dict:
    """``--n`` SFT samples per prompt: their gold and answer-check values (``(P, n)`` lists) and seconds."""
    from alignlit.eval.gold import chunked_rollouts
    from alignlit.models import load_policy
    from alignlit.rewards import SimVerifier
    from alignlit.rollout import SamplingParams
    from alignlit.sim import SimGoldReward

    root = Path(args.root)
    sim = str(root / "data" / "sim")
    policy, tokenizer = load_policy(root / args.sft)
    policy.eval()
    verifier, gold_fn = SimVerifier(sim), SimGoldReward(sim)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    start = time.perf_counter()
    golds, checks = [], []
    for rollout in chunked_rollouts(
        policy, tokenizer, prompts, n=args.n, sampling=sampling, batch_size=args.batch_size
    ):
        golds.append(gold_fn(rollout.prompts, rollout.texts).view(-1, args.n))
        checks.append(verifier(rollout.prompts, rollout.texts).view(-1, args.n))
    gold, check = torch.cat(golds), torch.cat(checks)
    return {"gold": gold.tolist(), "check": check.tolist(), "sample_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="out/bv/root", help="where data/sim and out/quickstart/sft are")
    p.add_argument("--sft", default="out/quickstart/sft", help="SFT policy, relative to --root")
    p.add_argument("--prompts", type=int, default=200, help="prompts_val prompts")
    p.add_argument("--n", type=int, default=64, help="SFT samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)

    from alignlit.data import parse_prompt, read_records

    root = Path(args.root)
    prompts = [parse_prompt(r) for r in read_records(root / "data/sim/prompts_val.jsonl")][: args.prompts]
    settings = {k: v for k, v in vars(args).items() if k != "results"}
    spec = {
        **settings,
        "sft_exported": (root / args.sft / "config.json").stat().st_mtime,
        "prompts_sha256": hashlib.sha256("\0".join(prompts).encode()).hexdigest(),
    }
    samples = measurement_cells("verifiable_frontier").run("samples", lambda: sample(args, prompts), spec)
    gold, check = torch.tensor(samples["gold"]), torch.tensor(samples["check"])  # (P, n)
    sample_s = samples["sample_s"]
    assert torch.equal(check == 1, gold == 1), "the strict check accepts exactly the gold-1 answers"

    pass_rate = check.mean(-1)  # (P,) SFT's per-prompt chance of an accepted answer
    curves = {"verifier": curve(check, gold, check), "gold": curve(gold, gold, check)}
    table = {
        name: {str(b): {key: value_at(points, b, key) for key in ("gold", "pass_rate")} for b in KL_BUDGETS}
        for name, points in curves.items()
    }
    out = {
        "setup": {**vars(args), "date": time.strftime("%Y-%m-%d"), "sample_s": round(sample_s, 1)},
        "sft": {
            "gold": gold.mean().item(),
            "pass_rate": pass_rate.mean().item(),
            "pass_rate_quartiles": torch.quantile(pass_rate, torch.tensor([0.25, 0.5, 0.75])).tolist(),
            "prompts_without_accepted_sample": int((pass_rate == 0).sum()),
            "gold_of_rejected": gold[check == 0].mean().item(),
        },
        "best_at_kl": table,
        "curves": curves,
    }
    results = Path(args.results)
    md = [
        "| KL-regularised optimum of | "
        + " | ".join(f"KL ≤ {b}: gold (pass rate)" for b in KL_BUDGETS)
        + " |",
        "|---|" + "---:|" * len(KL_BUDGETS),
        *(
            f"| {name} | "
            + " | ".join(
                f"{table[name][str(b)]['gold']:.3f} ({table[name][str(b)]['pass_rate']:.3f})"
                for b in KL_BUDGETS
            )
            + " |"
            for name in ("verifier", "gold")
        ),
    ]
    sft = out["sft"]
    note = (
        f"\nSFT on {len(prompts)} prompts_val prompts x {args.n} samples (T = 1, seed {args.seed}): gold "
        f"{sft['gold']:.3f}, answer check pass rate {sft['pass_rate']:.3f} (per-prompt quartiles "
        + ", ".join(f"{q:.3f}" for q in sft["pass_rate_quartiles"])
        + f"; {sft['prompts_without_accepted_sample']} prompts without an accepted sample), mean gold of the "
        f"rejected responses {sft['gold_of_rejected']:.3f}. The verifier row's pass rate is the most any policy "
        "reaches at that KL (up to the sampling estimate); its gold is that policy's, which a trained policy can "
        "exceed by also improving its rejected responses."
    )
    command = command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    write_results("verifiable_frontier", out, command=command, table="\n".join(md) + "\n" + note, results_dir=results,
                  plot={"verifiable_frontier.png": lambda path: plot(curves, results / "verifiable.json", path)})  # fmt: skip
    print("\n".join(md) + "\n" + note)
    return out


def plot(curves: dict, table_json: Path, out_file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for name, label in (
        ("gold", "optimum for gold (any policy)"),
        ("verifier", "optimum for the answer check"),
    ):
        points = [q for q in curves[name] if q["kl"] <= 3.0]
        ax.plot([q["kl"] for q in points], [q["gold"] for q in points], "-", linewidth=1.5, label=label)
    if table_json.exists():
        rows = json.loads(table_json.read_text())["table"]
        for row in rows:
            if row.get("status") or row.get("kl_to_sft") is None:
                continue
            ax.errorbar(
                row["kl_to_sft"],
                row["gold"],
                xerr=row.get("kl_to_sft_std") or None,
                yerr=row.get("gold_std") or None,
                fmt="o",
                markersize=4,
                capsize=2,
            )
            ax.annotate(
                row["label"],
                (row["kl_to_sft"], row["gold"]),
                fontsize=6,
                xytext=(3, 2),
                textcoords="offset points",
            )
    ax.axhline(0.85, color="grey", linestyle=":", linewidth=1)
    ax.axvline(1.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("KL to SFT (nats per response)")
    ax.set_ylabel("gold reward")
    ax.set_title(
        "KL-regularised optima (prompts_val, from SFT samples) and the verifiable table (test)", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_file, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
