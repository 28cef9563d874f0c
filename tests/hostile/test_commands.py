"""Hostile inputs through the ``alignlit`` commands, run in-process with ``alignlit.cli.main``.

Each case gives a command line and the exact outcome: the exception class, or ``SystemExit`` with its
exit status, and a pattern that the message must match. The pattern always names what is wrong and
where (the file, the field or the argument), so an error that says only "invalid" fails the case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from alignlit.callbacks import DivergenceError
from alignlit.checkpoint_io import CheckpointError
from alignlit.cli import main
from alignlit.models import ExportDirError, NotARewardModelError, export_pretrained, load_scalar_model
from tests.helpers import write_jsonl

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIG = str(ROOT / "configs/quickstart/sft.yaml")
H, A = "\n\nHuman:", "\n\nAssistant:"


@dataclass
class Case:
    id: str
    argv: list[str]  # "{name}" is replaced by the path of fixture file ``name`` (see ``world``)
    raises: type[BaseException]
    match: str  # regex the message (exception text, or stderr for SystemExit) must match
    code: int | None = None  # the exit status, for SystemExit
    setup: str | None = None  # name of an extra preparation (see ``_prepare``)
    keep: list[str] = field(default_factory=list)  # files that must be unchanged afterwards


def _fit(*extra: str) -> list[str]:
    """The quickstart SFT config on the tiny test data, 2 steps, everything under the test's folder."""
    return [
        "fit",
        "--config",
        SFT_CONFIG,
        "--model.init_args.policy.init_args.tokenizer={tokenizer}",
        "--data.init_args.train_file={sft}",
        "--data.init_args.val_file={sft}",
        "--data.init_args.batch_size=4",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger.init_args.save_dir={tmp}/logs",
        "--trainer.callbacks=[]",
        "--trainer.enable_checkpointing=false",
        "--model.init_args.export_dir={tmp}/export",
        *extra,
    ]


