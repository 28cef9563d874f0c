"""Sessions: tests, slow, lint, quickstart, vllm, bench. Every session pins torch==2.13.0 first (see README).

Virtual environments are made with uv when it is installed (``python3 -m pip install nox uv``), else
with venv and pip. uv reads neither pip's configuration nor its wheel folders, so torch is installed
by uv from the wheel folders pip is configured with (``find-links``, e.g. a machine's local CPU wheel),
or else from the PyTorch CPU index: never the several-GB CUDA build PyPI would give.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "uv|venv"

TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# PYTHONDONTWRITEBYTECODE is emptied (Python reads "" as unset): where the machine sets it, as CI's does, no
# .pyc was ever written (uv installs none either), so every process the tests start (each `alignlit`
# subprocess, spawn worker, torchrun rank and vLLM engine) compiled torch, transformers and Lightning from
# source again: `alignlit fit --help` took 21 CPU-s that way, 8 with the bytecode written once.
ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "",
}


def pip_find_links() -> list[str]:
    """The ``find-links`` locations pip is configured with (``PIP_FIND_LINKS``, pip.conf), which uv ignores."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    links: list[str] = []
    for line in res.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [v for v in value.strip().strip("'\"").split() if v not in links]
    return links


def install_torch(session: nox.Session) -> None:
    """torch==2.13.0 first: an unpinned torch pulled in by a dependency would bring several GB of CUDA
    wheels. With uv, from pip's find-links folders if any (where a local CPU wheel lies), else the CPU index."""
    if session.venv_backend != "uv":
        session.install(TORCH)
        return
    links = pip_find_links()
    source = [f"--find-links={link}" for link in links] if links else [f"--extra-index-url={TORCH_CPU_INDEX}"]
    session.install(TORCH, *source)
    version = session.run_install("python", "-c", "import torch; print(torch.__version__)", silent=True)
    if "+cpu" not in str(version) and not os.environ.get("ALIGNLIT_ALLOW_CUDA_TORCH"):
        session.error(
            f"uv installed torch {str(version).strip()}, not the CPU build (set ALIGNLIT_ALLOW_CUDA_TORCH=1 to keep it)"
        )


def install(session: nox.Session, extras: str = "dev") -> None:
    install_torch(session)
    session.install("-e", f".[{extras}]")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint rules and formatting) and import-linter (the layers contract in pyproject.toml)."""
    # the package without its dependencies: import-linter reads the source, it does not run it
    session.install("ruff==0.17.6", "import-linter>=2.1")  # pinned: a new ruff release reformats
    session.install("--no-deps", "-e", ".")
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("lint-imports", "--no-cache")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and integration tests (everything but the `slow` and `vllm` marks)."""
    install(session)
    session.run("pytest", "-m", "not slow and not vllm", "--durations=15", *session.posargs, env=ENV)


@nox.session
def slow(session: nox.Session) -> None:
    """End-to-end runs of the shipped configs and CLI pipelines at reduced size."""
    install(session)
    session.run("pytest", "-m", "slow", "--durations=15", *session.posargs, env=ENV)


