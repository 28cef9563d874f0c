"""The quality benchmark's machinery (``benchmarks/bench_quality.py`` runs it; ``bench_claims.py`` and
``bench_reward_ablations.py`` build on it): the methods and suites, their grids, the plan of cells (training
runs and evaluations, each a cell (``harness.Cells``) under the work directory, read back while what it was
computed from is unchanged, so a rerun resumes), the shared stages, the evaluation, the aggregation and the
table."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import (
    Cells,
    config_args,
    config_sha256,
    config_stack,
    fmt_s,
    get_key,
    mean_std,
    pm,
    read_config,
    run_alignlit,
)

ROOT = Path(__file__).resolve().parents[2]

# --- what is benchmarked ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One row of the table.

    ``kind``: ``"sft"`` (the shared SFT policy), ``"best_of"`` (``n`` samples of SFT, the best by
    ``selector`` ``"rm"`` or ``"gold"``) or ``"fit"`` (``alignlit fit --config <configs>/<config>.yaml``
    from the shared stages). ``max_val_kl``: this row's KL budget for the selection, instead of
    ``--max-val-kl`` (a second row of one config at another budget, with its own grid).
    """

    name: str
    label: str
    kind: str
    config: str | None = None
    n: int = 1
    selector: str | None = None
    max_val_kl: float | None = None


METHODS: list[Method] = [
    Method("sft", "SFT", "sft"),
    Method("bo4-rm", "SFT best-of-4, RM-selected", "best_of", n=4, selector="rm"),
    Method("bo16-rm", "SFT best-of-16, RM-selected", "best_of", n=16, selector="rm"),
    Method("bo4-gold", "SFT best-of-4, gold-selected (oracle)", "best_of", n=4, selector="gold"),
    Method("bo16-gold", "SFT best-of-16, gold-selected (oracle)", "best_of", n=16, selector="gold"),
    Method("rft", "RFT (SFT on the RM's best of 4)", "fit", "rft"),
    Method("dpo", "DPO + SFT term", "fit", "dpo"),
    Method("cdpo", "cDPO", "fit", "cdpo"),
    Method("ipo", "IPO", "fit", "ipo"),
    Method("simpo", "SimPO", "fit", "simpo"),
    Method("rrhf", "RRHF", "fit", "rrhf"),
    Method("online-dpo", "online iterative DPO", "fit", "online-dpo"),
    Method("online-rrhf", "online RRHF", "fit", "online-rrhf"),
    Method("ppo-max", "PPO-max", "fit", "ppo"),
    Method("ppo-vanilla", "vanilla PPO", "fit", "ppo-vanilla"),
    Method("grpo", "GRPO", "fit", "grpo"),
    Method("rloo", "RLOO", "fit", "rloo"),
    # RLVR: the same policy-gradient stages against a rule-based answer check (alignlit.rewards.SimVerifier)
    Method("grpo-verifiable", "GRPO, verifier", "fit", "grpo-verifiable"),
    Method("dr-grpo-verifiable", "Dr. GRPO, verifier", "fit", "dr-grpo-verifiable"),
    Method("rloo-verifiable", "RLOO, verifier", "fit", "rloo-verifiable"),
    Method("reinforce-pp-verifiable", "REINFORCE++-baseline, verifier", "fit", "reinforce-pp-verifiable"),
    Method("dapo-verifiable", "DAPO, verifier", "fit", "dapo-verifiable"),
    Method("ppo-verifiable", "PPO, verifier", "fit", "ppo-verifiable"),
    # the issue's moonshot (gold >= 0.95 at KL below 1.84, gold best-of-16's analytic KL): DAPO, the row
    # that kept gaining longest in the validation probes, trained longer and chosen within that budget
    Method(
        "dapo-verifiable-long", "DAPO, verifier, KL < 1.84 budget", "fit", "dapo-verifiable", max_val_kl=1.75
    ),
]

VERIFIABLE = [m.name for m in METHODS if (m.config or "").endswith("-verifiable")]


@dataclass(frozen=True)
class Suite:
    """A table: its rows (``methods``), the shared stages they start from, and the result file names
    ``<results>/<name>.{md,json}``, ``<name>_selection.md`` and ``plot``."""

    name: str
    methods: tuple[str, ...]
    shared: tuple[str, ...]
    plot: str


