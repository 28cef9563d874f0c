"""Reliability, round two (everything outside the online stages): each case failed on main before the
fix it names, and passes after.

- resumes: what ``--ckpt_path`` may change (applied and logged) and what it refuses (named); a run
  never starts into another run's checkpoint folder; a resume that trains nothing fails; Ctrl-C says
  where the last checkpoint is and how to resume, and that command resumes;
- lengths: ``alignlit sample`` and ``alignlit eval`` check prompt + ``--max-new-tokens`` against the
  policy's positions before generating; ``alignlit score`` checks ``--max-length`` and counts what the
  reward model's limits cut; a reward-model export says how it scores, and plain transformers scores
  as alignlit does, at the length limit too (the EOS is kept);
- errors: a reward's bad return value is named; config typos get a did-you-mean in one line, with the
  YAML file they are in; an adapter export loads from any directory;
- a quiet log: the benign messages of Lightning and transformers are left out by exact text
  (``alignlit.quiet``), real warnings stay.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from alignlit.checkpoint_io import CheckpointError
from alignlit.cli import main
from alignlit.models import export_pretrained, load_policy, load_scalar_model, make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIG = str(ROOT / "configs/quickstart/sft.yaml")
REWARD_CONFIG = str(ROOT / "configs/quickstart/reward.yaml")
GUARANTEES = ROOT / "docs" / "guarantees.md"
H, A = "\n\nHuman:", "\n\nAssistant:"
TINY = dict(hidden_size=32, num_layers=1, num_heads=1, head_dim=32, intermediate_size=64)


def _jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _long_prompt(words: int) -> str:
    return f"{H} copy " + " ".join("abcdefgh"[i % 8] for i in range(words)) + A


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir, tokenizer):
    """Data, a 48-position policy and a reward model, made once."""
    d = tmp_path_factory.mktemp("round2")
    files = {"tokenizer": tokenizer_dir}
    files["sft"] = _jsonl(
        d / "sft.jsonl",
        [{"prompt": f"{H} copy a b{A}", "response": f" a b {'ok ' * (i % 3)}"} for i in range(16)],
    )
    files["pairs"] = _jsonl(
        d / "pairs.jsonl",
        [
            {"prompt": f"{H} copy a {'b ' * (i % 5)}{A}", "chosen": " a", "rejected": " a a a b"}
            for i in range(16)
        ],
    )
    files["prompts"] = _jsonl(
        d / "prompts.jsonl", [{"prompt": f"{H} sort b a{A}"}, {"prompt": _long_prompt(60)}]
    )
    files["short_policy"] = d / "short"
    export_pretrained(
        make_tiny_llama(tokenizer, seed=0, max_position_embeddings=48, **TINY),
        tokenizer,
        d / "short",
        stage="init",
    )
    files["policy"] = d / "policy"
    export_pretrained(make_tiny_llama(tokenizer, seed=1, **TINY), tokenizer, d / "policy", stage="init")
    torch.manual_seed(0)
    rm, tok = load_scalar_model(files["policy"], head="fresh")
    files["rm"] = export_pretrained(
        rm, tok, d / "rm", stage="reward", data={"max_length": 32, "max_prompt_length": 16}
    )
    files["sim"] = d / "sim"
    files["sim"].mkdir()
    (files["sim"] / "manifest.json").write_text(json.dumps({"task": {"ops": ["sort", "copy"]}}))
    shutil.copy(files["prompts"], files["sim"] / "prompts_test.jsonl")
    return files


def _fit(tmp: Path, world, *extra: str, steps: int = 2, ckpt_every: int | None = 1) -> list[str]:
    """The quickstart SFT config made tiny, checkpoints (every step) in ``tmp/ckpt``."""
    callbacks = []
    if ckpt_every:
        callbacks.append(
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {
                    "dirpath": str(tmp / "ckpt"),
                    "every_n_train_steps": ckpt_every,
                    "save_last": True,
                },
            }
        )
    return [
        "fit",
        "--config",
        SFT_CONFIG,
        f"--model.init_args.policy.init_args.tokenizer={world['tokenizer']}",
        "--model.init_args.policy.init_args.hidden_size=32",
        "--model.init_args.policy.init_args.num_layers=1",
        "--model.init_args.policy.init_args.head_dim=32",
        "--model.init_args.policy.init_args.intermediate_size=64",
        f"--data.init_args.train_file={world['sft']}",
        f"--data.init_args.val_file={world['sft']}",
        "--data.init_args.batch_size=4",
        f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={steps}",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp}/logs",
        f"--trainer.callbacks={json.dumps(callbacks)}",
        f"--model.init_args.export_dir={tmp}/export",
        *extra,
    ]


def _stamp(path: Path) -> int:
    return (path / "alignlit.json").stat().st_mtime_ns


# ====================================================================== 1. the resume contract
@pytest.fixture()
def trained(tmp_path, world, monkeypatch):
    """A finished 2-step run with a checkpoint per step and an export."""
    monkeypatch.chdir(tmp_path)
    main(_fit(tmp_path, world))
    assert (tmp_path / "ckpt/last.ckpt").is_file() and (tmp_path / "export/alignlit.json").is_file()
    return tmp_path


def test_a_resume_applies_a_new_length_and_export_dir_and_logs_each_change(trained, world, capsys):
    """Before: LightningCLI replaced the model's arguments by the checkpoint's, so the new export_dir was
    dropped and the *old* export was overwritten."""
    tmp = trained
    before = _stamp(tmp / "export")
    capsys.readouterr()
    main(
        _fit(
            tmp,
            world,
            f"--ckpt_path={tmp}/ckpt/last.ckpt",
            f"--model.init_args.export_dir={tmp}/new",
            steps=3,
        )
    )
    out = capsys.readouterr().out
    assert (tmp / "new/alignlit.json").is_file(), "the export_dir given on the command line was not used"
    assert _stamp(tmp / "export") == before, "the old export_dir was written to"
    assert re.search(r"changed setting: model\.init_args\.export_dir: '.*/export' -> '.*/new'", out), out
    assert re.search(r"changed setting: trainer\.max_steps: 2 -> 3", out), out
    assert json.loads((tmp / "new/alignlit.json").read_text())["config"]["trainer"]["max_steps"] == 3


@pytest.mark.parametrize(
    "override, field, values",
    [
        (
            "--model.init_args.optim.lr=0.01",
            r"model\.init_args\.optim\.lr",
            r"checkpoint 0\.001, given 0\.01",
        ),
        ("--data.init_args.batch_size=2", r"data\.init_args\.batch_size", r"checkpoint 4, given 2"),
        ("--trainer.gradient_clip_val=0.5", r"trainer\.gradient_clip_val", r"checkpoint 1\.0, given 0\.5"),
        ("--seed_everything=3", r"seed_everything", r"checkpoint 0, given 3"),
    ],
    ids=["optimizer", "data-not-in-hparams", "gradient-clipping", "seed"],
)
def test_a_resume_refuses_a_changed_training_setting_naming_it(
    trained, world, capsys, override, field, values
):
    """Before: the optimizer's lr silently stayed the checkpoint's while data settings (not saved in the
    checkpoint's hyperparameters) took effect; now both are refused, naming the field and both values."""
    tmp = trained
    before = _stamp(tmp / "export")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp, world, f"--ckpt_path={tmp}/ckpt/last.ckpt", override, steps=3))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert re.search(rf"a resume continues the run as it was configured.*{field} \({values}\)", err), err
    assert "start a new run without --ckpt_path" in err
    assert _stamp(tmp / "export") == before


