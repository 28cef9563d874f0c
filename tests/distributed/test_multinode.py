"""Beyond one machine: Lightning's own multi-node launch under ``torchrun`` (the engine for SLURM and any
cluster too). A DPO and a PPO config run as 2 nodes x 1 process on this host (``torchrun --nnodes 2
--node-rank {0,1} --master-addr 127.0.0.1``, gloo) and export the weights the single-node 2-process
run of the same configs exports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from alignlit.models import make_tiny_llama
from tests.distributed import multiproc_fit
from tests.distributed.test_strategies import MULTIPROC_TINY

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _configs(work: Path) -> dict[str, dict]:
    """Tiny DPO and PPO configs on multiproc_fit's inputs (2 examples per rank)."""
    trainer = {
        "accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
    }  # fmt: skip
    optim = {"lr": 1.0e-2, "warmup_steps": 0, "min_lr_ratio": 1.0}
    dpo = {
        "seed_everything": 0,
        "trainer": {**trainer, "max_steps": 3, "strategy": "ddp"},
        "model": {
            "class_path": "alignlit.modules.DPOModule",
            "init_args": {"policy": str(work / "policy"), "beta": 0.5, "sft_weight": 0.5, "optim": optim},
        },
        "data": {
            "class_path": "alignlit.data.PreferenceDataModule",
            "init_args": {
                "train_file": str(work / "pairs.jsonl"),
                "val_fraction": 0.0,
                "max_length": 32,
                "max_prompt_length": 16,
                "batch_size": 2,
                "seed": 0,
            },
        },
    }
    ppo = {
        "seed_everything": 0,
        # the actor's and the critic's updates each leave the other model's parameters unused
        "trainer": {
            **trainer,
            "max_epochs": 1,
            "limit_train_batches": 2,
            "strategy": "ddp_find_unused_parameters_true",
        },
        "model": {
            "class_path": "alignlit.modules.PPOModule",
            "init_args": {
                "policy": str(work / "policy"),
                "reward": "tests.distributed.multiproc_fit.length_reward",
                "reference": str(work / "reference"),
                "optim": optim,
                "critic_optim": optim,
                "kl": {"coef": 0.2, "target": 0.01, "horizon": 4},
                "rollout": {"sampling": {"temperature": 0.0, "max_new_tokens": 4}},
                "minibatches": {"size": 64, "epochs": 2},
            },
        },
        "data": {
            "class_path": "alignlit.data.PromptDataModule",
            "init_args": {"train_file": str(work / "prompts.jsonl"), "val_fraction": 0.0, "batch_size": 2},
        },
    }
    return {"dpo": dpo, "ppo": ppo}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fit_args(config: Path, out: Path) -> list[str]:
    return ["fit", "--config", str(config), "--trainer.default_root_dir", str(out),
            "--model.init_args.export_dir", str(out / "export")]  # fmt: skip


@pytest.mark.slow
def test_two_nodes_under_torchrun_match_one_node_with_two_processes(tmp_path, tokenizer):
    """Each config as (a) one `alignlit fit` with `--trainer.devices 2` and (b) two `torchrun` agents, node
    ranks 0 and 1, each `--trainer.num_nodes 2 --trainer.devices 1`, rendezvous on 127.0.0.1: the
    processes form the same 2-rank gloo group either way, so the exports agree to 1e-6 (float
    reductions in the same order), and training moved the weights by far more."""
    work = tmp_path / "work"
    multiproc_fit.write_inputs(
        work, tokenizer, lambda seed: make_tiny_llama(tokenizer, seed=seed, **MULTIPROC_TINY)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for stage, config in _configs(work).items():
        path = tmp_path / f"{stage}.yaml"
        path.write_text(yaml.safe_dump(config))
        one_node = tmp_path / stage / "one-node"
        res = subprocess.run(
            [sys.executable, "-m", "alignlit.cli", *_fit_args(path, one_node), "--trainer.devices", "2"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-4000:]

        two_nodes = tmp_path / stage / "two-nodes"
        port = _free_port()
        agents = [
            subprocess.Popen(
                [
                    str(TORCHRUN),
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port),
                    "-m",
                    "alignlit.cli",
                    *_fit_args(path, two_nodes),
                    "--trainer.devices",
                    "1",
                    "--trainer.num_nodes",
                    "2",
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in (0, 1)
        ]
        for node, agent in enumerate(agents):
            out, _ = agent.communicate(timeout=600)
            assert agent.returncode == 0, f"node {node}:\n{out[-4000:]}"
        assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out  # node 1's process is rank 1 of 2

        a = load_file(str(one_node / "export" / "model.safetensors"))
        b = load_file(str(two_nodes / "export" / "model.safetensors"))
        start = load_file(str(work / "policy" / "model.safetensors"))
        assert a.keys() == b.keys() == start.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=f"{stage}: {name}")
        assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-2