SUITES = {
    "quality": Suite(
        "quality",
        tuple(m.name for m in METHODS if m.name not in VERIFIABLE),
        ("make-data", "sft", "reward", "samples"),
        "quality_frontier.png",
    ),
    # RLVR (README "Verifiable rewards"): no reward model, so the shared stages are data and SFT; the
    # gold-selected best-of-n rows are the references the target is stated against
    "verifiable": Suite(
        "verifiable", ("sft", "bo4-gold", "bo16-gold", *VERIFIABLE), ("make-data", "sft"), "verifiable.png"
    ),
}

LR = ("optim.lr", (0.5, 1.0, 2.0))
"""A learning-rate grid: the config's own ``optim.lr`` times each factor."""

GRIDS: dict[str, list[dict] | tuple[str, tuple[float, ...]]] = {
    # the hyperparameter each method is most sensitive to, a few values around the config's own
    "rft": LR,
    "dpo": [{"loss_args": {"beta": b, "label_smoothing": 0.0}} for b in (0.05, 0.1, 0.3)],
    "cdpo": [{"loss_args": {"beta": 0.1, "label_smoothing": e}} for e in (0.05, 0.1, 0.2)],
    "ipo": [{"loss_args": {"beta": b}} for b in (0.1, 0.5, 1.0)],
    "simpo": [{"loss_args": {"beta": b, "gamma": g}} for b, g in ((2.0, 0.5), (2.0, 1.0), (5.0, 1.0))],
    "rrhf": [{"rank_weight": w} for w in (0.1, 0.3, 1.0)],
    "online-dpo": LR,
    "online-rrhf": LR,
    "ppo-max": [{"kl.coef": c} for c in (0.02, 0.05, 0.1)],
    "ppo-vanilla": LR,
    "grpo": LR,
    "rloo": LR,
    # RLVR: the length of training (rollouts of 80 responses); gold and KL to SFT both grow with it, and
    # --max-val-kl (a row's max_val_kl) keeps the choice within a KL budget
    **{
        m: [{"trainer.limit_train_batches": r} for r in (60, 80, 100)]
        for m in (
            "grpo-verifiable",
            "dr-grpo-verifiable",
            "rloo-verifiable",
            "reinforce-pp-verifiable",
            "dapo-verifiable",
        )
    },
    "ppo-verifiable": [{"trainer.limit_train_batches": r} for r in (30, 40, 50)],
    "dapo-verifiable-long": [{"trainer.limit_train_batches": r} for r in (200, 260)],
}

# Rough wall times (s) of one stage on 2 idle CPU cores with the paper-scale configs, for the first ETA;
# measured times replace them as cells finish. Quickstart configs take about a third, --tiny ~20 s.
ESTIMATE_S = {
    "make-data": 15,
    "sft": 270,
    "reward": 280,
    "samples": 150,
    "rft": 120,
    "dpo": 130,
    "cdpo": 130,
    "ipo": 130,
    "simpo": 110,
    "rrhf": 130,
    "online-dpo": 300,
    "online-rrhf": 300,
    "ppo-max": 250,
    "ppo-vanilla": 230,
    "grpo": 250,
    "rloo": 250,
    "eval": 30,
    "eval-best-of": 120,
    # RLVR, measured at quickstart scale (60 rollouts ~35 s, PPO's 40 ~60 s) and scaled up here
    "grpo-verifiable": 100,
    "dr-grpo-verifiable": 100,
    "rloo-verifiable": 100,
    "reinforce-pp-verifiable": 100,
    "dapo-verifiable": 100,
    "ppo-verifiable": 170,
    "dapo-verifiable-long": 350,
}

TINY_DATA = ["--n-sft", "2000", "--n-pairs", "400", "--n-prompts", "200", "--n-val", "64", "--n-test", "64"]
TINY_STEPS = 6  # optimizer steps of offline stages with --tiny
TINY_ROLLOUTS = 2  # rollouts of online stages with --tiny

# --- cells ----------------------------------------------------------------------------------------


