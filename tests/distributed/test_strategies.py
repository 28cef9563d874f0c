import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignlit.models import make_tiny_llama
from alignlit.strategies import clip_grad_norm
from tests.conftest import TINY
from tests.distributed import multiproc_fit

ROOT = Path(__file__).resolve().parents[2]


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


MULTIPROC_TINY = {**TINY, "num_heads": 2, "head_dim": 32}  # 2 heads: 2-way tensor parallel splits them


@pytest.fixture(scope="module")
def multiproc_runs(tmp_path_factory, tokenizer):
    """Inputs for tests/distributed/multiproc_fit.py and every stage's one-process run on them (in this process)."""
    root = tmp_path_factory.mktemp("multiproc")
    multiproc_fit.write_inputs(
        root / "work", tokenizer, lambda seed: make_tiny_llama(tokenizer, seed=seed, **MULTIPROC_TINY)
    )
    multiproc_fit.fit(str(root / "work"), "single", str(root / "single"), list(multiproc_fit.STAGES))
    return root


def launch_multiproc(root: Path, strategy: str, out: Path) -> None:
    """Every stage in one 2-process launch (Lightning's launcher starts the second process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, multiproc_fit.__file__, str(root / "work"), strategy, str(out), *multiproc_fit.STAGES],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-6000:]


def assert_matches_one_process(root: Path, out: Path, ranks: int = 2) -> None:
    """Each stage's trained weights match the one-process run on the same global batches: the update of
    every model differs by at most 1e-3 of its size (Frobenius norm over all weights) and every weight by
    at most 2e-3, where 3 AdamW steps at lr 1e-2 (PPO/GRPO/REINFORCE++: 2 rollouts) move weights by >= 2e-2;
    PPO's adaptive KL coefficient and running reward moments, and REINFORCE++'s adaptive KL coefficient,
    are identical on every rank and equal the one-process values over the global batch."""
    single = root / "single"
    for stage in multiproc_fit.STAGES:
        one, many, init = (torch.load(d / stage / f, weights_only=True)
                           for d, f in ((single, "weights.pt"), (out, "weights.pt"), (single, "init.pt")))  # fmt: skip
        assert one.keys() == many.keys() == init.keys(), stage
        for model in sorted({k.split(".")[0] for k in one}):
            keys = [k for k in one if k.split(".")[0] == model]
            diff = sum(((many[k] - one[k]) ** 2).sum() for k in keys).sqrt()
            update = sum(((one[k] - init[k]) ** 2).sum() for k in keys).sqrt()
            worst = max((many[k] - one[k]).abs().max().item() for k in keys)
            moved = max((one[k] - init[k]).abs().max().item() for k in keys)
            assert diff <= 1e-3 * update, (
                f"{stage}/{model}: |W - W_1| = {diff:.2e}, |W_1 - W_0| = {update:.2e}"
            )
            assert worst <= 2e-3 and moved >= 2e-2, (
                f"{stage}/{model}: max diff {worst:.2e}, moved {moved:.2e}"
            )
    expected = json.loads((single / "ppo" / "rank-0.json").read_text())
    for rank in range(ranks):
        state = json.loads((out / "ppo" / f"rank-{rank}.json").read_text())
        assert state["kl_coef"] == pytest.approx(expected["kl_coef"], rel=1e-9)
        assert state["moments"]["count"] == expected["moments"]["count"] == 2 * multiproc_fit.GLOBAL_BATCH
        assert state["moments"]["mean"] == pytest.approx(expected["moments"]["mean"], rel=1e-6)
        assert state["moments"]["m2"] == pytest.approx(expected["moments"]["m2"], rel=1e-5)
    assert expected["kl_coef"] != 0.2  # the controller moved (initial β 0.2)
    expected = json.loads((single / "reinforce_pp_kl" / "rank-0.json").read_text())["kl_coef"]
    for rank in range(ranks):  # the mean KL of the global batch, counting its responses
        state = json.loads((out / "reinforce_pp_kl" / f"rank-{rank}.json").read_text())
        assert state["kl_coef"] == pytest.approx(expected, rel=1e-9), f"rank {rank}"
    assert expected != 0.2
    sharded = json.loads((out / "ppo_sharded" / "rank-0.json").read_text())["sharded"]
    assert sharded == [out.name != "ddp"] * 2  # shard_frozen: reference and reward model are DTensors


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "tp", "fsdp"])
def test_every_stage_under_two_processes_matches_one_process(multiproc_runs, tmp_path, strategy):
    """Reward, pairwise preference, DPO, RRHF, PPO (also with its frozen reference and reward model
    sharded), GRPO, REINFORCE++ with an adaptive KL coefficient, LoRA DPO and LoRA PPO under 2-process DDP, 2-way tensor parallel and FSDP2 over 2
    data-parallel ranks (``ModelParallelStrategy``, gloo) train the weights one process trains on the
    same global batches (see :func:`assert_matches_one_process` for the tolerances); one launch per
    strategy runs every stage."""
    launch_multiproc(multiproc_runs, strategy, tmp_path / strategy)
    assert_matches_one_process(multiproc_runs, tmp_path / strategy)
