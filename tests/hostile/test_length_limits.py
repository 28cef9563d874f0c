"""Lengths against positions: ``alignlit sample`` and ``alignlit eval`` check prompt + ``--max-new-tokens``
against the policy's positions before generating; ``alignlit score`` checks ``--max-length`` and counts
what the reward model's limits cut; a reward-model export says how it scores, and plain transformers
scores as alignlit does, at the length limit too (the EOS is kept). Each case failed on main before the
fix it names, and passes after.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest
import torch

from alignlit.cli import main
from tests.helpers import write_jsonl
from tests.hostile.stage_world import GUARANTEES, REWARD_CONFIG, A, H, long_prompt


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
    records = write_jsonl(tmp_path / "r.jsonl", [{"prompt": f"{H} copy a{A}", "response": " a"}])
    with pytest.raises(SystemExit) as info:
        main(["score", "--model", str(world["rm"]), "--input", str(records), "--output", str(tmp_path / "o.jsonl"),
              "--max-length", "1000"])  # fmt: skip
    assert info.value.code == 2
    assert re.search(r"--max-length 1000: max_length=1000 is more than the 256 positions of the reward model",
                     capsys.readouterr().err)  # fmt: skip


def test_score_counts_what_the_length_limits_cut_and_prints_no_nan(world, tmp_path, capsys):
    """Before: a left-truncated prompt went uncounted, and one record printed "std nan"."""
    records = write_jsonl(tmp_path / "r.jsonl", [{"prompt": long_prompt(80), "response": " a"}])
    main(["score", "--model", str(world["rm"]), "--input", str(records), "--output", str(tmp_path / "o.jsonl"),
          "--max-length", "32"])  # fmt: skip
    out = capsys.readouterr().out
    assert "nan" not in out
    assert "of 1 scored sequences, 1 had their prompt left-truncated and 0 their response cut" in out
    pairs = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": long_prompt(80), "chosen": " a", "rejected": " a a"}]
    )
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
    prompts = [f"{H} copy a b{A}", long_prompt(30), f"{H} sort c a{A}"]
    responses = [" a b", " a", " " + " ".join(["a b"] * 20)]  # the last one is cut at the limit
    rm = load_reward_model(trained_rm)
    ours = rm.score(prompts, responses)
    assert rm.counts == {"sequences": 3, "prompts_left_truncated": 1, "responses_right_truncated": 1}
    score = readme_score_helper()
    plain = torch.tensor([score(str(trained_rm), p, r) for p, r in zip(prompts, responses)])
    torch.testing.assert_close(plain, ours, rtol=1e-5, atol=1e-5)