def stage_cells(cells: Cells, steps: list[tuple], run, *, make: bool = True) -> dict:
    """Shared stages in order, one cell each (``shared-<name>``): ``steps`` is ``[(name, argv, output)]``
    (``output``: a file the stage writes, or None) and ``run(name, argv)`` runs one, returning its seconds.
    A stage's spec is its argv and the stamp of the stage before it, so a stage that runs again makes every
    later one run again (they start from its result). Returns ``{name: seconds, ..., "stamp": when the last
    stage ran}``; with ``make=False`` nothing runs and ``"left"`` lists the stages a run would run."""
    times: dict = {}
    stamp, left = None, []
    for name, argv, output in steps:
        key, spec = f"shared-{name}", {"argv": argv, "after": stamp}
        if not make:
            there = output is None or Path(output).exists()
            record = cells.get(key, spec) if there and not left else None
            if record is None:
                left.append(name)
                continue
        else:
            record = cells.run(
                key,
                lambda n=name, a=argv: {"s": run(n, a), "stamp": time.time()},
                spec,
                valid=lambda _, o=output: o is None or Path(o).exists(),
            )
        times[name], stamp = record["s"], record["stamp"]
    times["stamp"] = stamp
    return times if make else {**times, "left": left}


# --- configs --------------------------------------------------------------------------------------


def out_prefix(configs: Path) -> str:
    """Where the configs write (``out/paper``): the parent of the SFT config's export directory."""
    export = get_key(read_config("sft", configs), "model.init_args.export_dir")
    if not export:
        raise SystemExit(f"bench_quality: the sft run of {configs} has no model.init_args.export_dir")
    return str(Path(export).parent)


def settings_of(method: Method, configs: Path) -> list[dict]:
    """The method's grid as a list of ``{key under model.init_args: value}`` (an LR grid resolved
    against the config's own learning rate)."""
    grid = GRIDS.get(method.name, [{}])
    if isinstance(grid, tuple):
        key, factors = grid
        base = get_key(read_config(method.config, configs), f"model.init_args.{key}")
        if base is None:
            raise SystemExit(f"bench_quality: {method.config}.yaml sets no model.init_args.{key} to scale")
        return [{key: float(f"{float(base) * f:.3g}")} for f in factors]
    return [dict(s) for s in grid]


def slug(setting: dict) -> str:
    """A directory name for a setting: ``loss_args.beta=0.1``, or ``default``."""
    if not setting:
        return "default"

    def flat(prefix, value):
        if isinstance(value, dict):
            return [kv for k, v in value.items() for kv in flat(f"{prefix}.{k}", v)]
        return [f"{prefix}={value:g}" if isinstance(value, float) else f"{prefix}={value}"]

    return ",".join(kv for k, v in setting.items() for kv in flat(k, v)).replace("/", "_")


def config_key(key: str) -> str:
    """Where a setting's key lives in the config: ``trainer.*`` and ``data.*`` as they are (e.g. the number
    of rollouts, ``trainer.limit_train_batches``), anything else under ``model.init_args``."""
    return key if key.startswith(("trainer.", "data.")) else f"model.init_args.{key}"


def setting_overrides(setting: dict) -> list[str]:
    return [f"--{config_key(k)}={v if isinstance(v, str) else json.dumps(v)}" for k, v in setting.items()]


def run_overrides(config: dict, *, seed: int, tiny: bool) -> list[str]:
    """Overrides every benchmark run gets: its seed, no checkpoints (a run is redone, not resumed), no
    progress bar (the log goes to a file); with ``tiny``, a few steps or rollouts.

    The seed reaches what ``seed_everything`` does not: the data order (``data.init_args.seed``) and an
    online stage's rollout sampling (``rollout.seed``). Both default to 0, so before they were set here the
    seeds of a stage that adds no new weights (DPO and the online stages from SFT) trained the same run and
    differed only in the evaluation's sampling seed. Seed 0 is the run it was."""
    trainer = config.get("trainer") or {}
    kept = [c for c in trainer.get("callbacks") or [] if "ModelCheckpoint" not in str(c.get("class_path"))]
    online = "PromptDataModule" in str(get_key(config, "data.class_path"))
    out = [
        f"--seed_everything={seed}",
        f"--data.init_args.seed={seed}",
        *([f"--model.init_args.rollout.seed={seed}"] if online else []),
        "--trainer.enable_checkpointing=false",
        f"--trainer.callbacks={json.dumps(kept)}",
        "--trainer.enable_progress_bar=false",
    ]
    if tiny:
        if "max_steps" in trainer:
            out += [f"--trainer.max_steps={TINY_STEPS}", f"--trainer.val_check_interval={TINY_STEPS}"]
        else:
            # validation once, at the end of the (possibly shorter than asked) epoch
            out += [
                f"--trainer.limit_train_batches={TINY_ROLLOUTS if online else TINY_STEPS}",
                "--trainer.val_check_interval=1.0",
            ]
            if online:
                out += ["--trainer.limit_val_batches=1"]
    return out