def test_a_fresh_run_refuses_a_checkpoint_folder_holding_another_runs_checkpoints(trained, world):
    """Before: the second run wrote last-v1.ckpt beside the first run's last.ckpt, and resuming
    `last.ckpt` (as docs/guarantees.md says) resumed the first, finished run."""
    tmp = trained
    files = sorted(p.name for p in (tmp / "ckpt").iterdir())
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*ckpt: it already holds checkpoints of another run"
                       r" \(.*last\.ckpt.*resume that run with --ckpt_path .*ckpt/last\.ckpt"):  # fmt: skip
        main(_fit(tmp, world))
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == files  # no last-v1.ckpt


def test_a_resume_that_trains_zero_steps_fails_and_exports_nothing(trained, world):
    """Before: resuming a finished run trained 0 steps, exited 0 and re-exported the old weights."""
    tmp = trained
    before = _stamp(tmp / "export")
    with pytest.raises(CheckpointError, match=r"at global step 2, where the run already ends .*0 steps were trained "
                       r"and nothing was exported.*--trainer\.max_steps"):  # fmt: skip
        main(_fit(tmp, world, f"--ckpt_path={tmp}/ckpt/last.ckpt"))
    assert _stamp(tmp / "export") == before


def test_a_resume_past_a_finished_epoch_says_to_raise_max_epochs(tmp_path, world, monkeypatch):
    """The online configs' shape (max_epochs 1, limit_train_batches N): a checkpoint written at the end of
    the epoch resumes in epoch 1, so a larger limit_train_batches trains nothing. Before: exit 0 and the
    old weights re-exported; now the error says which length to raise."""
    monkeypatch.chdir(tmp_path)
    epoch = [
        "--trainer.max_steps=-1",
        "--trainer.max_epochs=1",
        "--trainer.val_check_interval=1.0",
        "--trainer.check_val_every_n_epoch=1",
    ]
    main([*_fit(tmp_path, world), *epoch, "--trainer.limit_train_batches=2"])
    before = _stamp(tmp_path / "export")
    with pytest.raises(CheckpointError, match=r"max_epochs=1 is reached: the checkpoint finished the last epoch\): 0 steps were trained .*raise "
                       r"--trainer\.max_epochs \(a larger limit_train_batches does not reopen"):  # fmt: skip
        main(
            [
                *_fit(tmp_path, world, f"--ckpt_path={tmp_path}/ckpt/last.ckpt"),
                *epoch,
                "--trainer.limit_train_batches=3",
            ]
        )
    assert _stamp(tmp_path / "export") == before


