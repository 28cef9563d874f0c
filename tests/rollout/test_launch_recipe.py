"""The single-machine launch recipe (``examples/launch/served.sh``) as a user runs it: 2 ``alignlit serve`` engine
processes, ``alignlit fit`` of ``configs/quickstart/grpo.yaml`` + ``configs/served/grpo.yaml`` with 2 training ranks (DDP) on them, the
engines stopped afterwards. Real vLLM (CPU build); run with ``nox -s vllm``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY
from tests.helpers import op_prompts

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
KEY = "launch-recipe-test-key-0123456789"
PROMPTS = op_prompts(8, ops=("sort",))


def length_reward(prompts, responses):
    """A deterministic reward with spread: characters 'a' minus a tenth of the length."""
    return [r.count("a") - 0.1 * len(r) for r in responses]


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the recipe's engines listen on PORT + k)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def _pids_listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_single_machine_recipe_trains_on_two_served_engines_and_stops_them(tmp_path, tokenizer):
    from alignlit.models import export_pretrained, make_tiny_llama

    policy = tmp_path / "policy"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer, policy, stage="init")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    port = _free_port_pair()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "POLICY": str(policy), "PORT": str(port), "OMP_NUM_THREADS": "1",
           "LOGS": str(tmp_path / "logs"), "ENGINE_ARGS": "--max-model-len 256", "VLLM_LOGGING_LEVEL": "WARNING",
           "ALIGNLIT_API_KEY": KEY}  # fmt: skip
    export = tmp_path / "export"
    res = subprocess.run(
        ["bash", str(ROOT / "examples/launch/served.sh"), str(ROOT / "configs/quickstart/grpo.yaml"), str(ROOT / "configs/served/grpo.yaml"),
         f"--model.init_args.policy={policy}", "--model.init_args.reward=tests.rollout.test_launch_recipe.length_reward",
         "--model.init_args.gold=null", f"--model.init_args.export_dir={export}",
         "--model.init_args.rollout.sampling.max_new_tokens=4", "--model.init_args.rollout.samples_per_prompt=2",
         "--model.init_args.rollout.parity_every=1", f"--data.init_args.train_file={prompts}",
         "--data.init_args.val_file=null", "--data.init_args.batch_size=2", "--trainer.limit_train_batches=2",
         "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
         f"--trainer.default_root_dir={tmp_path / 'run'}",
         "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    logs = "".join(f.read_text(errors="replace") for f in (tmp_path / "logs").glob("*.log"))
    assert KEY not in res.stdout + res.stderr + logs  # the engines and the trainers hold it, nobody prints it
    assert res.stdout.count("ready") == 2, res.stdout
    assert "policy_gradient: 2 rollout(s) trained, 0" in res.stdout, res.stdout[-3000:]
    from safetensors.torch import load_file

    trained = load_file(export / "model.safetensors")
    start = load_file(policy / "model.safetensors")
    assert (
        max((trained[k] - start[k]).abs().max().item() for k in start) > 0
    )  # the two steps moved the weights
    assert all(torch.isfinite(v).all() for v in trained.values())
    assert not _pids_listening(port) and not _pids_listening(port + 1)  # the engines were stopped