def fit_command(config_name: str, configs: Path, *, seed: int, tiny: bool) -> list[str]:
    """``alignlit fit`` of one benchmark run of a config (its stack under ``configs``, :func:`run_overrides`)."""
    return [
        "fit",
        *config_args(config_name, configs),
        *run_overrides(read_config(config_name, configs), seed=seed, tiny=tiny),
    ]


# --- the plan -------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One unit of work: a training run (``what="fit"``) or an evaluation (``what="eval"``)."""

    method: str
    what: str
    setting: dict = field(default_factory=dict)
    seed: int = 0
    split: str = "val"

    @property
    def key(self) -> str:
        return f"{self.method}/{slug(self.setting)}/seed{self.seed}" + (
            f"/{self.split}" if self.what == "eval" else ""
        )


def plan(methods: list[Method], configs: Path, seeds: list[int], grid_limit: int | None) -> dict:
    """Every cell of the benchmark, in run order, and the rows without a config.

    For a trained method: each setting's fit with seed 0 and its evaluation on ``val``, then (once the
    setting is chosen) fits with the other seeds and evaluations of every seed on ``test``. The test
    cells are planned with the placeholder setting ``{"chosen": ...}`` because the choice depends on the
    validation results.
    """
    cells: list[Cell] = []
    missing: dict[str, str] = {}
    for m in methods:
        if m.kind in ("sft", "best_of"):
            cells += [Cell(m.name, "eval", seed=s, split="test") for s in seeds]
            continue
        try:
            config_stack(m.config, configs)
        except FileNotFoundError:
            path = configs / f"{m.config}.yaml"
            missing[m.name] = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
            continue
        settings = settings_of(m, configs)[:grid_limit]
        for s in settings:
            cells += [Cell(m.name, "fit", s, 0), Cell(m.name, "eval", s, 0, "val")]
        chosen = {"chosen": "on-val"}
        cells += [Cell(m.name, "fit", chosen, s) for s in seeds if s != 0]
        cells += [Cell(m.name, "eval", chosen, s, "test") for s in seeds]
    return {"cells": cells, "missing": missing}


def estimate(cell: Cell, measured: dict[str, list[float]], scale: float) -> float:
    kind = cell.method if cell.what == "fit" else ("eval-best-of" if cell.method.startswith("bo") else "eval")
    if measured.get(kind):
        return statistics.mean(measured[kind])
    return ESTIMATE_S.get(kind, 200) * scale