class InterruptOnce(Callback):
    """Raises KeyboardInterrupt (what Ctrl-C raises) after ``step`` optimizer steps, once per ``flag`` file."""

    def __init__(self, flag: str, step: int = 2):
        self.flag, self.step = flag, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step and not Path(self.flag).exists():
            Path(self.flag).touch()
            raise KeyboardInterrupt


def test_ctrl_c_prints_the_last_checkpoint_and_a_resume_command_that_works(
    tmp_path, world, monkeypatch, capsys
):
    """Before: Lightning's "Detected KeyboardInterrupt, attempting graceful shutdown" and nothing on where
    to resume from."""
    monkeypatch.chdir(tmp_path)
    interrupt = {"class_path": f"{__name__}.InterruptOnce", "init_args": {"flag": str(tmp_path / "flag")}}
    argv = _fit(tmp_path, world, f"--trainer.callbacks+={json.dumps(interrupt)}", steps=4)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as info:
            main(argv)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT while it shuts down
    assert info.value.code == 1
    err = capsys.readouterr().err
    m = re.search(
        r"interrupted at global step 2\. The last checkpoint is (\S+); resume the run with:\n  (.+)", err
    )
    assert m, err
    assert Path(m.group(1)).is_file()
    command = shlex.split(m.group(2))
    assert command[:2] == ["alignlit", "fit"] and command[-2:] == ["--ckpt_path", m.group(1)]
    main(command[1:])  # the printed command resumes the run to its end
    assert json.loads((tmp_path / "export/alignlit.json").read_text())["config"]["ckpt_path"] == m.group(1)


# ====================================================================== 5, 7. lengths against positions
def _sample(world, tmp: Path, *extra: str) -> list[str]:
    return ["sample", "--policy", str(world["short_policy"]), "--prompts", str(world["prompts"]),
            "--out", str(tmp / "r.jsonl"), "--n", "2", "--max-new-tokens", "8", "--no-progress", *extra]  # fmt: skip


def test_sample_refuses_prompts_longer_than_the_policys_positions(world, tmp_path, capsys):
    """Before: a prompt of 60+ tokens on a 48-position policy was sampled with only transformers' log line."""
    with pytest.raises(SystemExit) as info:
        main(_sample(world, tmp_path))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert re.search(r"1 of 2 prompts do not fit the policy .*short: .*its 48 positions .*at most 40 tokens; the "
                     r"longest \(.*prompts\.jsonl.*\) has \d+.*--prompt-overflow truncate", err), err  # fmt: skip
    assert not (tmp_path / "r.jsonl").exists()


def test_sample_refuses_max_new_tokens_beyond_the_positions(world, tmp_path, capsys):
    """Before: `--max-new-tokens 5000` on a 48-position policy was accepted."""
    with pytest.raises(SystemExit) as info:
        main([*_sample(world, tmp_path), "--max-new-tokens", "5000"])
    assert info.value.code == 2
    assert re.search(
        r"--max-new-tokens 5000 leaves no room for a prompt in the 48 positions", capsys.readouterr().err
    )


