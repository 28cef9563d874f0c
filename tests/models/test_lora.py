"""LoRA through PEFT: the config group, the reference as the base model with the adapter disabled (one
copy of the base weights, measured), merged and adapter-only exports, reward models and PPO's critic,
only the adapter training, the vLLM weight sync's merged names, exact resume, the presets."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from alignlit.data import PreferenceDataModule, SFTDataModule
from alignlit.models import load_policy, load_reward_model, load_scalar_model
from alignlit.models.forward import sequence_scores, token_logprobs
from alignlit.models.lora import (
    AdapterDisabled,
    LoRA,
    adapters_disabled,
    has_lora,
    merged_state_dict,
    parameter_bytes,
)
from alignlit.models.state_dict import full_state_dict
from alignlit.modules import DPOModule, Minibatches, Optim, PPOModule, RewardModule, SFTModule
from alignlit.rollout import RolloutLoop, SamplingParams
from tests.modules.test_dpo import _Killed, _pairs_file, _Record

LORA = LoRA(rank=4, alpha=8.0)


def _perturb_adapter(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every adapter factor random values (B starts at 0, which would make every check trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _batch(n: int = 3, t: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (n, t), generator=g)  # (N, T)
    attention = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 4:] = True
    return ids, attention, loss_mask


def _logps(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, *batch).logprobs  # (N, T-1)


def test_config_is_checked_naming_the_field(tiny_policy_dir):
    for kwargs, field in (
        ({"rank": 0}, "lora.rank"),
        ({"alpha": 0}, "lora.alpha"),
        ({"dropout": 1.0}, "lora.dropout"),
        ({"target_modules": []}, "lora.target_modules"),
        ({"export": "both"}, "lora.export"),
    ):
        with pytest.raises(ValueError, match=field):
            LoRA(**kwargs)
    for target, why in (("lm_head", "LM head"), ("attn_q", "no module has that name")):
        with pytest.raises(ValueError, match=rf"lora.target_modules: '{target}'.*{why}.*q_proj"):
            SFTModule(str(tiny_policy_dir), lora=LoRA(target_modules=(target,)))


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(tiny_policy_dir):
    module = SFTModule(str(tiny_policy_dir), lora=LORA)
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    # 2 layers x 7 projections x (A, B)
    assert len(trainable) == 28 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = module.configure_optimizers()["optimizer"]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 28
    # B = 0 at the start: the adapted model is the base model
    base, _ = load_policy(tiny_policy_dir)
    batch = _batch()
    torch.testing.assert_close(_logps(module.policy, batch), _logps(base, batch), rtol=0, atol=1e-6)


def test_reference_is_the_base_model_with_the_adapter_disabled(tiny_policy_dir):
    """DPO and PPO with LoRA keep no second copy of the base weights: the reference registers no
    parameters, its log-probs are the base model's (the policy's differ once the adapter moved), and the
    weights the module holds are base + adapter, where full fine-tuning holds two copies."""
    base, _ = load_policy(tiny_policy_dir)
    base_bytes = parameter_bytes(base)
    batch = _batch()

    dpo = DPOModule(str(tiny_policy_dir), lora=LORA, precompute_reference=False)
    reference = dpo.reference_model
    assert isinstance(reference, AdapterDisabled)
    assert not list(reference.named_parameters())
    assert {k for k in dpo.state_dict() if not k.startswith("val_metrics.")} == {
        f"policy.{k}" for k in dpo.policy.state_dict()
    }
    _perturb_adapter(dpo.policy)
    assert (_logps(dpo.policy, batch) - _logps(base, batch)).abs().max() > 1e-2
    torch.testing.assert_close(_logps(reference, batch), _logps(base, batch), rtol=0, atol=1e-6)
    # the adapter is back on after the reference's forward, and still trainable
    assert (_logps(dpo.policy, batch) - _logps(base, batch)).abs().max() > 1e-2
    assert sum(p.requires_grad for p in dpo.policy.parameters()) == 28

    adapter_bytes = sum(p.numel() * p.element_size() for p in dpo.policy.parameters() if p.requires_grad)
    held = parameter_bytes(dpo, *dpo._reference)
    assert held == base_bytes + adapter_bytes
    full = DPOModule(str(tiny_policy_dir), precompute_reference=False)
    assert parameter_bytes(full, *full._reference) == 2 * base_bytes

    ppo = PPOModule(str(tiny_policy_dir), reward=lambda p, r: [0.0] * len(r), lora=LORA)
    assert isinstance(ppo.reference, AdapterDisabled)
    assert not any(k.startswith("reference.") for k in ppo.state_dict())
    assert ppo.frozen_prefixes() == []
    critic_bytes = parameter_bytes(ppo.critic)
    assert parameter_bytes(ppo) == base_bytes + adapter_bytes + critic_bytes
    full_ppo = PPOModule(str(tiny_policy_dir), reward=lambda p, r: [0.0] * len(r))
    assert parameter_bytes(full_ppo) == 2 * base_bytes + parameter_bytes(full_ppo.critic)


def test_adapter_disabled_leaves_the_policy_alone(tiny_policy_dir):
    module = SFTModule(str(tiny_policy_dir), lora=LORA)
    module.policy.train()
    view = AdapterDisabled(module.policy)
    view.requires_grad_(False).eval()
    view.zero_grad()
    assert module.policy.training and not view.training
    assert sum(p.requires_grad for p in module.policy.parameters()) == 28
    with pytest.raises(TypeError, match="moving reference needs full fine-tuning"):
        view.load_state_dict(module.policy.state_dict())
    base, _ = load_policy(tiny_policy_dir)
    assert view.state_dict().keys() == base.state_dict().keys()
    with pytest.raises(ValueError, match="no LoRA adapter"):
        AdapterDisabled(base)
    with adapters_disabled(base):  # a model without LoRA is unchanged
        pass


def test_merged_and_adapter_exports_load_as_the_trained_policy(tmp_path, tiny_policy_dir):
    from peft import PeftModel

    batch = _batch()
    for mode in ("merged", "adapter"):
        module = SFTModule(str(tiny_policy_dir), lora=LoRA(rank=4, alpha=8.0, export=mode))
        _perturb_adapter(module.policy)
        expected = _logps(module.policy, batch)
        out = module.export(tmp_path / mode)
        files = {p.name for p in out.iterdir()}
        if mode == "merged":
            assert "config.json" in files and "adapter_config.json" not in files
            weights = load_file(str(out / "model.safetensors"))
            assert weights.keys() == load_file(str(tiny_policy_dir / "model.safetensors")).keys()
        else:
            assert {"adapter_config.json", "adapter_model.safetensors", "alignlit.json"} <= files
            assert "config.json" not in files
            config = json.loads((out / "adapter_config.json").read_text())
            assert (config["r"], config["lora_alpha"]) == (4, 8.0)
            assert config["base_model_name_or_path"] == str(tiny_policy_dir)
            peft_model = PeftModel.from_pretrained(load_policy(tiny_policy_dir)[0], str(out))
            torch.testing.assert_close(_logps(peft_model, batch), expected, rtol=0, atol=1e-5)
        loaded, _ = load_policy(out)
        assert not has_lora(loaded)
        torch.testing.assert_close(_logps(loaded, batch), expected, rtol=0, atol=1e-5)


def test_reward_model_with_lora_trains_its_head_and_exports_both_ways(tmp_path, tiny_policy_dir):
    ids, attention, _ = _batch()
    for mode in ("merged", "adapter"):
        module = RewardModule(
            str(tiny_policy_dir), lora=LoRA(rank=4, alpha=8.0, export=mode), histogram=False
        )
        trainable = [n for n, p in module.rm.named_parameters() if p.requires_grad]
        assert "hf_model.score.modules_to_save.default.weight" in trainable
        assert all(".lora_" in n or "score.modules_to_save" in n for n in trainable)
        _perturb_adapter(module.rm)
        with torch.no_grad():
            module.rm.hf_model.score.modules_to_save["default"].weight.normal_(0, 0.5)
            expected = sequence_scores(module.rm, ids, attention)
        out = module.export(tmp_path / mode)
        scorer, _ = load_scalar_model(out, head="trained")
        with torch.no_grad():  # merging W + BA reorders float32 sums: rounding-level differences only
            torch.testing.assert_close(scorer(ids, attention), expected, rtol=1e-5, atol=5e-5)
        assert load_reward_model(str(out)) is not None


def test_ppo_critic_adapter_switch(tiny_policy_dir):
    reward = lambda p, r: [0.0] * len(r)  # noqa: E731
    with_adapter = PPOModule(str(tiny_policy_dir), reward=reward, lora=LORA)
    assert has_lora(with_adapter.critic) and has_lora(with_adapter.policy)
    full_critic = PPOModule(str(tiny_policy_dir), reward=reward, lora=LORA, critic_adapter=False)
    assert not has_lora(full_critic.critic)
    assert all(p.requires_grad for p in full_critic.critic.parameters())
    optimizers = full_critic.configure_optimizers()
    counts = [sum(len(g["params"]) for g in o["optimizer"].param_groups) for o in optimizers]
    assert counts == [28, len(list(full_critic.critic.parameters()))]


def test_vllm_sync_sends_merged_weights_under_checkpoint_names(tiny_policy_dir):
    """The vLLM engine loads the exported (merged) names; a LoRA policy's live weights are merged into
    them for every sync (no vLLM needed to check the tensors sent)."""
    module = SFTModule(str(tiny_policy_dir), lora=LORA)
    _perturb_adapter(module.policy)
    state = full_state_dict(module.policy, "cpu", merge_lora=True)
    assert state.keys() == load_file(str(tiny_policy_dir / "model.safetensors")).keys()
    merged = merged_state_dict(module.policy)
    for key, value in state.items():
        assert torch.equal(value, merged[key])
    q = "model.layers.0.self_attn.q_proj"
    layer = module.policy.get_submodule(q)
    expected = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(state[f"{q}.weight"], expected)


@pytest.mark.slow
def test_lora_dpo_resume_is_exact(tmp_path, tiny_policy_dir):
    """LoRA DPO (reference = the base with the adapter disabled, computed every step): stopped after the
    step-2 checkpoint and resumed from it, the losses of steps 3-6 and the final adapter are
    bit-identical to an uninterrupted run, and the base weights never moved."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = _pairs_file(tmp_path / "data" / "pairs.jsonl")

    def run(ckpt_dir, record, ckpt_path=None) -> DPOModule:
        L.seed_everything(0)
        module = DPOModule(
            str(tiny_policy_dir), beta=0.5, lora=LORA, precompute_reference=False,
            optim=Optim(lr=1e-2, warmup_steps=2),
        )  # fmt: skip
        trainer = L.Trainer(
            max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0,
            callbacks=[record, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)],
        )  # fmt: skip
        dm = PreferenceDataModule(
            str(data), val_fraction=0.0, max_length=32, max_prompt_length=16, batch_size=2, seed=0
        )
        trainer.fit(module, dm, ckpt_path=ckpt_path)
        return module

    full = _Record()
    straight = run(tmp_path / "a", full)
    with pytest.raises(_Killed):
        run(tmp_path / "b", _Record(crash_at=3))
    resumed_record = _Record()
    resumed = run(tmp_path / "b", resumed_record, ckpt_path=str(tmp_path / "b" / "epoch=0-step=2.ckpt"))
    assert [step for step, _ in full.losses] == [1, 2, 3, 4, 5, 6]
    assert resumed_record.losses == full.losses[2:]
    for (name, p), q in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(p, q), name
    base = load_policy(tiny_policy_dir)[0].state_dict()
    moved = merged_state_dict(straight.policy)
    assert all(torch.equal(v, base[k]) for k, v in AdapterDisabled(straight.policy).state_dict().items())
    assert max((moved[k] - base[k]).abs().max().item() for k in base) > 1e-3


