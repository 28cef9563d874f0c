"""Unclear errors made clear: a reward's bad return value is named; config typos get a did-you-mean in one
line, with the YAML file they are in; an adapter export loads from any directory. Each case failed on
main before the fix it names, and passes after.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from alignlit.cli import main
from alignlit.models import export_pretrained, load_policy
from tests.hostile.stage_world import SFT_CONFIG, fit_args


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
        main([*fit_args(tmp_path, world), *extra])
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