def test_sample_truncates_prompts_when_asked_and_counts_them(world, tmp_path, capsys):
    groups = main([*_sample(world, tmp_path), "--prompt-overflow", "truncate"])
    out = capsys.readouterr().out
    assert len(groups) >= 1
    assert (
        "alignlit sample: 1 of 2 prompts left-truncated and 0 dropped so that a prompt and 8 new tokens fit"
        in out
    )


def test_eval_refuses_prompts_longer_than_the_policys_positions(world, capsys):
    """Before: `alignlit eval` sampled the 60-token prompt on the 48-position policy."""
    with pytest.raises(SystemExit) as info:
        main(["eval", "--sim", str(world["sim"]), "--policy", str(world["short_policy"]), "--n-prompts", "2",
              "--max-new-tokens", "8", "--no-progress"])  # fmt: skip
    assert info.value.code == 2
    assert re.search(r"1 of 2 prompts do not fit the policy .*short.*48 positions", capsys.readouterr().err)


def test_score_refuses_a_max_length_beyond_the_reward_models_positions(world, tmp_path, capsys):
    """Before: `--max-length 1000` on a 256-position model was accepted (a 512-position MiniLM then failed
    with a tensor-size error, a RoPE model scored silently past its positions)."""
    records = _jsonl(tmp_path / "r.jsonl", [{"prompt": f"{H} copy a{A}", "response": " a"}])
    with pytest.raises(SystemExit) as info:
        main(["score", "--model", str(world["rm"]), "--input", str(records), "--output", str(tmp_path / "o.jsonl"),
              "--max-length", "1000"])  # fmt: skip
    assert info.value.code == 2
    assert re.search(r"--max-length 1000: max_length=1000 is more than the 256 positions of the reward model",
                     capsys.readouterr().err)  # fmt: skip


def test_score_counts_what_the_length_limits_cut_and_prints_no_nan(world, tmp_path, capsys):
    """Before: a left-truncated prompt went uncounted, and one record printed "std nan"."""
    records = _jsonl(tmp_path / "r.jsonl", [{"prompt": _long_prompt(80), "response": " a"}])
    main(["score", "--model", str(world["rm"]), "--input", str(records), "--output", str(tmp_path / "o.jsonl"),
          "--max-length", "32"])  # fmt: skip
    out = capsys.readouterr().out
    assert "nan" not in out
    assert "of 1 scored sequences, 1 had their prompt left-truncated and 0 their response cut" in out
    pairs = _jsonl(tmp_path / "p.jsonl", [{"prompt": _long_prompt(80), "chosen": " a", "rejected": " a a"}])
    main(["score", "--model", str(world["rm"]), "--pairs", str(pairs), "--max-length", "32",
          "--json", str(tmp_path / "m.json")])  # fmt: skip
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["sequences"], metrics["prompts_left_truncated"]) == (2, 2)


def test_sample_reports_what_the_reward_models_limits_cut(world, tmp_path, capsys):
    """Before: the reward model scored left-truncated prompts without a word."""
    main([*_sample(world, tmp_path), "--policy", str(world["policy"]), "--scorer", str(world["rm"])])
    out = capsys.readouterr().out
    m = re.search(r"alignlit sample: reward model: of (\d+) scored sequences, (\d+) had their prompt cut to its "
                  r"last 16 tokens", out)  # fmt: skip
    assert m and int(m.group(2)) >= 1, out


# ====================================================================== 6. reward-model exports
@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory, world):
    """A reward stage run through `alignlit fit` (2 steps) with max_length 20 / max_prompt_length 12."""
    tmp = tmp_path_factory.mktemp("rm")
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        main(["fit", "--config", REWARD_CONFIG, f"--model.init_args.model={world['policy']}",
              f"--data.init_args.train_file={world['pairs']}", f"--data.init_args.val_file={world['pairs']}",
              "--data.init_args.max_length=20", "--data.init_args.max_prompt_length=12",
              "--data.init_args.batch_size=4", "--data.init_args.length_balance=false", "--trainer.max_steps=2",
              "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
              f"--trainer.logger.init_args.save_dir={tmp}/logs", f"--model.init_args.export_dir={tmp}/rm"])  # fmt: skip
    finally:
        os.chdir(cwd)
    return tmp / "rm"


def readme_score_helper():
    """The plain-transformers ``score()`` the Guarantees page (docs/guarantees.md) gives, executed as written."""
    section = GUARANTEES.read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", section, flags=re.S)]
    code = next((b for b in blocks if "def score(" in b), None)
    assert code is not None, "docs/guarantees.md has no plain-transformers score() helper"
    namespace: dict = {}
    exec(code, namespace)
    return namespace["score"]