# --- running --------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args, methods: list[Method]):
        self.args = args
        self.methods = {m.name: m for m in methods}
        self.configs = Path(args.configs).resolve()
        self.prefix = out_prefix(self.configs)
        self.work = Path(args.work).resolve()
        self.root = self.work / "root"  # the shared stages run here, as in a checkout
        self.measured: dict[str, list[float]] = {}
        self.failed: dict[str, str] = {}
        self.shared_stamp: float | None = None  # when the shared stages last changed
        self.scale = 0.1 if args.tiny else (0.35 if self.configs.name == "quickstart" else 1.0)
        self.suite = SUITES[args.suite]
        self.cells = Cells(self.work)  # every fit and evaluation, read back while its spec is unchanged

    # shared stages: data, SFT, reward model, ranked samples

    def shared_steps(self) -> list[tuple]:
        """The suite's shared stages in order: ``(name, alignlit argv, the file it writes)``."""
        out = self.root / self.prefix
        sim = self.root / "data" / "sim"
        steps = [
            (
                "make-data",
                ["sim", "make-data", "--out", "data/sim", *(TINY_DATA if self.args.tiny else [])],
                sim / "manifest.json",
            ),
            ("sft", self.fit_args("sft.yaml", 0), out / "sft" / "alignlit.json"),
            ("reward", self.fit_args("reward.yaml", 0), out / "reward" / "alignlit.json"),
            (
                "samples",
                self.sample_args("samples", f"{self.prefix}/reward", rft=True),
                out / "samples" / "rft.jsonl",
            ),
        ]
        return [step for step in steps if step[0] in self.suite.shared]

    def shared_left(self) -> list[str]:
        """The shared stages a run would run (their cells are missing or stale)."""
        return stage_cells(self.cells, self.shared_steps(), None, make=False)["left"]

    def shared(self) -> dict:
        """The shared stages, one cell each (:func:`stage_cells`); returns their wall times and ``stamp``."""

        def run(name: str, argv: list[str]) -> float:
            print(f"bench_quality: shared stage {name}: alignlit {' '.join(argv)}", flush=True)
            elapsed = run_alignlit(name, argv, self.root, self.work / "logs" / f"{name}.log")
            self.measured.setdefault(name, []).append(elapsed)
            print(f"bench_quality: shared stage {name}: {elapsed:.0f} s", flush=True)
            return elapsed

        self.root.mkdir(parents=True, exist_ok=True)
        times = stage_cells(self.cells, self.shared_steps(), run)
        self.shared_stamp = times["stamp"]  # the SFT policy and reward model the cells were evaluated with
        return times

    def sample_args(self, name: str, scorer: str, *, rft: bool = False, sim: bool = False) -> list[str]:
        """``alignlit sample`` of 4 SFT samples per training prompt (seed 0), ranked by ``scorer``, into
        ``<prefix>/<name>/{ranked,pairs[,rft]}.jsonl`` (``sim``: the ``--sim`` a gold scorer needs)."""
        out = f"{self.prefix}/{name}"
        return [
            "sample", "--policy", f"{self.prefix}/sft", "--prompts", "data/sim/prompts_train.jsonl", "--n", "4",
            "--scorer", scorer, *(["--sim", "data/sim"] if sim else []),
            "--out", f"{out}/ranked.jsonl", "--pairs", f"{out}/pairs.jsonl", *(["--rft", f"{out}/rft.jsonl"] if rft else []),
            "--batch-size", "128", "--no-progress",
            *(["--max-prompts", str(self.args.sample_prompts)] if self.args.sample_prompts else []),
        ]  # fmt: skip

    def fit_args(self, config_name: str, seed: int, setting: dict | None = None) -> list[str]:
        if self.args.tiny:  # --tiny sets the trainer's length itself
            setting = {k: v for k, v in (setting or {}).items() if not k.startswith("trainer.")}
        return [
            *fit_command(config_name, self.configs, seed=seed, tiny=self.args.tiny),
            *setting_overrides(setting or {}),
        ]

    # one method's runs

    def own_setting(self, method: str, setting: dict) -> dict:
        """The part of ``setting`` that changes the method's config: entries equal to the config's own
        value are dropped, so the grid point at the config's own setting is the same run (same command
        line, same directory) as the config run without overrides, and is trained once."""
        m = self.methods[method]
        if not setting or m.config is None:
            return setting
        config = read_config(m.config, self.configs)
        return {k: v for k, v in setting.items() if get_key(config, config_key(k)) != v}

    def run_dir(self, method: str, setting: dict, seed: int) -> Path:
        return self.work / "runs" / method / slug(self.own_setting(method, setting)) / f"seed{seed}"

    def prepare_run_dir(self, path: Path) -> None:
        """A run's directory looks like a checkout after the shared stages: ``data`` and the shared
        exports are links into the shared root; the run's own outputs stay in it."""
        (path / self.prefix).mkdir(parents=True, exist_ok=True)
        links = {path / "data": self.root / "data"}
        stages = [d for d in ("sft", "reward", "samples") if d in self.suite.shared]
        links.update({path / self.prefix / d: self.root / self.prefix / d for d in stages})
        for link, target in links.items():
            if not link.is_symlink():
                link.symlink_to(target, target_is_directory=True)

    def cell_key(self, what: str, method: str, setting: dict, seed: int) -> str:
        """A cell's key: ``<what>-`` and its run directory under ``runs/`` (``fit-dpo-default-seed0``)."""
        return f"{what}-" + "-".join(
            self.run_dir(method, setting, seed).relative_to(self.work / "runs").parts
        )

    def fit(self, method: Method, setting: dict, seed: int) -> tuple[Path, dict]:
        """A training cell: one run, read back while its command line, config text and shared stages are
        unchanged and its export is there; returns its export directory and its record (``fit_s``,
        ``argv``, ``config_sha256``, ``shared_stamp``, ``stamp``: when it finished)."""
        export = get_key(read_config(method.config, self.configs), "model.init_args.export_dir")
        path = self.run_dir(method.name, setting, seed)
        argv = self.fit_args(method.config, seed, self.own_setting(method.name, setting))
        sha = config_sha256(method.config, self.configs)
        same = {"argv": argv, "config_sha256": sha, "shared_stamp": self.shared_stamp}

        def train() -> dict:
            self.prepare_run_dir(path)
            elapsed = run_alignlit(f"{method.name} {slug(setting)} seed {seed}", argv, path, path / "fit.log")
            self.measured.setdefault(method.name, []).append(elapsed)
            return {"fit_s": elapsed, **same, "stamp": time.time()}

        key = self.cell_key("fit", method.name, setting, seed)
        done = self.cells.run(key, train, same, valid=lambda _: (path / export / "alignlit.json").exists())
        return path / export, done

    # evaluation

    def prompts(self, split: str) -> list[str]:
        from alignlit.data import parse_prompt, read_records

        count = self.args.val_prompts if split == "val" else self.args.test_prompts
        records = read_records(self.root / "data" / "sim" / f"prompts_{split}.jsonl")
        return [parse_prompt(r) for r in records][:count]

    def evaluate(
        self, method: Method, setting: dict, seed: int, split: str, policy_dir: Path | None, stamp: float
    ) -> dict:
        """An evaluation cell, read back for the same policy (``stamp``: when the policy's run finished),
        prompts and sampling; returns its record."""
        prompts = self.prompts(split)
        spec = {"stamp": stamp, "prompts": len(prompts), "max_new_tokens": self.args.max_new_tokens}
        key = f"{self.cell_key('eval', method.name, setting, seed)}-{split}"
        return self.cells.run(
            key, lambda: self.evaluation(method, setting, seed, split, policy_dir, stamp), spec
        )

    def evaluation(
        self, method: Method, setting: dict, seed: int, split: str, policy_dir: Path | None, stamp: float
    ) -> dict:
        """What :meth:`evaluate` computes: gold, KL to SFT and length on the split's prompts."""
        from alignlit.eval.gold import best_of_n, evaluate_policy
        from alignlit.eval.score import rm_selector
        from alignlit.models import load_policy
        from alignlit.rollout import SamplingParams
        from alignlit.sim import load_sim

        prompts = self.prompts(split)
        task, _ = load_sim(self.root / "data" / "sim")
        sampling = SamplingParams(temperature=1.0, max_new_tokens=self.args.max_new_tokens, seed=seed)
        sft_dir = self.root / self.prefix / "sft"
        sft, tokenizer = load_policy(sft_dir)
        sft.eval()
        common = dict(sampling=sampling, batch_size=self.args.batch_size, name=method.label)
        start = time.perf_counter()
        if method.kind == "best_of":
            select = (
                None if method.selector == "gold" else rm_selector(str(self.root / self.prefix / "reward"))
            )
            result = best_of_n(
                sft, tokenizer, prompts, task.gold_rewards, n=method.n, select_fn=select, **common
            )
        else:
            policy, policy_tokenizer = (sft, tokenizer) if policy_dir is None else load_policy(policy_dir)
            policy.eval()
            result = evaluate_policy(
                policy, policy_tokenizer, prompts, task.gold_rewards, reference=sft, **common
            )
        eval_s = time.perf_counter() - start
        self.measured.setdefault("eval-best-of" if method.kind == "best_of" else "eval", []).append(eval_s)
        record = {
            "method": method.name,
            "setting": setting,
            "seed": seed,
            "split": split,
            "prompts": len(prompts),
            **result.as_dict(),
            "prompt_gold": result.prompt_gold,
            "eval_s": eval_s,
            "stamp": stamp,
        }
        return record

    # the whole benchmark

    def chosen_setting(self, method: Method) -> tuple[dict, list[dict]]:
        """The setting :func:`choose` picks from the validation records, and every validation record."""
        records = []
        for s in settings_of(method, self.configs)[: self.args.grid_limit]:
            export, run = self.fit(method, s, 0)
            records.append(self.evaluate(method, s, 0, "val", export, run["stamp"]))
        budget = self.args.max_val_kl if method.max_val_kl is None else method.max_val_kl
        return choose(records, budget)["setting"], records

    def print_eta(self, cells: list[Cell], done: int) -> None:
        left = sum(estimate(c, self.measured, self.scale) for c in cells[done:])
        print(f"bench_quality: {done}/{len(cells)} cells done; ETA {fmt_s(left)}", flush=True)


