"""VLLMEngine against the Hugging Face model it was exported from (real vLLM, CPU build).

Run with ``nox -s vllm`` (or ``pytest -m vllm`` in an environment with the vllm extra). Without
vLLM the module is skipped with the reason, unless ``ALIGNLIT_REQUIRE_VLLM=1`` (set by the nox
session), where a missing vLLM is an error.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

from alignlit.models import export_pretrained, make_tiny_llama
from alignlit.rollout import (
    HFEngine,
    ParityError,
    SamplingParams,
    VLLMEngine,
    check_parity,
    logprob_parity,
)
from tests.conftest import TINY
from tests.helpers import ENGINE_PROMPTS as PROMPTS

pytestmark = pytest.mark.vllm


# Longer than one KV block (128 tokens on CPU), so vLLM's prefix cache holds blocks of it.
LONG_PROMPT = "\n\nHuman: sort " + " ".join("abcdefgh"[i % 8] for i in range(150)) + "\n\nAssistant:"


@pytest.fixture(scope="module")
def policy(tokenizer):
    """The tiny policy, exported with sampling defaults that neither engine may apply.

    If vLLM used them, its processed log-probs (after top-k, penalties, temperature) and its
    samples would differ from the HF model's, failing the parity and agreement tests below.
    """
    model = make_tiny_llama(tokenizer, seed=0, **TINY)
    model.generation_config.update(
        do_sample=True, top_k=3, top_p=0.5, temperature=0.1, repetition_penalty=5.0, max_new_tokens=4
    )
    return model


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tokenizer, policy):
    d = tmp_path_factory.mktemp("vllm") / "policy"
    export_pretrained(policy, tokenizer, d, stage="init")
    return d


@pytest.fixture(scope="module")
def engine(policy_dir, tokenizer):
    return VLLMEngine(policy_dir, tokenizer, max_model_len=256)


def test_generates_with_the_contract_layout(tokenizer, engine):
    n = 2
    r = engine.generate(PROMPTS, n, SamplingParams(temperature=1.0, max_new_tokens=10, seed=0))
    encoded = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len(r) == 6 and r.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    for j in range(6):
        assert r.prompt_ids[j][r.prompt_mask[j]].tolist() == encoded[j // n]
        k = int(r.response_lengths[j])
        assert r.response_mask[j, :k].all() and not r.response_mask[j, k:].any()
        assert (r.logprobs[j, k:] == 0).all() and (r.logprobs[j, :k] < 0).all()
        ends_with_eos = k > 0 and int(r.response_ids[j, k - 1]) == tokenizer.eos_token_id
        assert r.finish_reasons[j] == ("stop" if ends_with_eos else "length")
        assert r.texts[j] == tokenizer.decode(r.response_ids[j, :k].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_the_hf_model(policy, engine, temperature):
    """processed_logprobs with top_k=0, top_p=1 is log_softmax(logits / T): parity to float32 round-off."""
    r = engine.generate(PROMPTS, 2, SamplingParams(temperature=temperature, max_new_tokens=12, seed=1))
    metrics = check_parity(policy, r, temperature=temperature, tol=1e-4, max_samples=len(r))
    assert metrics["num_tokens"] == int(r.response_lengths.sum()) > 0
    assert metrics["max_abs_diff"] < 1e-4


def test_greedy_and_stop_strings_agree_with_hf_engine(tokenizer, policy, engine):
    """Same prompts, greedy, with and without a stop string taken from the middle of a response."""
    hf = HFEngine(tokenizer, policy)
    free = SamplingParams(temperature=0.0, max_new_tokens=16)
    ours, theirs = hf.generate(PROMPTS, 1, free), engine.generate(PROMPTS, 1, free)
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert ours.finish_reasons == theirs.finish_reasons and ours.texts == theirs.texts
    tokens = ours.response_ids[0][ours.response_mask[0]].tolist()
    stop = tokenizer.decode(tokens[3:5])
    cut = SamplingParams(temperature=0.0, max_new_tokens=16, stop=[stop])
    ours, theirs = hf.generate(PROMPTS, 1, cut), engine.generate(PROMPTS, 1, cut)
    assert ours.finish_reasons[0] == "stop" and stop not in ours.texts[0]
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    assert ours.texts == theirs.texts and ours.finish_reasons == theirs.finish_reasons


def test_seeded_calls_reproduce_and_leave_global_rng_alone(engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    a, b = engine.generate(PROMPTS, 2, sampling), engine.generate(PROMPTS, 2, sampling)
    assert torch.equal(torch_state, torch.get_rng_state()) and py_state == random.getstate()
    assert torch.equal(a.response_ids, b.response_ids)
    c = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)
    # Unseeded calls draw fresh seeds from the engine's own stream.
    d = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=8))
    e = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=8))
    assert not torch.equal(d.response_ids, e.response_ids)


def test_truncated_sampling_is_refused_in_processed_mode(engine):
    with pytest.raises(ValueError, match="top_k=5"):
        engine.generate(PROMPTS, 1, SamplingParams(temperature=1.0, top_k=5))


def test_sync_after_optimizer_step_and_stale_engine_detection(tokenizer, policy, engine):
    """An optimizer step moves the policy: the un-synced engine fails parity, a sync restores it.

    The long prompt's first KV block is cached while the engine is stale; a sync must drop it.
    """
    trained = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
    batch = tokenizer(["\n\nHuman: sort b a\n\nAssistant: a b"], return_tensors="pt")
    loss = trained(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    optimizer.step()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    prompts = [LONG_PROMPT, *PROMPTS]
    assert len(tokenizer(LONG_PROMPT)["input_ids"]) > 128

    stale = engine.generate(prompts, 2, sampling)
    assert logprob_parity(trained, stale, temperature=1.0)["max_abs_diff"] > 1e-2
    with pytest.raises(ParityError, match="off-policy"):
        check_parity(trained, stale, temperature=1.0, tol=1e-3)

    pushes = engine.weight_pushes
    engine.sync(trained)
    assert engine.weight_pushes == pushes + 1
    fresh = engine.generate(prompts, 2, sampling)
    assert check_parity(trained, fresh, temperature=1.0, tol=1e-4)["max_abs_diff"] < 1e-4
    with pytest.raises(ParityError):
        check_parity(policy, fresh, temperature=1.0, tol=1e-3)

    engine.sync(policy)  # back to the original weights for the other tests
    check_parity(policy, engine.generate(PROMPTS, 1, sampling), temperature=1.0, tol=1e-4)


def test_sync_every_pushes_on_the_first_and_every_kth_call(policy, engine):
    every, syncs, pushes = engine.sync_every, engine.syncs, engine.weight_pushes
    try:
        engine.sync_every, engine.syncs = 2, 0
        engine.sync(policy)
        engine.sync(policy)
        assert engine.weight_pushes == pushes + 1
        engine.sync(policy)
        assert engine.weight_pushes == pushes + 2
        engine.sync(policy, force=True)
        assert engine.weight_pushes == pushes + 3
    finally:
        engine.sync_every, engine.syncs = every, syncs


def test_sync_rejects_a_wrapper_module(policy, engine):
    wrapper = torch.nn.ModuleDict({"policy": policy})
    with pytest.raises(ValueError, match="lacks"):
        engine.sync(wrapper)


def test_raw_logprobs_mode_reports_untruncated_logprobs_for_top_k_top_p(policy, policy_dir, tokenizer):
    """raw_logprobs = log_softmax(logits): the contract's value at T = 1 even with top-k/top-p sampling."""
    raw = VLLMEngine(policy_dir, tokenizer, logprobs_mode="raw_logprobs", max_model_len=256)
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=12, seed=4)
    r = raw.generate(PROMPTS, 2, sampling)
    assert check_parity(policy, r, temperature=1.0, tol=1e-4, max_samples=len(r))["max_abs_diff"] < 1e-4
    with pytest.raises(ValueError, match="temperature"):
        raw.generate(PROMPTS, 1, SamplingParams(temperature=0.7))