def test_plain_transformers_scores_equal_alignlits_including_at_the_length_limit(trained_rm):
    """Before: the export did not say that it scores prompt + response + EOS, and at the length limit the
    EOS was dropped, so a plain-transformers user (who appends it) got other scores."""
    from alignlit.models import load_reward_model
    from alignlit.models.reward_model import REWARD_FORMAT_KEY

    config = json.loads((trained_rm / "config.json").read_text())
    fmt = config[REWARD_FORMAT_KEY]
    assert fmt["layout"] == ["prompt", "response", "eos"] and (
        fmt["max_length"],
        fmt["max_prompt_length"],
    ) == (20, 12)
    prompts = [f"{H} copy a b{A}", _long_prompt(30), f"{H} sort c a{A}"]
    responses = [" a b", " a", " " + " ".join(["a b"] * 20)]  # the last one is cut at the limit
    rm = load_reward_model(trained_rm)
    ours = rm.score(prompts, responses)
    assert rm.counts == {"sequences": 3, "prompts_left_truncated": 1, "responses_right_truncated": 1}
    score = readme_score_helper()
    plain = torch.tensor([score(str(trained_rm), p, r) for p, r in zip(prompts, responses)])
    torch.testing.assert_close(plain, ours, rtol=1e-5, atol=1e-5)


# ====================================================================== unclear errors
def _gen(p, r):
    return (x for x in [1.0])


@pytest.mark.parametrize(
    "out, message",
    [
        ("0.5", r"returned str \('0\.5'\); expected one number per response"),
        (None, r"returned None; expected one number per response"),
        ([None], r"returned None at row 0; expected a real number"),
        ({"score": 1.0}, r"returned dict \(\{'score': 1\.0\}\); expected one number per response"),
        (_gen, r"returned generator \(<generator"),
        ([1 + 2j], r"returned a complex number \(\(1\+2j\)\) at row 0; expected a real number"),
        ([10**400], r"returned an integer of 401 digits at row 0, too large for a float"),
        ([1e39], r"returned 1e\+39 at row 0, which overflows float32 \(the largest float32 is 3\.4e\+38\)"),
        (torch.tensor([1e39], dtype=torch.float64), r"returned 1e\+39 at row 0, which overflows float32"),
        ([float("inf")], r"returned non-finite scores at rows \[0\]"),
    ],
    ids=[
        "str",
        "None",
        "list-of-None",
        "dict",
        "generator",
        "complex",
        "10**400",
        "1e39",
        "1e39-tensor",
        "inf",
    ],
)
def test_a_bad_reward_value_is_named_with_the_reward(out, message):
    """Before: tracebacks from torch.as_tensor inside _checked without "reward returned …", and 1e39
    reported as non-finite."""
    from alignlit.rollout.reward_protocol import score_texts

    reward = out if callable(out) else (lambda prompts, responses: out)
    with pytest.raises(ValueError, match=r"^reward \S+ " + message):
        score_texts(reward, ["p"], ["r"])


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--trainer.max_stesp=3"], r"unknown option --trainer\.max_stesp \(did you mean --trainer\.max_steps\?\)"),
        (["--model.init_args.optm.lr=0.1"],
         r"model\.init_args\.optm\.lr \(on the command line\): SFTModule has no argument 'optm' \(did you mean 'optim'\?\)"),
        (["--model.init_args.optim.lrr=0.1"],
         r"model\.init_args\.optim\.lrr \(on the command line\): Optim has no argument 'lrr' \(did you mean 'lr'\?\)"),
        (["--data.init_args.batch_sise=3"],
         r"data\.init_args\.batch_sise \(on the command line\): SFTDataModule has no argument 'batch_sise' "
         r"\(did you mean 'batch_size'\?\)"),
        (["--modle.init_args.optim.lr=3"], r"unknown option --modle\.init_args\.optim\.lr \(did you mean --model\."),
    ],
    ids=["trainer", "model", "optim-field", "data", "top-level"],
)  # fmt: skip
def test_a_config_typo_is_one_line_with_a_did_you_mean(world, tmp_path, capsys, extra, expected):
    """Before: no suggestion, after a 57-line usage dump (and a dump of the whole model config)."""
    with pytest.raises(SystemExit) as info:
        main([*_fit(tmp_path, world), *extra])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert re.search(r"^alignlit fit: error: " + expected, err), err
    assert len(err.strip().splitlines()) <= 2 and "Given value" not in err, err


