"""Models by Hugging Face hub id, through a real offline hub cache (tests/hubcache.py; nothing mocked)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignlit.cli import main as cli_main
from alignlit.data import PreferenceDataModule, SFTDataModule
from alignlit.hub import ModelNotFoundError, Pretrained, RemoteCodeError
from alignlit.models import (
    ExportDirError,
    check_export_dir,
    load_policy,
    load_scalar_model,
    load_tokenizer,
    read_metadata,
)
from alignlit.models.loading import model_source
from alignlit.modules import DPOModule, Minibatches, Optim, PPOModule, SFTModule
from alignlit.rollout import RolloutLoop, SamplingParams
from tests.hubcache import (
    CHATML_TEMPLATE,
    DEFAULT_SYSTEM,
    IM_END,
    PAD,
    QWEN,
    hub_env,
    make_hub_cache,
    repo_folder,
    snapshot_dir,
    write_snapshot,
)

MESSAGES = [
    {"role": "user", "content": "Natalia sold 48 clips in April. How many in May?"},
    {"role": "assistant", "content": "She sold 48/2 = 24 clips in May.\n#### 24"},
    {"role": "user", "content": "And altogether?"},
]


# ---------------------------------------------------------------------------------------- the fixture
def test_cache_layout_resolves_offline_through_huggingface_hub(hub_cache):
    """The layout the fixture writes is what huggingface_hub and transformers resolve offline."""
    folder = hub_cache / "models--Qwen--Qwen2.5-0.5B-Instruct"
    commit = (folder / "refs" / "main").read_text()
    assert len(commit) == 40 and int(commit, 16) >= 0
    snap = snapshot_download(QWEN, cache_dir=hub_cache, local_files_only=True)
    assert snap == str(folder / "snapshots" / commit) == str(snapshot_dir(hub_cache))
    assert snapshot_download(QWEN, cache_dir=hub_cache, local_files_only=True, revision=commit) == snap
    model = AutoModelForCausalLM.from_pretrained(QWEN)  # HF_HUB_CACHE and HF_HUB_OFFLINE from the fixture
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings and model.config.head_dim == 64
    assert model.config.vocab_size % 128 == 0
    tok = AutoTokenizer.from_pretrained(QWEN)
    assert len(tok) < model.config.vocab_size  # padded embedding, as Qwen2.5's
    assert (tok.pad_token, tok.eos_token) == (PAD, IM_END)
    assert model.config.eos_token_id == tok.eos_token_id


def test_second_repo_id_in_the_same_cache(hub_cache):
    make_hub_cache(hub_cache, "OpenRLHF/tiny-rm", seed=1, head="sequence_classification")
    a = snapshot_dir(hub_cache, QWEN)
    b = snapshot_dir(hub_cache, "OpenRLHF/tiny-rm")
    assert a.name != b.name and (b / "config.json").is_file()
    assert '"Qwen2ForSequenceClassification"' in (b / "config.json").read_text()


def test_chatml_template_ids_equal_the_rendered_text_encoded(hub_cache):
    tok = AutoTokenizer.from_pretrained(QWEN)
    assert tok.chat_template == CHATML_TEMPLATE
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{MESSAGES[0]['content']}<|im_end|>\n"
        f"<|im_start|>assistant\n{MESSAGES[1]['content']}<|im_end|>\n"
        f"<|im_start|>user\n{MESSAGES[2]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok(text, add_special_tokens=False).input_ids
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", IM_END])
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4  # special tokens are single ids
    system = [{"role": "system", "content": "Be brief."}, MESSAGES[0]]
    assert tok.apply_chat_template(system, tokenize=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    )
    assert tok.decode(tok("48/2 = 24").input_ids) == "48/2 = 24"


def test_tiny_qwen_generates(hub_cache):
    tok = AutoTokenizer.from_pretrained(QWEN)
    model = AutoModelForCausalLM.from_pretrained(QWEN, dtype=torch.float32)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    n = ids["input_ids"].shape[1]
    assert n < out.shape[1] <= n + 4


# ---------------------------------------------------------------------------------------- alignlit's loaders
def _commit(root, repo_id=QWEN, ref="main") -> str:
    return (repo_folder(root, repo_id) / "refs" / ref).read_text()


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


def test_policy_scalar_model_and_tokenizer_load_by_hub_id(hub_cache):
    snap = snapshot_dir(hub_cache)
    reference = AutoModelForCausalLM.from_pretrained(str(snap), dtype=torch.float32)
    model, tok = load_policy(QWEN)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert _same_weights(model, reference)
    assert (tok.eos_token, tok.pad_token) == (IM_END, PAD) and tok.chat_template == CHATML_TEMPLATE
    assert model_source(model) == {
        "spec": QWEN,
        "dir": str(snap),
        "hub_id": QWEN,
        "revision": _commit(hub_cache),
    }

    rm, rm_tok = load_scalar_model(QWEN, head="fresh")  # a backbone with a fresh scalar head
    assert type(rm.hf_model).__name__ == "Qwen2ForSequenceClassification"
    assert torch.equal(rm.hf_model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert rm.hf_model.score.weight.shape == (1, 128)
    assert rm_tok.get_vocab() == tok.get_vocab()

    tok2 = load_tokenizer(QWEN)
    assert tok2.get_vocab() == tok.get_vocab() and tok2.pad_token == PAD


def test_revision_by_ref_name_and_by_commit(hub_cache):
    main = _commit(hub_cache)
    make_hub_cache(hub_cache, QWEN, seed=1, refs=("v2",))  # another commit of the same id, on a branch
    v2 = _commit(hub_cache, ref="v2")
    assert v2 != main and _commit(hub_cache) == main
    seed0 = load_policy(QWEN)[0]
    seed1 = load_policy(f"{QWEN}@v2")[0]
    assert not _same_weights(seed0, seed1)
    assert model_source(seed1)["revision"] == v2
    assert _same_weights(load_policy(QWEN, revision=v2)[0], seed1)  # the commit hash
    assert _same_weights(load_policy(f"{QWEN}@{main}")[0], seed0)
    pinned = load_policy(Pretrained(QWEN, revision="v2", attn_implementation="eager"))[0]
    assert _same_weights(pinned, seed1) and pinned.config._attn_implementation == "eager"
    assert model_source(load_scalar_model(f"{QWEN}@v2")[0])["revision"] == v2
    with pytest.raises(ValueError, match="two revisions given, 'v2' in the id and 'main'"):
        load_policy(f"{QWEN}@v2", revision="main")


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
    return text


def test_missing_hub_id_is_one_line_naming_the_id_and_what_to_do(hub_cache):
    with pytest.raises(ModelNotFoundError) as info:
        load_policy("NoSuchOrg/x")
    assert _one_line(info.value) == (
        f"policy 'NoSuchOrg/x': not found in the local Hugging Face cache ({hub_cache}) and HF_HUB_OFFLINE=1; "
        "download it once with network (`hf download NoSuchOrg/x`) or give a local directory"
    )
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(ModelNotFoundError) as info:
        load_scalar_model(f"{QWEN}@v9")
    assert "revision 'v9' not found in the local Hugging Face cache" in _one_line(info.value)
    assert "(cached: main)" in str(info.value) and f"`hf download {QWEN} --revision v9`" in str(info.value)
    with pytest.raises(ModelNotFoundError, match="tokenizer 'NoSuchOrg/x': not found"):
        load_tokenizer("NoSuchOrg/x")


@pytest.mark.parametrize("spec", ["./missing/dir", "/abs/missing", "missing"])
def test_a_path_that_is_no_hub_id_keeps_the_directory_message(hub_cache, spec):
    with pytest.raises(FileNotFoundError) as info:
        load_policy(spec)
    assert type(info.value) is FileNotFoundError
    assert (
        str(info.value)
        == f"policy '{spec}' is not a directory, nor a Hugging Face hub id (org/name[@revision])"
    )


def test_sample_with_a_missing_hub_id_exits_in_one_line(hub_cache, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2+3?"}) + "\n")
    argv = [
        "sample",
        "--policy",
        "NoSuchOrg/x",
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o.jsonl"),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "alignlit.cli", *argv], env=hub_env(hub_cache), capture_output=True, text=True
    )
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip() == (
        f"alignlit sample: policy 'NoSuchOrg/x': not found in the local Hugging Face cache ({hub_cache}) and "
        "HF_HUB_OFFLINE=1; download it once with network (`hf download NoSuchOrg/x`) or give a local directory"
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_sample_by_hub_id(hub_cache, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2+3?"}) + "\n")
    out = tmp_path / "o.jsonl"
    groups = cli_main(["sample", "--policy", QWEN, "--prompts", str(prompts), "--out", str(out), "--n", "2",
                       "--max-new-tokens", "3", "--no-progress"])  # fmt: skip
    assert len(groups) == 1 and len(groups[0].responses) == 2 and out.is_file()


def test_model_that_needs_its_own_code_is_refused_naming_the_flag(hub_cache, tmp_path):
    custom = tmp_path / "custom"
    shutil.copytree(snapshot_dir(hub_cache), custom)
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (custom / "config.json").unlink()  # a symbolic link into the blobs: replace it, not its target
    (custom / "config.json").write_text(json.dumps(config))
    write_snapshot(hub_cache, "Custom/remote", custom)
    for load in (load_policy, load_scalar_model):
        with pytest.raises(RemoteCodeError) as info:
            load("Custom/remote")
        assert "modeling_custom.CustomForCausalLM" in _one_line(info.value)
        assert "trust_remote_code: true" in str(info.value) and "'Custom/remote'" in str(info.value)
    with pytest.raises(RemoteCodeError):
        load_policy(str(custom))  # a local directory too
    assert load_tokenizer("Custom/remote").eos_token == IM_END  # its tokenizer needs no code


# ---------------------------------------------------------------------------------------- exports
def _sft_data(tmp_path, n=12):
    f = tmp_path / "sft.jsonl"
    f.write_text(
        "".join(json.dumps({"prompt": f"What is {i}+1?", "response": f" {i + 1}"}) + "\n" for i in range(n))
    )
    return f


def _fit(module, tmp_path, steps=2):
    dm = SFTDataModule(str(_sft_data(tmp_path)), batch_size=4, val_fraction=0.0, seed=0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, dm)
    return trainer


def test_export_records_the_hub_source_and_revision(hub_cache, tmp_path):
    out = tmp_path / "sft"
    module = SFTModule(policy=QWEN, optim=Optim(lr=1e-3, warmup_steps=1), export_dir=str(out))
    _fit(module, tmp_path)
    meta = read_metadata(out)
    assert meta["source"] == {"spec": QWEN, "hub_id": QWEN, "revision": _commit(hub_cache)}
    model, tok = load_policy(out)  # the export is a plain directory again
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.chat_template == CHATML_TEMPLATE
    assert model_source(model) == {"spec": str(out), "dir": str(out)}
    nxt = tmp_path / "sft2"
    SFTModule(policy=str(out)).export(nxt)  # a local start records its path, no hub fields
    assert read_metadata(nxt)["source"] == {"spec": str(out)}


@pytest.mark.parametrize("role", ["policy", "reference"])
def test_export_onto_an_input_directory_is_refused_before_training(hub_cache, tmp_path, role):
    start = tmp_path / "start"
    SFTModule(policy=QWEN).export(start)  # an alignlit export: check_export_dir alone would replace it
    before = (start / "model.safetensors").read_bytes()
    if role == "policy":
        module = SFTModule(policy=str(start), export_dir=str(start))
    else:
        module = DPOModule(policy=QWEN, reference=str(start), export_dir=str(start))
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False)
    with pytest.raises(ExportDirError) as info:
        trainer.fit(module, SFTDataModule(str(_sft_data(tmp_path)), batch_size=4, val_fraction=0.0))
    assert str(info.value) == (
        f"export_dir '{start}' is the {role} directory '{start}' this stage starts from: the export would "
        f"replace the {role} it is trained from; choose another export_dir"
    )
    assert trainer.global_step == 0 and (start / "model.safetensors").read_bytes() == before


def test_export_around_an_input_directory_is_refused(tmp_path):
    inner = tmp_path / "runs" / "sft"
    inner.mkdir(parents=True)
    with pytest.raises(ExportDirError, match=r"export_dir '.*runs' holds the policy directory '.*runs/sft'"):
        check_export_dir(tmp_path / "runs", inputs={"policy": inner})
    assert check_export_dir(tmp_path / "other", inputs={"policy": inner}) == tmp_path / "other"


# ---------------------------------------------------------------------------------------- stages
def test_dpo_by_hub_id_precomputes_its_reference_from_the_snapshot(hub_cache, tmp_path):
    """The reference defaults to the policy (a hub id): its cached log-probs are keyed by the snapshot's files."""
    f = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"What is {i}+1?", "chosen": f" {i + 1}", "rejected": f" {i + 7}"} for i in range(8)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = DPOModule(policy=QWEN, optim=Optim(lr=1e-4, warmup_steps=1), export_dir=str(tmp_path / "dpo"))
    dm = PreferenceDataModule(str(f), batch_size=4, val_fraction=0.0)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, dm)
    assert module.reference_cache_status == "miss" and module.reference_cache_path.is_file()
    assert read_metadata(tmp_path / "dpo")["source"]["revision"] == _commit(hub_cache)