@nox.session
def vllm(session: nox.Session) -> None:
    """vLLM-on-CPU integration: engine start, generation, weight sync, log-prob parity (+ PPO on vLLM)."""
    install(session)
    env = dict(ENV)
    if session.venv_backend == "uv":  # the script installs with uv: tell it which uv and pip's find-links
        from nox.virtualenv import find_uv

        env["ALIGNLIT_UV"] = find_uv()[1]
        if links := pip_find_links():
            env["UV_FIND_LINKS"] = ",".join(links)
    session.run("bash", ".ci/install-vllm.sh", os.path.join(session.bin, "python"), external=True, env=env)
    # ALIGNLIT_REQUIRE_VLLM turns the "vllm not installed" skip into an error: this session cannot pass
    # by skipping everything
    env = {**ENV, "ALIGNLIT_REQUIRE_VLLM": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    session.run("pytest", "-m", "vllm", "--durations=15", *session.posargs, env=env)


# The online stage of the quickstart, (config name, row name in the table): any online config under
# configs/quickstart/ whose export is out/quickstart/<config name> fits this slot (online-dpo,
# online-rrhf, grpo, rloo).
QUICKSTART_ONLINE = ("online-dpo", "online DPO")
# The RLVR stage: GRPO against the rule-based answer check (alignlit.rewards.SimVerifier), no reward model:
# (run name, row name, its config stack: the GRPO stage and its verifiable-reward overlay).
QUICKSTART_VERIFIABLE = (
    "grpo-verifiable",
    "GRPO (verifier)",
    ["--config", "configs/quickstart/grpo.yaml", "--config", "configs/verifiable/grpo.yaml"],
)

# (title, command, what it writes): the README's quickstart, run in order by `nox -s quickstart`.
QUICKSTART: list[tuple[str, list[str], list[str]]] = [
    (
        "simulated task: data and tokenizer",
        ["alignlit", "sim", "make-data", "--out", "data/sim"],
        ["data/sim/"],
    ),
    (
        "SFT from scratch",
        ["alignlit", "fit", "--config", "configs/quickstart/sft.yaml"],
        ["out/quickstart/sft/", "out/quickstart/logs/sft/"],
    ),
    (
        "reward model on the annotators' pairs",
        ["alignlit", "fit", "--config", "configs/quickstart/reward.yaml"],
        ["out/quickstart/reward/", "out/quickstart/logs/reward/"],
    ),
    (
        "samples of the SFT policy ranked by the reward model",
        [
            "alignlit",
            "sample",
            "--policy",
            "out/quickstart/sft",
            "--prompts",
            "data/sim/prompts_train.jsonl",
            "--max-prompts",
            "1500",
            "--n",
            "4",
            "--scorer",
            "out/quickstart/reward",
            "--out",
            "out/quickstart/samples/ranked.jsonl",
            "--pairs",
            "out/quickstart/samples/pairs.jsonl",
            "--rft",
            "out/quickstart/samples/rft.jsonl",
            "--batch-size",
            "128",
        ],
        [
            "out/quickstart/samples/ranked.jsonl",
            "out/quickstart/samples/pairs.jsonl",
            "out/quickstart/samples/rft.jsonl",
        ],
    ),
    (
        "DPO on best-vs-worst pairs",
        ["alignlit", "fit", "--config", "configs/quickstart/dpo.yaml"],
        ["out/quickstart/dpo/", "out/quickstart/logs/dpo/"],
    ),
    (
        "PPO-max against the reward model",
        ["alignlit", "fit", "--config", "configs/quickstart/ppo.yaml"],
        ["out/quickstart/ppo/", "out/quickstart/logs/ppo/"],
    ),
    (
        f"online stage: {QUICKSTART_ONLINE[1]}",
        ["alignlit", "fit", "--config", f"configs/quickstart/{QUICKSTART_ONLINE[0]}.yaml"],
        [f"out/quickstart/{QUICKSTART_ONLINE[0]}/", f"out/quickstart/logs/{QUICKSTART_ONLINE[0]}/"],
    ),
    (
        "RLVR: GRPO against the answer verifier",
        ["alignlit", "fit", *QUICKSTART_VERIFIABLE[2]],
        [f"out/quickstart/{QUICKSTART_VERIFIABLE[0]}/", f"out/quickstart/logs/{QUICKSTART_VERIFIABLE[0]}/"],
    ),
    (
        "held-out gold reward of every policy, and the gold-vs-KL plot",
        [
            "alignlit",
            "eval",
            "--sim",
            "data/sim",
            "--policy",
            "out/quickstart/sft",
            "out/quickstart/dpo",
            "out/quickstart/ppo",
            f"out/quickstart/{QUICKSTART_ONLINE[0]}",
            f"out/quickstart/{QUICKSTART_VERIFIABLE[0]}",
            "--name",
            "SFT",
            "DPO",
            "PPO",
            QUICKSTART_ONLINE[1],
            QUICKSTART_VERIFIABLE[1],
            "--reference",
            "out/quickstart/sft",
            "--best-of",
            "4",
            "--best-of-for",
            "SFT",
            "--select",
            "out/quickstart/reward",
            "gold",
            "--n-prompts",
            "300",
            "--json",
            "out/quickstart/eval.json",
            "--plot",
            "out/quickstart/frontier.png",
        ],
        ["out/quickstart/eval.json", "out/quickstart/frontier.png"],
    ),
]


@nox.session
def quickstart(session: nox.Session) -> None:
    """The README pipeline on the simulated task (~10 min on 2 idle CPU cores): data, SFT, reward model,
    samples, DPO, PPO, an online stage, GRPO against the answer verifier, then the gold-reward table and
    the gold-vs-KL plot."""
    install(session)
    times = []
    for i, (title, cmd, writes) in enumerate(QUICKSTART, 1):
        session.log(f"[{i}/{len(QUICKSTART)}] {title}: {' '.join(cmd)}")
        start = time.perf_counter()
        session.run(*cmd, env=ENV)
        times.append((title, time.perf_counter() - start))
        session.log(f"[{i}/{len(QUICKSTART)}] {title}: {times[-1][1]:.0f} s -> {', '.join(writes)}")
    session.log("stage times: " + "; ".join(f"{title} {t:.0f} s" for title, t in times))
    session.log(
        f"total {sum(t for _, t in times) / 60:.1f} min; the table is above, the plot in {QUICKSTART[-1][2][-1]}"
    )


def bench_harness():
    """benchmarks/harness/ (standard library only at import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_harness", "benchmarks/harness/__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@nox.session
def bench(session: nox.Session) -> None:
    """One committed result again: `nox -s bench -- NAME` runs the command benchmarks/results/NAME.json (or
    NAME.md) names; `nox -s bench` lists every NAME and its command (some need hours, the paper-scale
    models, shared data or vLLM: see the README's table). A path `benchmarks/bench_x.py` runs that script."""
    harness = bench_harness()
    if not session.posargs:
        for name in harness.result_names():
            session.log(f"{name}: {harness.result_command(name)}")
        return
    install(session)
    session.install("trl==1.16.0")  # benchmarks/bench_vs_trl.py runs TRL's trainers beside alignlit's
    for name in session.posargs:
        if name.endswith(".py"):
            session.run("python", name, env=ENV)
        else:  # `&&`-joined steps run in order, with the session's python first on PATH
            session.run("bash", "-c", harness.result_command(name), env=ENV, external=True)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: `mkdocs build --strict` (broken links, anchors and API objects fail), the
    Python and shell blocks of docs/ and README.md that are to run, run (tests/docs; the others are parsed
    in the tests session), and the built site loaded in headless Chromium (/usr/bin/chromium, Debian's
    package; `.ci/run` installs it)."""
    install(session, extras="dev,docs")
    env = {**ENV, "NO_MKDOCS_2_WARNING": "1"}
    start = time.perf_counter()
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", env=env)
    session.log(f"mkdocs build --strict: {time.perf_counter() - start:.0f} s")
    env = {**env, "ALIGNLIT_DOCS_RUN": "1", "ALIGNLIT_DOCS_SITE": "site"}
    # the blocks' execution and the browser (the marker and parse checks run in the tests session)
    session.run("pytest", "tests/docs", "-m", "docs", "--durations=10", *session.posargs, env=env)