def test_a_yaml_typo_names_its_file(world, tmp_path, capsys):
    """Before: the whole model dict, without the file name."""
    config = tmp_path / "mine.yaml"
    config.write_text(Path(SFT_CONFIG).read_text().replace("    optim:\n", "    optm:\n"))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config)])
    err = capsys.readouterr().err
    assert re.search(r"model\.init_args\.optm\.\w+ \(in .*mine\.yaml\): SFTModule has no argument 'optm' "
                     r"\(did you mean 'optim'\?\)", err), err  # fmt: skip
    assert "'init_args': {" not in err


def test_a_yaml_syntax_error_names_its_file(tmp_path, capsys):
    """Before: `in "<unicode string>", line 2`."""
    config = tmp_path / "broken.yaml"
    config.write_text("trainer:\n  max_steps: [1\nmodel: 3\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config)])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert re.search(r"broken\.yaml is not valid YAML: .*in .*broken\.yaml, line 2, column \d+", err), err
    assert "<unicode string>" not in err


def test_an_adapter_export_loads_from_another_directory(tmp_path, world, monkeypatch):
    """Before: the adapter named its base by the relative path it was loaded from, so it loaded only
    from the directory the stage ran in."""
    from alignlit.models.lora import LoRA, apply_lora

    project = tmp_path / "project"
    shutil.copytree(world["policy"], project / "out/policy")
    monkeypatch.chdir(project)
    model, tok = load_policy("out/policy")
    apply_lora(model, LoRA(rank=2, export="adapter"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)  # a non-zero update, so the merged weights differ from the base
    export_pretrained(model, tok, "out/adapter", stage="sft", lora_export="adapter")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    merged, _ = load_policy(project / "out/adapter")
    base, _ = load_policy(project / "out/policy")
    ids = torch.tensor([[5, 6, 7]])
    assert not torch.allclose(merged(ids).logits, base(ids).logits)


# ====================================================================== a quiet log
def test_the_benign_messages_are_filtered_by_exact_text_and_real_ones_are_not():
    """Before: alignlit.quiet did not exist; each of these was printed in every stage."""
    from alignlit.quiet import benign

    noise = [
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
        "treespec.is_leaf()` instead.",
        "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state was "
        "saved. The checkpoint will contain the model state AFTER optimization. To save ...",
        "Found 119 module(s) in eval mode at the start of training. This may lead to unexpected behavior during "
        "training. If this is intentional, you can ignore this warning.",
        "Checkpoint directory /runs/ckpt exists and is not empty.",
        "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](https://pypi.org/...)",
        "💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels](https://pypi.org/...)",
    ]
    real = [
        "The number of training batches (4) is smaller than the logging interval Trainer(log_every_n_steps=20).",
        "`isinstance(x, Foo)` is deprecated, use `isinstance(x, Bar)` instead.",
        "Found 3 module(s) in eval mode at the start of training because of X.",
        "The 'train_dataloader' does not have many workers which may be a bottleneck.",
    ]
    assert all(benign(m) for m in noise)
    assert not any(benign(m) for m in real)
    entry, match = benign(noise[2])
    assert entry.say(match).startswith(
        "119 modules are in eval mode at the start of training, as alignlit intends"
    )


def test_a_fresh_reward_head_is_one_line_not_a_load_report(world, capfd):
    """Before: transformers' 8-line LOAD REPORT for the expected fresh head (and unused lm_head)."""
    load_scalar_model(world["policy"], head="fresh")
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err
    assert re.search(
        r"alignlit: .*policy: a new scalar head \(score\.weight\) is initialised, to be trained", out
    )


def test_a_stage_log_has_no_benign_warning_lines(world, tmp_path):
    """`alignlit fit` as a user runs it (a new process, progress bar on): before, the log held the LeafSpec
    deprecation twice, a LitLogger tip and "Epoch 0/-2" in the bar."""
    argv = [a for a in _fit(tmp_path, world, steps=2) if not a.startswith("--trainer.enable_progress_bar")]
    res = subprocess.run(
        [sys.executable, "-m", "alignlit.cli", *argv, "--trainer.enable_progress_bar=true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
        timeout=300,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    for noise in ("LeafSpec", "Tip:", "litlogger", "Epoch 0/-2", "Warning", "warn("):
        assert noise not in log, f"{noise!r} in the log:\n{log}"
