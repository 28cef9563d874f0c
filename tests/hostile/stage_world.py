"""The small world the command-line tests of tests/hostile share: data files, a 48-position policy, a
policy and a fresh reward model (the ``world`` fixture in tests/hostile/conftest.py builds them once), and the
quickstart SFT command line made tiny."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from alignlit.models import export_pretrained, load_scalar_model, make_tiny_llama
from tests.helpers import write_jsonl

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIG = str(ROOT / "configs/quickstart/sft.yaml")
REWARD_CONFIG = str(ROOT / "configs/quickstart/reward.yaml")
GUARANTEES = ROOT / "docs" / "guarantees.md"
H, A = "\n\nHuman:", "\n\nAssistant:"
TINY = dict(hidden_size=32, num_layers=1, num_heads=1, head_dim=32, intermediate_size=64)


def long_prompt(words: int) -> str:
    return f"{H} copy " + " ".join("abcdefgh"[i % 8] for i in range(words)) + A


def make_world(d: Path, tokenizer_dir: Path, tokenizer) -> dict:
    """Data, a 48-position policy and a reward model under ``d``."""
    files = {"tokenizer": tokenizer_dir}
    files["sft"] = write_jsonl(
        d / "sft.jsonl",
        [{"prompt": f"{H} copy a b{A}", "response": f" a b {'ok ' * (i % 3)}"} for i in range(16)],
    )
    files["pairs"] = write_jsonl(
        d / "pairs.jsonl",
        [
            {"prompt": f"{H} copy a {'b ' * (i % 5)}{A}", "chosen": " a", "rejected": " a a a b"}
            for i in range(16)
        ],
    )
    files["prompts"] = write_jsonl(
        d / "prompts.jsonl", [{"prompt": f"{H} sort b a{A}"}, {"prompt": long_prompt(60)}]
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


def fit_args(tmp: Path, world, *extra: str, steps: int = 2, ckpt_every: int | None = 1) -> list[str]:
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