def test_ppo_with_vllm_under_two_processes_matches_one_process(tmp_path, tokenizer):
    """PPO with ``engine: vllm`` under 2-process DDP: rank 0 hosts the one vLLM engine and serves both
    ranks' prompts (gathered, generated, scattered back; weights pushed once per rollout), the parity
    check runs on every rank's share (``parity_every=1``), and the trained weights, the KL coefficient
    and the reward moments equal a one-process run with its own vLLM engine on the same global batch."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.distributed import multiproc_fit

    root = Path(__file__).resolve().parents[2]
    work = tmp_path / "work"
    vllm_tiny = {**TINY, "num_heads": 2, "head_dim": 64}  # vLLM on CPU needs head_dim 64
    multiproc_fit.write_inputs(
        work, tokenizer, lambda seed: make_tiny_llama(tokenizer, seed=seed, **vllm_tiny)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    for strategy in ("single", "ddp"):
        res = subprocess.run(
            [sys.executable, multiproc_fit.__file__, str(work), strategy, str(tmp_path / strategy), "ppo_vllm"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-6000:]
    one = torch.load(tmp_path / "single" / "ppo_vllm" / "weights.pt", weights_only=True)
    many = torch.load(tmp_path / "ddp" / "ppo_vllm" / "weights.pt", weights_only=True)
    assert one.keys() == many.keys()
    worst = max((many[k] - one[k]).abs().max().item() for k in one)
    assert worst <= 2e-3, f"max weight difference {worst:.2e}"
    expected = json.loads((tmp_path / "single" / "ppo_vllm" / "rank-0.json").read_text())
    ranks = [json.loads((tmp_path / "ddp" / "ppo_vllm" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["engine_here"] for r in ranks] == [True, False]  # one engine, on rank 0
    assert ranks[0]["weight_pushes"] == expected["weight_pushes"] == multiproc_fit.ROLLOUTS
    for state in ranks:
        assert state["kl_coef"] == pytest.approx(expected["kl_coef"], rel=1e-6)
        assert state["moments"]["count"] == expected["moments"]["count"] == 2 * multiproc_fit.GLOBAL_BATCH
        assert state["moments"]["mean"] == pytest.approx(expected["moments"]["mean"], rel=1e-5)


def test_async_grpo_on_vllm_loads_each_pinned_version(tmp_path, tokenizer):
    """GRPO with rollout.max_staleness 1 on the vLLM engine: the producer thread loads each version's
    snapshot into vLLM before the batch that needs it (parity checked by a teacher-forced forward of the
    snapshot's weights), the staleness is 0 then 1, and validation on the same engine waits for the producer
    and samples with the live weights."""
    import json

    import lightning as L

    from alignlit.data import PromptDataModule
    from alignlit.modules import Minibatches, Optim, PolicyGradientModule
    from alignlit.rollout import RolloutLoop

    policy_dir = tmp_path / "policy"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer, policy_dir, stage="init")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    module = PolicyGradientModule(
        policy=str(policy_dir), reward=lambda p, r: [x.count("a") - 0.1 * len(x) for x in r],
        optim=Optim(lr=1e-3, min_lr_ratio=1.0), minibatches=Minibatches(size=4),
        rollout=RolloutLoop(engine="vllm", sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=2,
                            max_staleness=1, parity_every=1, parity_tol=1e-3, vllm_args={"max_model_len": 128}),
    )  # fmt: skip
    loads = []
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=3, limit_val_batches=1,
                        val_check_interval=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path)  # fmt: skip
    load_state = VLLMEngine.load_state

    def record(engine, state):
        loads.append({k: v.clone() for k, v in state.items()})
        return load_state(engine, state)

    VLLMEngine.load_state = record
    try:
        trainer.fit(module, PromptDataModule(train_file=str(prompts), val_file=str(prompts), batch_size=2))
    finally:
        VLLMEngine.load_state = load_state
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert [h["async/staleness_max"] for h in train] == [0, 1, 1]
    assert len(loads) >= 3 and any("val/reward" in h for h in module.progress.history)
    parity = [h["rollout/parity_max_abs_diff"] for h in train if "rollout/parity_max_abs_diff" in h]
    assert len(parity) >= 2 and max(parity) < 1e-3  # each loaded version checked on its first batch
    assert module.rollout.async_engine is None  # stopped at the end of fit