def choose(records: list[dict], max_kl: float | None = None) -> dict:
    """The validation record with the highest mean gold; with ``max_kl``, among the records whose KL to
    SFT is at most ``max_kl`` (when none is, the one with the lowest KL)."""
    if max_kl is not None:
        within = [r for r in records if r["kl_to_reference"] is not None and r["kl_to_reference"] <= max_kl]
        if not within:
            return min(records, key=lambda r: r["kl_to_reference"])
        records = within
    return max(records, key=lambda r: r["gold"])


def pass_rate(prompt_gold: list[float]) -> float:
    """Share of the (one-sample) responses with gold reward 1: the responses the strict answer check
    (``alignlit.rewards.SimVerifier``) accepts, since it accepts exactly those."""
    return sum(g >= 1.0 - 1e-9 for g in prompt_gold) / len(prompt_gold)


def aggregate(rows: list[dict], sft_by_seed: dict[int, list[float]]) -> dict:
    """Mean and std over seeds of one method's test records, with the win rate against SFT."""
    from alignlit.eval.gold import win_rate

    wins = [win_rate(r["prompt_gold"], sft_by_seed[r["seed"]]) for r in rows if r["seed"] in sft_by_seed]
    out = {"seeds": [r["seed"] for r in rows]}
    for key, values in (
        ("gold", [r["gold"] for r in rows]),
        ("pass_rate", [pass_rate(r["prompt_gold"]) for r in rows]),
        ("win_vs_sft", wins),
        ("kl_to_sft", [r["kl_to_reference"] for r in rows]),
        ("length", [r["length"] for r in rows]),
        ("wall_s", [r.get("wall_s") for r in rows]),
    ):
        out[key], out[f"{key}_std"] = mean_std(values)
    return out