CASES = [
    # ------------------------------------------------------------------ fit: values and configs
    Case(
        "fit-lr-not-a-number",
        _fit("--model.init_args.optim.lr=fast"),
        SystemExit,
        r"optim\.lr.*float|float.*fast",
        2,
    ),
    Case(
        "fit-lr-1e38",
        _fit("--model.init_args.optim.lr=1e38"),
        SystemExit,
        r"optim\.lr must be a finite number in \(0, 10\], got 1e\+38",
        2,
    ),
    Case(
        "fit-lr-negative",
        _fit("--model.init_args.optim.lr=-0.1"),
        SystemExit,
        r"optim\.lr must be a finite number in \(0, 10\], got -0\.1",
        2,
    ),
    Case(
        "fit-betas-out-of-range",
        _fit("--model.init_args.optim.betas=[0.9, 1.5]"),
        SystemExit,
        r"optim\.betas must be two numbers in \[0, 1\)",
        2,
    ),
    Case("fit-unknown-key", _fit("--model.init_args.learning_rate=0.1"), SystemExit, r"learning_rate", 2),
    Case("fit-missing-config", ["fit", "--config", "{tmp}/nope.yaml"], SystemExit, r"nope\.yaml", 2),
    Case(
        "fit-train-file-missing",
        _fit("--data.init_args.train_file={tmp}/missing.jsonl"),
        FileNotFoundError,
        r"missing\.jsonl",
    ),
    Case(
        "fit-divergence",
        _fit("--model.init_args.optim.lr=10", "--model.init_args.optim.warmup_steps=0"),
        DivergenceError,
        r"training diverged at global step 1: the trainable weights' norm",
    ),
    # ------------------------------------------------------------------ fit: where results and logs go
    Case(
        "fit-export-dir-empty-string",
        _fit("--model.init_args.export_dir="),
        ExportDirError,
        r"export_dir is '': give the directory",
    ),
    Case(
        "fit-export-dir-is-a-file",
        _fit("--model.init_args.export_dir={notes}"),
        ExportDirError,
        r"notes\.txt' is a file, not a directory",
        keep=["notes"],
    ),
    Case(
        "fit-export-dir-holds-user-files",
        _fit("--model.init_args.export_dir={userdir}"),
        ExportDirError,
        r"userdir' is a non-empty directory that is not an alignlit export",
        keep=["userfile"],
    ),
    Case(
        "fit-export-dir-read-only",
        _fit("--model.init_args.export_dir={readonly}/sft"),
        ExportDirError,
        r"readonly/sft': cannot write in .*readonly \(Read-only file system\)",
        setup="read_only_mount",
    ),
    Case(
        "fit-logger-false-without-root",
        _fit("--trainer.logger=false"),
        SystemExit,
        r"--trainer\.logger false needs --trainer\.default_root_dir",
        2,
    ),
    # ------------------------------------------------------------------ fit: resuming
    Case(
        "fit-ckpt-missing",
        _fit("--ckpt_path={tmp}/nope.ckpt"),
        SystemExit,
        r"--ckpt_path .*nope\.ckpt: no such checkpoint file",
        2,
    ),
    Case(
        "fit-ckpt-truncated",
        _fit("--ckpt_path={truncated}"),
        CheckpointError,
        r"checkpoint .*truncated\.ckpt \(\d+ bytes\) cannot be read: it is truncated",
    ),
    Case(
        "fit-ckpt-not-lightning",
        _fit("--ckpt_path={plain_pt}"),
        CheckpointError,
        r"weights\.pt is not a Lightning checkpoint",
    ),
    Case(
        "fit-ckpt-of-another-stage",
        _fit("--ckpt_path={reward_ckpt}"),
        CheckpointError,
        r"reward\.ckpt was written by alignlit\.modules\.reward\.RewardModule \(stage 'reward'\), but the model to resume is alignlit\.modules\.SFTModule",
    ),
    # ------------------------------------------------------------------ score
    Case(
        "score-policy-as-reward-model",
        ["score", "--model", "{policy}", "--input", "{records}", "--output", "{tmp}/o.jsonl"],
        NotARewardModelError,
        r"tiny is not a reward model: it is a LlamaForCausalLM",
    ),
    Case(
        "score-model-missing",
        ["score", "--model", "{tmp}/no_rm", "--pairs", "{pairs}"],
        FileNotFoundError,
        r"no_rm' is not a directory",
    ),
    Case(
        "score-input-missing",
        ["score", "--model", "{rm}", "--input", "{tmp}/none.jsonl", "--output", "{tmp}/o.jsonl"],
        FileNotFoundError,
        r"none\.jsonl",
    ),
    Case(
        "score-input-without-output",
        ["score", "--model", "{rm}", "--input", "{records}"],
        SystemExit,
        r"--input needs --output",
        2,
    ),
    Case(
        "score-batch-size-zero",
        ["score", "--model", "{rm}", "--pairs", "{pairs}", "--batch-size", "0"],
        SystemExit,
        r"--batch-size must be >= 1, got 0",
        2,
    ),
    Case(
        "score-max-examples-negative",
        ["score", "--model", "{rm}", "--pairs", "{pairs}", "--max-examples", "-1"],
        SystemExit,
        r"--max-examples must be >= 1, got -1",
        2,
    ),
    # ------------------------------------------------------------------ sample
    Case(
        "sample-policy-as-scorer",
        [
            "sample",
            "--policy",
            "{policy}",
            "--prompts",
            "{prompts}",
            "--out",
            "{tmp}/r.jsonl",
            "--scorer",
            "{policy}",
        ],
        NotARewardModelError,
        r"tiny is not a reward model",
    ),
    Case(
        "sample-gold-without-sim",
        [
            "sample",
            "--policy",
            "{policy}",
            "--prompts",
            "{prompts}",
            "--out",
            "{tmp}/r.jsonl",
            "--scorer",
            "gold",
        ],
        ValueError,
        r"--scorer gold needs --sim DIR",
    ),
    Case(
        "sample-scorer-missing",
        [
            "sample",
            "--policy",
            "{policy}",
            "--prompts",
            "{prompts}",
            "--out",
            "{tmp}/r.jsonl",
            "--scorer",
            "{tmp}/no_rm",
        ],
        FileNotFoundError,
        r"scorer '.*no_rm' is neither 'gold' nor a reward-model directory",
    ),
    Case(
        "sample-policy-missing",
        ["sample", "--policy", "{tmp}/no_policy", "--prompts", "{prompts}", "--out", "{tmp}/r.jsonl"],
        FileNotFoundError,
        r"policy '.*no_policy' is not a directory",
    ),
    Case(
        "sample-policy-interrupted-export",
        ["sample", "--policy", "{interrupted}", "--prompts", "{prompts}", "--out", "{tmp}/r.jsonl"],
        FileNotFoundError,
        r"export to .*swapped was interrupted between its two renames.*`mv .*\.swapped\.old .*swapped`",
    ),
    Case(
        "sample-n-zero",
        ["sample", "--policy", "{policy}", "--prompts", "{prompts}", "--out", "{tmp}/r.jsonl", "--n", "0"],
        SystemExit,
        r"--n must be >= 1, got 0",
        2,
    ),
    Case(
        "sample-pairs-with-one-response",
        [
            "sample",
            "--policy",
            "{policy}",
            "--prompts",
            "{prompts}",
            "--out",
            "{tmp}/r.jsonl",
            "--scorer",
            "{rm}",
            "--n",
            "1",
            "--pairs",
            "{tmp}/p.jsonl",
        ],
        SystemExit,
        r"--pairs needs --n >= 2",
        2,
    ),
    Case(
        "sample-prompts-missing",
        ["sample", "--policy", "{policy}", "--prompts", "{tmp}/no_prompts.jsonl", "--out", "{tmp}/r.jsonl"],
        FileNotFoundError,
        r"no_prompts\.jsonl",
    ),
    Case(
        "sample-unknown-option",
        [
            "sample",
            "--policy",
            "{policy}",
            "--prompts",
            "{prompts}",
            "--out",
            "{tmp}/r.jsonl",
            "--temprature",
            "1",
        ],
        SystemExit,
        r"unrecognized arguments: --temprature",
        2,
    ),
    # ------------------------------------------------------------------ eval
    Case(
        "eval-sim-missing",
        ["eval", "--sim", "{tmp}/no_sim", "--policy", "{policy}"],
        FileNotFoundError,
        r"no_sim/manifest\.json not found: run `alignlit sim make-data --out .*no_sim` first",
    ),
    Case(
        "eval-select-by-a-policy",
        [
            "eval",
            "--sim",
            "{sim}",
            "--policy",
            "{policy}",
            "--best-of",
            "2",
            "--select",
            "{policy}",
            "--n-prompts",
            "2",
        ],
        NotARewardModelError,
        r"tiny is not a reward model",
    ),
    Case(
        "eval-names-do-not-match",
        ["eval", "--sim", "{sim}", "--policy", "{policy}", "{policy}", "--name", "A"],
        SystemExit,
        r"2 --policy but 1 --name",
        2,
    ),
    Case(
        "eval-n-prompts-zero",
        ["eval", "--sim", "{sim}", "--policy", "{policy}", "--n-prompts", "0"],
        SystemExit,
        r"--n-prompts must be >= 1, got 0",
        2,
    ),
    # ------------------------------------------------------------------ the command itself
    Case("unknown-command", ["frobnicate"], SystemExit, r"unknown command 'frobnicate'"),
    Case(
        "sim-unknown-subcommand",
        ["sim", "make-everything"],
        SystemExit,
        r"invalid choice: 'make-everything'",
        2,
    ),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir, tiny_policy_dir):
    """The files the cases name, made once: data, a reward model, broken checkpoints, user folders."""
    d = tmp_path_factory.mktemp("hostile")
    files = {"tokenizer": tokenizer_dir, "policy": tiny_policy_dir}
    files["sft"] = write_jsonl(
        d / "sft.jsonl",
        [{"prompt": f"{H} copy a b{A}", "response": f" a b {'ok ' * (i % 3)}"} for i in range(12)],
    )
    files["records"] = write_jsonl(d / "records.jsonl", [{"prompt": f"{H} copy a{A}", "response": " a"}])
    files["pairs"] = write_jsonl(
        d / "pairs.jsonl", [{"prompt": f"{H} copy a{A}", "chosen": " a", "rejected": " a a a"}] * 3
    )
    files["prompts"] = write_jsonl(d / "prompts.jsonl", [{"prompt": f"{H} sort b a{A}"}] * 2)
    files["sim"] = d / "sim"
    files["sim"].mkdir()
    (files["sim"] / "manifest.json").write_text(json.dumps({"task": {"ops": ["sort", "copy"]}}))
    (files["sim"] / "prompts_test.jsonl").write_text(files["prompts"].read_text())
    torch.manual_seed(0)
    rm, tok = load_scalar_model(tiny_policy_dir, head="fresh")
    files["rm"] = export_pretrained(rm, tok, d / "rm", stage="reward")
    # checkpoints: a truncated one, a plain torch file, one written by the reward stage
    good = {"state_dict": {"w": torch.randn(512)}, "global_step": 3}
    torch.save(good, d / "good.ckpt")
    data = (d / "good.ckpt").read_bytes()
    (d / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    files["truncated"] = d / "truncated.ckpt"
    torch.save({"w": torch.ones(2)}, d / "weights.pt")
    files["plain_pt"] = d / "weights.pt"
    torch.save(
        {
            **good,
            "hyper_parameters": {"_class_path": "alignlit.modules.RewardModule"},
            "alignlit": {"stage": "reward", "module": "alignlit.modules.reward.RewardModule"},
        },
        d / "reward.ckpt",
    )
    files["reward_ckpt"] = d / "reward.ckpt"
    # an export whose swap was interrupted between its two renames
    swapped = d / "swapped"
    export_pretrained(rm, tok, swapped, stage="reward")
    os.replace(swapped, d / ".swapped.old")
    files["interrupted"] = swapped
    return files


def _prepare(case: Case, tmp_path: Path, files: dict) -> list:
    """Per-case files; returns clean-up callables."""
    (tmp_path / "notes.txt").write_text("my notes")
    files["notes"] = tmp_path / "notes.txt"
    (tmp_path / "userdir").mkdir()
    (tmp_path / "userdir" / "thesis.tex").write_text("years of work")
    files["userdir"], files["userfile"] = tmp_path / "userdir", tmp_path / "userdir" / "thesis.tex"
    cleanup = []
    if case.setup == "read_only_mount":
        ro = tmp_path / "readonly"
        ro.mkdir()
        if os.geteuid() != 0:
            pytest.skip(
                "mounting a read-only tmpfs needs root (the unit test in test_models covers the check)"
            )
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
        )
        if res.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {res.stderr.decode().strip()}")
        cleanup.append(lambda: subprocess.run(["umount", str(ro)], check=True))
        files["readonly"] = ro
    return cleanup


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_command(case: Case, world, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative outputs of a config land here, never in the checkout
    files = {**world, "tmp": tmp_path}
    cleanup = _prepare(case, tmp_path, files)
    try:
        argv = [re.sub(r"\{(\w+)\}", lambda m: str(files[m.group(1)]), a) for a in case.argv]
        before = {name: Path(files[name]).read_bytes() for name in case.keep}
        with pytest.raises(case.raises) as info:
            main(argv)
        if case.raises is SystemExit:
            code = info.value.code
            message = capsys.readouterr().err + (code if isinstance(code, str) else "")
            if case.code is not None:
                assert code == case.code, message[-2000:]
        else:
            assert type(info.value) is case.raises, repr(info.value)
            message = str(info.value)
        assert re.search(case.match, message, flags=re.S), message[-3000:]
        for name, content in before.items():
            assert Path(files[name]).read_bytes() == content, f"{name} was changed"
        assert not (tmp_path / "export").exists()  # nothing half-done was exported
    finally:
        for fn in cleanup:
            fn()


def test_the_table_is_large_and_every_case_names_something():
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)
