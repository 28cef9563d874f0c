"""``rollout.hf``: the HF engine's options (KV cache, compiled step, shared prompt) reach every engine a stage
builds (the trainer's, one sampling a frozen model, the asynchronous worker process's), parse from YAML and
the command line, and are refused with another engine."""

from __future__ import annotations

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from alignlit.models import make_tiny_llama
from alignlit.rollout import HFEngine, HFEngineOptions, RolloutLoop, SamplingParams
from tests.conftest import TINY
from tests.helpers import TWO_PROMPTS as PROMPTS
from tests.test_configs import CONFIG_DIR, ParseOnly

STATIC_SHARED = HFEngineOptions(kv_cache="static", share_prompt=True)


def options_of(engine) -> HFEngineOptions:
    return HFEngineOptions(engine.kv_cache, engine.compile, engine.share_prompt)


def same_samples(a, b) -> bool:
    return torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return make_tiny_llama(tokenizer, seed=0, **TINY)


def test_the_default_is_the_dynamic_cache(tokenizer, policy):
    loop = RolloutLoop()
    loop.setup(policy, tokenizer)
    assert options_of(loop.engine) == HFEngineOptions() == HFEngineOptions("dynamic", False, False)


def test_the_trainer_engine_and_a_frozen_model_engine_get_the_options(tokenizer, policy):
    """The in-process engine on the policy and the one sampling from a frozen model (``generate(model=...)``)
    both run with ``rollout.hf``; the trainer's engine samples what a hand-built engine with those options
    samples, and its generation chunk size is kept."""
    loop = RolloutLoop(sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=3, generation_batch_size=1,
                       hf=STATIC_SHARED)  # fmt: skip
    loop.setup(policy, tokenizer)
    assert options_of(loop.engine) == STATIC_SHARED and loop.engine.micro_batch_size == 1
    got = loop.generate(PROMPTS)  # training rollout 0: seed 0
    expected = HFEngine(tokenizer, policy, micro_batch_size=1, kv_cache="static", share_prompt=True).generate(
        PROMPTS, 3, SamplingParams(max_new_tokens=5, seed=0)
    )
    assert same_samples(got, expected)

    frozen = make_tiny_llama(tokenizer, seed=1, **TINY)
    loop.generate(PROMPTS, model=frozen, sampling=SamplingParams(max_new_tokens=3, seed=1))
    assert options_of(loop._frozen_engines[id(frozen)]) == STATIC_SHARED


def test_the_async_worker_process_gets_the_options(tokenizer, policy):
    """With ``max_staleness 1`` the HF engine lives in a spawned worker: the engine it built there has the
    options (asked of the worker process), and its samples equal an in-process engine's with those options."""
    loop = RolloutLoop(sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=3, max_staleness=1,
                       hf=STATIC_SHARED)  # fmt: skip
    loop.setup(policy, tokenizer)
    loop.start_pipeline(lambda index, prompts, version: None)
    try:
        worker = loop.async_engine
        assert worker.engine_options() == STATIC_SHARED
        worker.load_weights(0, loop.snapshot(0).state)
        sampling = SamplingParams(max_new_tokens=5, seed=7)
        got = worker.generate(PROMPTS, 3, sampling)
    finally:
        loop.stop_pipeline()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's threads (rollout.worker_threads)
    try:
        expected = HFEngine(tokenizer, policy, **vars(STATIC_SHARED)).generate(PROMPTS, 3, sampling)
    finally:
        torch.set_num_threads(threads)
    assert same_samples(got, expected)


def test_the_setting_parses_from_yaml_and_the_command_line(tmp_path):
    """``rollout.hf`` in a stage's YAML and as a command-line override, through the CLI's parser; and built
    into the loop's HFEngineOptions."""
    override = tmp_path / "hf.yaml"
    override.write_text(yaml.safe_dump({"model": {"init_args": {"rollout": {"hf": {"kv_cache": "static"}}}}}))
    args = ["--config", str(CONFIG_DIR / "quickstart/grpo.yaml"), "--config", str(override)]
    cli = ParseOnly(args=[*args, "--model.init_args.rollout.hf.share_prompt", "true"], run=False)
    rollout = cli.config.model.init_args.rollout.init_args
    assert (rollout.hf.kv_cache, rollout.hf.compile, rollout.hf.share_prompt) == ("static", False, True)
    assert (rollout.engine, rollout.samples_per_prompt) == ("hf", 5)  # the rest of the stage's rollout kept

    parser = ArgumentParser()
    parser.add_class_arguments(RolloutLoop, "rollout")
    cfg = parser.parse_args(["--rollout.hf.kv_cache", "static", "--rollout.hf.share_prompt", "true"])
    loop = parser.instantiate_classes(cfg).rollout
    assert loop.hf == STATIC_SHARED
    with pytest.raises(SystemExit):  # not a cache Hugging Face has: the parser refuses it
        ParseOnly(args=[*args, "--model.init_args.rollout.hf.kv_cache", "paged"], run=False)


def test_options_with_another_engine_are_an_error():
    for engine, extra in (("vllm", {}), ("vllm_server", {"endpoints": ["http://localhost:8000"]})):
        message = rf"rollout.hf \(kv_cache 'static'.*rollout.engine is '{engine}'"
        with pytest.raises(ValueError, match=message):
            RolloutLoop(engine=engine, hf=HFEngineOptions(kv_cache="static"), **extra)
        RolloutLoop(engine=engine, **extra)  # without it: fine
    with pytest.raises(ValueError, match="kv_cache must be 'dynamic' or 'static', got 'paged'"):
        HFEngineOptions(kv_cache="paged")
    with pytest.raises(ValueError, match="static KV cache"):
        HFEngineOptions(compile=True)
    with pytest.raises(ValueError, match="share_prompt"):
        HFEngineOptions(kv_cache="static", compile=True, share_prompt=True)