def table_head(*columns: tuple[str, str] | None) -> list[str]:
    """The header and alignment rows of a markdown table of ``(name, alignment)`` columns (None: left out)."""
    kept = [c for c in columns if c is not None]
    return [
        "| " + " | ".join(name for name, _ in kept) + " |",
        "|" + "".join(f"{align}|" for _, align in kept),
    ]


def format_table(table: list[dict], with_pass_rate: bool = False) -> str:
    """The markdown table; ``with_pass_rate``: a column with the share of responses the strict answer
    check accepts (:func:`pass_rate`)."""
    passed = ("answer check pass rate", "---:") if with_pass_rate else None
    lines = table_head(
        ("method", "---"), ("setting", "---"), ("gold reward", "---:"), passed, ("win rate vs SFT", "---:"),
        ("KL to SFT", "---:"), ("length (tokens)", "---:"), ("wall time (s)", "---:"), ("seeds", "---:"),
    )  # fmt: skip
    for r in table:
        if r.get("status"):
            lines.append(
                f"| {r['label']} | {r['status']} |  |  |  |  |  |  |" + ("  |" if with_pass_rate else "")
            )
            continue
        lines.append(
            f"| {r['label']} | {r['setting']} | {pm(r['gold'], r['gold_std'])} | "
            + (f"{pm(r['pass_rate'], r['pass_rate_std'])} | " if with_pass_rate else "")
            + f"{pm(r['win_vs_sft'], r['win_vs_sft_std'])} | {pm(r['kl_to_sft'], r['kl_to_sft_std'], 2)} | "
            f"{pm(r['length'], r['length_std'], 1)} | {pm(r['wall_s'], r['wall_s_std'], 0)} | {len(r['seeds'])} |"
        )
    return "\n".join(lines)


