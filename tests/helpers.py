"""Plain values and small functions the tests share (fixtures are in the conftest.py files).

Tests compute expectations by hand from these values: change one and the tests that use it change too.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

OPS = ("sort", "reverse", "copy", "dedupe")

# Logged metrics that hold wall-clock times: they differ between two otherwise identical runs.
TIMING = ("time/", "rollout/sync_s", "rollout/generate_s", "rollout/tokens_per_s", "rollout/score_s")


def op_prompts(n: int, ops: tuple[str, ...] = OPS) -> list[str]:
    """``n`` HH-style prompts: prompt ``i`` applies ``ops[i % len(ops)]`` to three letters starting at
    letter ``i`` (``sort a b c``, ``reverse b c d``, ``copy c d e``, ...)."""
    return [
        f"\n\nHuman: {ops[i % len(ops)]} {' '.join('abcdefgh'[(i + j) % 8] for j in range(3))}\n\nAssistant:"
        for i in range(n)
    ]


# The online stages' prompts: two of each operation.
OP_PROMPTS = op_prompts(8)
# Three prompts of different lengths (3, 1 and 5 letters), for the rollout engines.
ENGINE_PROMPTS = [
    "\n\nHuman: sort a b c\n\nAssistant:",
    "\n\nHuman: copy d\n\nAssistant:",
    "\n\nHuman: reverse h g f e d\n\nAssistant:",
]
# Two prompts of different lengths, for the rollout pipeline and the engine options.
TWO_PROMPTS = ["\n\nHuman: sort c a b\n\nAssistant:", "\n\nHuman: copy d\n\nAssistant:"]
# Three short prompts, for the quickstart and evaluation helpers.
EVAL_PROMPTS = [
    "\n\nHuman: sort c a\n\nAssistant:",
    "\n\nHuman: copy b d\n\nAssistant:",
    "\n\nHuman: reverse a b\n\nAssistant:",
]


def char_reward(prompts, responses):
    """Reward = number of 'a' characters minus a tenth of the length (cheap, deterministic)."""
    return [r.count("a") - 0.1 * len(r) for r in responses]


def n_chars(prompts, responses):
    """Reward = the response's length in characters."""
    return [float(len(r)) for r in responses]


def write_jsonl(path: Path, rows) -> Path:
    """One JSON object a line; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_sft_file(directory: Path, n: int) -> Path:
    """``directory/sft.jsonl``: ``n`` prompt/response rows (``sort a c`` -> `` b c ok``, ops and letters cycling)."""
    ops = ["sort", "reverse", "copy"]
    rows = [
        {
            "prompt": f"\n\nHuman: {ops[i % 3]} {'abcdefgh'[i % 8]} c\n\nAssistant:",
            "response": f" {'abcdefgh'[(i + 1) % 8]} c ok",
        }
        for i in range(n)
    ]
    return write_jsonl(directory / "sft.jsonl", rows)


def fit_on_prompts(
    module,
    data_dir,
    tmp_path,
    *,
    rollouts,
    batch_size=4,
    ckpt_path=None,
    checkpoint_every=None,
    val_batches=0,
    epochs=2,
    callbacks=(),
):
    """``trainer.fit`` of an online stage on ``data_dir/prompts.jsonl`` (a quarter for validation) for
    ``rollouts`` rollouts over ``epochs`` epochs, on CPU, without logger or progress bar; with
    ``checkpoint_every``, a checkpoint every that many steps in ``tmp_path/ckpt``."""
    import lightning as L

    from alignlit.data import PromptDataModule

    callbacks = list(callbacks)
    if checkpoint_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt",
                every_n_train_steps=checkpoint_every,
                save_top_k=-1,
                save_last=False,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        limit_train_batches=rollouts // epochs,
        limit_val_batches=val_batches,
        val_check_interval=1.0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tmp_path,
    )
    dm = PromptDataModule(
        train_file=str(data_dir / "prompts.jsonl"), val_fraction=0.25, batch_size=batch_size
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def assert_names_the_change(
    error: BaseException, library: str, internal: str, *, distribution: str = ""
) -> None:
    """``error``, a quarantine module's ``*InternalsChanged``, names ``internal``, the installed version of
    ``library`` (an import name) and the range of ``distribution`` (default: ``library``) alignlit pins."""
    message, version = str(error), importlib.import_module(library).__version__
    assert internal in message and f"{library} {version}:" in message, message
    pinned = rf"install the pinned {re.escape(distribution or library)}(\[[\w,]+\])?[<>=!~]"
    assert re.search(pinned, message), f"no pinned range named: {message}"
