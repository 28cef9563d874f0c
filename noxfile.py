"""Sessions: tests, slow, lint, quickstart, vllm, bench. Every session pins torch==2.13.0 first (see README)."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"
ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def install(session: nox.Session, extras: str = "dev") -> None:
    # torch first: an unpinned torch pulled in by a dependency would bring several GB of CUDA wheels
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules (pyflakes, bugbear, ...) and formatting."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and integration tests (everything but the `slow` and `vllm` marks)."""
    install(session)
    session.run("pytest", "-m", "not slow and not vllm", *session.posargs, env=ENV)


@nox.session
def slow(session: nox.Session) -> None:
    """End-to-end runs of the shipped configs and CLI pipelines at reduced size."""
    install(session)
    session.run("pytest", "-m", "slow", *session.posargs, env=ENV)


@nox.session
def vllm(session: nox.Session) -> None:
    """vLLM-on-CPU integration: engine start, generation, weight sync, log-prob parity (+ PPO on vLLM)."""
    install(session)
    session.run("bash", ".ci/install-vllm.sh", os.path.join(session.bin, "python"), external=True)
    # ALIGNLIT_REQUIRE_VLLM turns the "vllm not installed" skip into an error: this session cannot pass
    # by skipping everything
    env = {**ENV, "ALIGNLIT_REQUIRE_VLLM": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    session.run("pytest", "-m", "vllm", *session.posargs, env=env)


QUICKSTART = [
    ["alignlit", "sim", "make-data", "--out", "data/sim"],
    ["alignlit", "fit", "--config", "configs/quickstart/sft.yaml"],
    ["alignlit", "fit", "--config", "configs/quickstart/reward.yaml"],
    [
        "alignlit",
        "sample",
        "--policy",
        "out/quickstart/sft",
        "--prompts",
        "data/sim/prompts_train.jsonl",
        "--n",
        "4",
        "--scorer",
        "out/quickstart/reward",
        "--out",
        "out/quickstart/samples/ranked.jsonl",
        "--pairs",
        "out/quickstart/samples/pairs.jsonl",
        "--batch-size",
        "128",
    ],
    ["alignlit", "fit", "--config", "configs/quickstart/dpo.yaml"],
    ["alignlit", "fit", "--config", "configs/quickstart/ppo.yaml"],
    [
        "alignlit",
        "eval",
        "--sim",
        "data/sim",
        "--untrained",
        "data/sim/tokenizer",
        "--policy",
        "out/quickstart/sft",
        "out/quickstart/dpo",
        "out/quickstart/ppo",
        "--name",
        "SFT",
        "DPO",
        "PPO",
        "--reference",
        "out/quickstart/sft",
        "--json",
        "out/quickstart/eval.json",
    ],
]


@nox.session
def quickstart(session: nox.Session) -> None:
    """The README pipeline on the simulated task, ending with the gold-reward table."""
    install(session)
    for cmd in QUICKSTART:
        session.run(*cmd, env=ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: each prints a table and writes JSON under benchmarks/results/."""
    install(session)
    scripts = session.posargs or sorted(
        f"benchmarks/{f}" for f in os.listdir("benchmarks") if f.startswith("bench_") and f.endswith(".py")
    )
    for script in scripts:
        session.run("python", script, env=ENV)