def test_lora_sft_fit_moves_only_the_adapter(tmp_path, tokenizer_dir, tiny_policy_dir):
    rows = [{"prompt": f"\n\nHuman: copy {c}\n\nAssistant:", "response": f" {c}"} for c in "abcdefgh"]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = SFTModule(str(tiny_policy_dir), lora=LORA, optim=Optim(lr=1e-2, warmup_steps=0))
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(
        module, SFTDataModule(str(data), val_fraction=0.0, max_length=24, max_prompt_length=16, batch_size=4)
    )
    after = module.policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert any(".lora_B." in k for k in changed)


def test_ppo_with_lora_runs_a_rollout(tmp_path, tiny_policy_dir):
    """One PPO rollout with LoRA on the policy and the critic: the reference's log-probs are the base
    model's, only adapters (and the value head) move."""
    from alignlit.data import PromptDataModule

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"\n\nHuman: copy {c} a\n\nAssistant:"}) + "\n" for c in "abcd")
    )
    module = PPOModule(
        str(tiny_policy_dir),
        reward=lambda p, r: [float(len(x)) for x in r],
        lora=LORA,
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=4)),
        minibatches=Minibatches(size=4),
        optim=Optim(lr=1e-2, min_lr_ratio=1.0),
        critic_optim=Optim(lr=1e-2, min_lr_ratio=1.0),
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=1, limit_val_batches=0, num_sanity_val_steps=0,
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(train_file=str(prompts), val_fraction=0.0, batch_size=4))
    assert module.progress.history and "kl/ref" in module.progress.history[-1]
    changed = {k for k, v in module.policy.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all(".lora_" in k for k in changed)