def test_ppo_by_hub_id_with_a_reward_model_by_hub_id(hub_cache):
    make_hub_cache(hub_cache, "OpenRLHF/tiny-rm", seed=1, head="sequence_classification")
    module = PPOModule(
        policy=QWEN,
        reward="OpenRLHF/tiny-rm",
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=3)),
        minibatches=Minibatches(size=2),
    )
    assert module._policy_dir == module._tokenizer_dir == str(snapshot_dir(hub_cache))
    rm_dir = snapshot_dir(hub_cache, "OpenRLHF/tiny-rm")
    assert model_source(module.reward_model)["dir"] == str(rm_dir)
    assert model_source(module.critic)["dir"] == str(rm_dir)  # the critic starts from the reward model
    module.rollout.setup(module.policy, module.tokenizer, policy_dir=module._policy_dir)
    exp = module.rollout.collect(["What is 2+3?", "What is 4+4?"], module.reward)
    assert exp.rollout.response_ids.shape[0] == 2 and torch.isfinite(exp.rewards).all()


def test_alignlit_fit_with_a_pinned_pretrained_in_yaml(hub_cache, tmp_path):
    """The user's path: `alignlit fit` in a subprocess, the model named by hub id and revision in YAML."""
    main = _commit(hub_cache)
    make_hub_cache(hub_cache, QWEN, seed=1, refs=("v2",))
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"""
trainer: {{accelerator: cpu, max_steps: 1, logger: false, enable_checkpointing: false,
           enable_progress_bar: false, default_root_dir: {tmp_path / "runs"}}}
model:
  class_path: alignlit.modules.SFTModule
  init_args:
    policy:
      class_path: alignlit.models.Pretrained
      init_args: {{path: {QWEN}, revision: {main}, attn_implementation: eager}}
    optim: {{lr: 1.0e-3, warmup_steps: 1}}
    export_dir: {tmp_path / "out"}
data:
  class_path: alignlit.data.SFTDataModule
  init_args: {{train_file: {_sft_data(tmp_path)}, batch_size: 4, val_fraction: 0.0}}
"""
    )
    run = subprocess.run(
        [sys.executable, "-m", "alignlit.cli", "fit", "--config", str(config)],
        env=hub_env(hub_cache), capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert read_metadata(tmp_path / "out")["source"] == {
        "spec": f"{QWEN}@{main}",
        "hub_id": QWEN,
        "revision": main,
    }


def test_a_snapshot_without_safetensors_is_refused_naming_what_it_holds(hub_cache, tmp_path):
    bin_only = tmp_path / "bin_only"
    shutil.copytree(snapshot_dir(hub_cache), bin_only)
    (bin_only / "model.safetensors").unlink()
    (bin_only / "pytorch_model.bin").write_bytes(b"pickled")  # a .bin-only repo (online, never downloaded)
    write_snapshot(hub_cache, "Old/pickled", bin_only)
    with pytest.raises(
        ModelNotFoundError, match=r"policy 'Old/pickled': its snapshot .* has no \*\.safetensors"
    ):
        load_policy("Old/pickled")


def test_pretrained_survives_a_weights_only_checkpoint_load(tmp_path):
    spec = Pretrained(QWEN, revision="v2", attn_implementation="sdpa")
    torch.save({"hyper_parameters": {"policy": spec}}, tmp_path / "c.ckpt")
    assert torch.load(tmp_path / "c.ckpt", weights_only=True)["hyper_parameters"]["policy"] == spec
    assert str(spec) == f"{QWEN}@v2"


def _digit_reward(prompts, responses):
    return [float(sum(c.isdigit() for c in r)) for r in responses]


def test_async_grpo_by_hub_id(hub_cache, tmp_path):
    """max_staleness 1 with a hub-id policy; the stage's policy directory (what the vLLM engine is built
    from, RolloutLoop.setup) is the snapshot in the cache, not the id."""
    from alignlit.data import PromptDataModule
    from alignlit.modules import PolicyGradientModule

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?"}) + "\n" for i in range(8)))
    module = PolicyGradientModule(
        policy=QWEN, reward=_digit_reward, optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=4), samples_per_prompt=2, max_staleness=1),
        minibatches=Minibatches(size=4),
    )  # fmt: skip
    assert module._policy_dir == str(snapshot_dir(hub_cache))
    trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, PromptDataModule(train_file=str(prompts), batch_size=2))
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert len(train) == 3 and [h["async/staleness_max"] for h in train] == [0, 1, 1]