def format_selection(records: list[dict], with_pass_rate: bool = False) -> str:
    passed = ("pass rate", "---:") if with_pass_rate else None
    lines = table_head(
        ("method", "---"), ("setting", "---"), ("val gold", "---:"), ("± s.e.", "---:"), passed,
        ("KL to SFT", "---:"), ("length", "---:"), ("chosen", ":-:"),
    )  # fmt: skip
    for r in records:
        kl = "" if r["kl_to_reference"] is None else f"{r['kl_to_reference']:.2f}"
        passed = f"{pass_rate(r['prompt_gold']):.3f} | " if with_pass_rate else ""
        lines.append(
            f"| {r['method']} | {slug(r['setting'])} | {r['gold']:.3f} | {r['gold_stderr']:.3f} | {passed}{kl} | "
            f"{r['length']:.1f} | {'✓' if r.get('chosen') else ''} |"
        )
    return "\n".join(lines)


def frontier(table: list[dict]) -> list[dict]:
    points = []
    for r in table:
        if r.get("status") or r["kl_to_sft"] is None:
            continue
        series = []
        if r["name"] == "sft":
            series = ["best-of-n (RM)", "best-of-n (gold)"]
        elif r["name"].startswith("bo"):
            series = ["best-of-n (RM)" if r["name"].endswith("-rm") else "best-of-n (gold)"]
        points.append(
            {
                "name": r["label"].split(",")[0] + (" (gold)" if r["name"].endswith("-gold") else ""),
                "kl": r["kl_to_sft"],
                "gold": r["gold"],
                "kl_err": r["kl_to_sft_std"],
                "gold_err": r["gold_std"],
                "series": series,
            }
        )
    return points


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """``bench_quality.py``'s arguments (what :class:`Bench` reads)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--configs", default=None, help="config directory (default: configs/paper; --tiny: quickstart)"
    )
    p.add_argument(
        "--suite",
        default="quality",
        choices=sorted(SUITES),
        help="which table: 'quality' (every method, reward model) or 'verifiable' (RLVR against the answer "
        "check); its rows, shared stages and result file names",
    )
    p.add_argument(
        "--methods",
        nargs="*",
        default=None,
        choices=[m.name for m in METHODS],
        help="rows to run (default: the suite's)",
    )
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2], help="seeds of the reported runs")
    p.add_argument("--grid-limit", type=int, default=None, help="use only the first N settings of each grid")
    p.add_argument(
        "--no-grid",
        action="store_true",
        help="no selection: every method runs its config's own setting (reported as 'default')",
    )
    p.add_argument("--val-prompts", type=int, default=200, help="prompts_val prompts for the selection")
    p.add_argument(
        "--max-val-kl",
        type=float,
        default=None,
        help="choose among the settings whose validation KL to SFT is at most this (default: no limit)",
    )
    p.add_argument("--test-prompts", type=int, default=500, help="prompts_test prompts for the report")
    p.add_argument(
        "--sample-prompts", type=int, default=None, help="training prompts sampled for the offline data"
    )
    p.add_argument("--max-new-tokens", type=int, default=24, help="response token limit (default: 24)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per generate call")
    p.add_argument("--work", default=None, help="runs and cell results (default: out/bench_<suite>[_tiny])")
    p.add_argument(
        "--results", default=None, help="table, JSON, plot (default: benchmarks/results; --tiny: WORK)"
    )
    p.add_argument("--tiny", action="store_true", help="toy sizes: checks the whole pipeline in minutes")
    p.add_argument("--plan", action="store_true", help="print the planned cells and the ETA, run nothing")
    return p
