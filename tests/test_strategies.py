import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignlit.strategies import clip_grad_norm

ROOT = Path(__file__).resolve().parents[1]


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 5
        q.grad = p.grad.clone()
    total = clip_grad_norm(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert total.item() == pytest.approx(ref.item(), rel=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)


def _fit(cwd, *extra):
    cmd = [
        sys.executable,
        "-m",
        "alignlit.cli",
        "fit",
        "--config",
        str(ROOT / "configs/quickstart/sft.yaml"),
        "--trainer.max_steps",
        "6",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_progress_bar",
        "false",
        "--data.init_args.max_examples",
        "256",
        "--data.init_args.batch_size",
        "16",
        "--model.init_args.optim.warmup_steps",
        "1",
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(cwd),
        "--trainer.callbacks",
        "[]",
        "--trainer.enable_checkpointing",
        "false",
        *extra,
    ]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return load_file(str(Path(cwd) / "out/quickstart/sft/model.safetensors"))


@pytest.mark.slow
def test_tensor_parallel_on_cpu_reproduces_single_process(tmp_path):
    """6 AdamW steps with 2-way DTensor tensor parallel (2 gloo processes) give the same exported weights
    as one process: TP splits the matmuls, not the math."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "alignlit.cli",
            "sim",
            "make-data",
            "--out",
            "data/sim",
            "--n-sft",
            "300",
            "--n-pairs",
            "20",
            "--n-prompts",
            "20",
            "--n-val",
            "20",
            "--n-test",
            "20",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    single = _fit(tmp_path)
    tp = _fit(tmp_path, "--config", str(ROOT / "configs/strategies/tp2-cpu.yaml"))
    assert single.keys() == tp.keys()
    for name in single:
        # Adam turns float-summation-order differences (split matmuls) into ~1e-5 weight differences;
        # 6 steps at lr 1e-3 move weights by ~6e-3, 60x the tolerance
        diff = (tp[name] - single[name]).abs().max().item()
        assert diff < 1e-4, f"{name}: max |tp - single| = {diff:.2e}"
    # training moved the weights far beyond that tolerance (so the comparison is not vacuous)
    from alignlit.models import TinyLlama, load_policy

    spec = TinyLlama(
        tokenizer=str(tmp_path / "data/sim/tokenizer"),
        hidden_size=128,
        num_layers=4,
        num_heads=2,
        intermediate_size=512,
        max_position_embeddings=128,
    )
    init = load_policy(spec)[0].state_dict()
    moved = (
        single["model.layers.0.mlp.down_proj.weight"] - init["model.layers.0.mlp.down_proj.weight"]
    ).abs()
    assert moved.max() > 3e-3