def test_an_adapter_export_of_a_hub_model_loads_where_the_cache_has_moved(hub_cache, tmp_path, monkeypatch):
    """A LoRA adapter trained from a hub model names its base by the snapshot's path; on a machine whose cache
    is elsewhere, the base resolves again by the hub id and commit that path encodes."""
    from alignlit.models.lora import LoRA

    out = tmp_path / "adapter"
    module = SFTModule(policy=QWEN, lora=LoRA(rank=4, export="adapter"), optim=Optim(lr=1e-2, warmup_steps=1))
    with torch.no_grad():  # a non-zero adapter, so the merged model differs from the base
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    module.export(out)
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(snapshot_dir(hub_cache))
    expected = load_policy(out)[0]
    moved = tmp_path / "moved-cache"
    shutil.copytree(hub_cache, moved, symlinks=True)
    shutil.rmtree(hub_cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(moved))
    model, tok = load_policy(out)
    assert _same_weights(model, expected) and tok.eos_token == IM_END


def test_a_missing_relative_directory_that_looks_like_an_id_says_both(hub_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()  # `out/sft` was meant as the output of a stage that has not run
    with pytest.raises(ModelNotFoundError) as info:
        load_policy("out/sft")
    assert _one_line(info.value).startswith(
        "policy 'out/sft': there is no directory out/sft, and not found in the local Hugging Face cache"
    )
