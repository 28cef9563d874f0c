"""Served vLLM engines (``rollout.engine: vllm_server``): two ``alignlit serve`` processes (real vLLM, CPU build)
and the trainer-side client.

What is compared with what: the served samples with an in-process :class:`VLLMEngine` holding the same weights
(bit for bit) and the log-probs with the HF model; one engine with two; the engines' own parameters after a
collective push (vLLM's ``/weight_checker`` digests) with an in-process engine that loaded the same state (LoRA
merged included; the file fallback too); GRPO with 2 training ranks on 2 engines with 1 rank on 1 engine; a
killed engine's error and the resumed run with the uninterrupted one. Run with ``nox -s vllm``.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignlit.models import make_tiny_llama
from alignlit.rollout import SamplingParams, check_parity
from alignlit.rollout.endpoint import EngineError, EngineHTTP, EngineProcess
from alignlit.rollout.hf_worker import WeightSyncError
from alignlit.rollout.server import ServedVLLMEngine
from tests.conftest import TINY

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
KEY = secrets.token_urlsafe(32)
"""The engines' shared secret (alignlit serve's API key); the trainers get it in ALIGNLIT_API_KEY."""
PROMPTS = [
    "\n\nHuman: sort a b c\n\nAssistant:",
    "\n\nHuman: copy d\n\nAssistant:",
    "\n\nHuman: reverse h g f e d\n\nAssistant:",
    "\n\nHuman: dedupe a a b\n\nAssistant:",
    "\n\nHuman: sort h a\n\nAssistant:",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory, tokenizer):
    """The multi-process stage's inputs (a tiny head_dim-64 policy, a reference, prompts); the engines serve
    ``work/policy``."""
    from tests.distributed import multiproc_fit

    work = tmp_path_factory.mktemp("served") / "work"
    multiproc_fit.write_inputs(work, tokenizer, lambda seed: make_tiny_llama(tokenizer, seed=seed, **TINY))
    return work


@pytest.fixture(scope="module")
def engines(work, tmp_path_factory):
    """Two engines, each its own ``alignlit serve`` process group, pinned to a core of its own."""
    logs = tmp_path_factory.mktemp("engine-logs")
    procs = [
        EngineProcess(
            work / "policy", _free_port(), extra=["--max-model-len", "256"], log=logs / f"engine-{k}.log", api_key=KEY,
            env={"VLLM_CPU_OMP_THREADS_BIND": str(k % max(1, os.cpu_count() or 1)), "VLLM_LOGGING_LEVEL": "WARNING"},
        )
        for k in range(2)
    ]  # fmt: skip
    try:
        for p in procs:
            p.wait_ready(1200)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def policy(work):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(work / "policy"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained(policy):
    """The policy moved by noise: a push must reach the engines for their samples to change."""
    model = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def in_process(work, tokenizer):
    from alignlit.rollout import VLLMEngine

    return VLLMEngine(work / "policy", tokenizer, max_model_len=256)


def _client(engines, tokenizer, policy, **kwargs) -> ServedVLLMEngine:
    return ServedVLLMEngine(
        [e.url for e in engines], tokenizer, model_config=policy.config, api_key=KEY, **kwargs
    )


def _digests(url: str) -> dict[str, str]:
    return EngineHTTP(url, api_key=KEY).call(
        "/weight_checker", {"action": "checksum"}, what="reading digests"
    )["checksums"]


def _in_process_digests(engine, state) -> dict[str, str]:
    engine.load_state(state)
    (digests,) = engine.llm.collective_rpc("compute_weight_checksums")
    return digests


SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)


def test_served_samples_equal_the_in_process_engine(engines, tokenizer, policy, trained, in_process):
    client = _client(engines[:1], tokenizer, policy)
    client.sync(trained, version=1)
    assert (
        EngineHTTP(engines[0].url, api_key=KEY).weight_version()
        == client.label
        == f"alignlit-{client.run_tag}-v1"
    )
    served = client.generate(PROMPTS, 2, SAMPLING)
    in_process.sync(trained)
    local = in_process.generate(PROMPTS, 2, SAMPLING)
    assert torch.equal(served.response_ids, local.response_ids) and served.texts == local.texts
    assert torch.equal(served.logprobs, local.logprobs) and served.finish_reasons == local.finish_reasons
    assert (
        check_parity(trained, served, temperature=1.0, tol=1e-4, max_samples=len(served))["max_abs_diff"]
        < 1e-4
    )
    with pytest.raises(Exception, match="off-policy"):  # the old weights are not what the engine samples from
        check_parity(policy, served, temperature=1.0, tol=1e-3)
    greedy = client.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert torch.equal(
        greedy.response_ids,
        in_process.generate(PROMPTS, 1, SamplingParams(0.0, max_new_tokens=8)).response_ids,
    )


def test_one_and_two_engines_give_the_same_samples(engines, tokenizer, policy, trained):
    one = _client(engines[:1], tokenizer, policy)
    one.sync(trained, version=3)
    a = one.generate(PROMPTS, 3, SAMPLING)
    two = _client(engines, tokenizer, policy)
    two.sync(trained, version=3)
    b = two.generate(PROMPTS, 3, SAMPLING)
    assert list(two.requests_per_engine.values()) == [9, 6]  # prompts 0, 2, 4 on engine 0; 1, 3 on engine 1
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert a.texts == b.texts and len(set(a.texts)) > 5  # and the samples differ from one another
    c = two.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_new_tokens=8, seed=12))
    assert not torch.equal(b.response_ids, c.response_ids)


def test_collective_push_gives_the_engines_exactly_the_weights_lora_merged_included(
    engines, tokenizer, policy, in_process
):
    from alignlit.models.lora import LoRA, apply_lora, merged_state_dict

    lora = apply_lora(copy.deepcopy(policy), LoRA(rank=4, alpha=8))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # B starts at 0: give the adapter an effect
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    client = _client(engines, tokenizer, policy, bucket_mb=0.05)  # several buckets
    client.sync(lora, version=5)
    merged = merged_state_dict(lora)
    expected = _in_process_digests(in_process, merged)
    for engine in engines:
        assert _digests(engine.url) == expected
    # vLLM's CPU build repacks the linear layers' weights for its GEMM kernels and empties the parameters
    # the digests read, so the digests cover the embeddings and norms only; the projections the adapter
    # changed are checked by the log-probs: the engines sample from the merged weights, not the base's
    r = client.generate(PROMPTS, 2, SAMPLING)
    assert check_parity(lora, r, temperature=1.0, tol=1e-4, max_samples=len(r))["max_abs_diff"] < 1e-4
    with pytest.raises(Exception, match="off-policy"):
        check_parity(policy, r, temperature=1.0, tol=1e-3, max_samples=len(r))


def test_file_fallback_gives_the_engines_the_same_weights(
    engines, tokenizer, policy, trained, in_process, tmp_path
):
    client = _client(engines, tokenizer, policy, weight_sync="file", sync_dir=str(tmp_path))
    client.sync(trained, version=7)
    expected = _in_process_digests(in_process, {k: v.clone() for k, v in trained.state_dict().items()})
    for engine in engines:
        assert EngineHTTP(engine.url, api_key=KEY).weight_version() == client.label
        assert _digests(engine.url) == expected
    assert not list(tmp_path.iterdir())  # the file is removed once loaded
    r = client.generate(PROMPTS, 1, SAMPLING)
    assert check_parity(trained, r, temperature=1.0, tol=1e-4)["max_abs_diff"] < 1e-4


def test_the_openai_api_is_served(engines, work):
    """An OpenAI client (e.g. an environment library) can drive the same engine."""
    http = EngineHTTP(engines[0].url, api_key=KEY)
    body = {"model": str(work / "policy"), "prompt": PROMPTS[0], "max_tokens": 4, "logprobs": 1, "seed": 0}
    answer = http.call("/v1/completions", body, what="completing")
    choice = answer["choices"][0]
    assert (
        isinstance(choice["text"], str)
        and len(choice["logprobs"]["token_logprobs"]) == answer["usage"]["completion_tokens"] > 0
    )


def test_a_version_the_trainer_did_not_push_is_an_error(engines, tokenizer, policy, trained):
    client = _client(engines, tokenizer, policy)
    client.sync(trained, version=9)
    client.generate(PROMPTS, 1, SAMPLING)
    EngineHTTP(engines[1].url, api_key=KEY).call(
        "/update_weight_version", {"new_version": "someone-else"}, what="relabelling"
    )
    with pytest.raises(
        WeightSyncError, match=rf"{engines[1].url} sampled tokens with weights \['someone-else'\]"
    ):
        client.generate(PROMPTS, 1, SAMPLING)
    client.sync(trained, version=10)  # a push labels it again
    client.generate(PROMPTS, 1, SAMPLING)


# ---------------------------------------------------------------------------------------------- GRPO
def _fit(work: Path, strategy: str, out: Path, endpoints: list[str], **env) -> subprocess.CompletedProcess:
    from tests.distributed import multiproc_fit

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ALIGNLIT_TEST_ENDPOINTS": ",".join(endpoints),
           "ALIGNLIT_API_KEY": KEY, **env}  # fmt: skip
    return subprocess.run(
        [sys.executable, multiproc_fit.__file__, str(work), strategy, str(out), "grpo_served"],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip


@pytest.fixture(scope="module")
def grpo_runs(work, engines, tmp_path_factory):
    """GRPO with 1 training process on engine 0, and with 2 DDP ranks on engines 0 and 1."""
    root = tmp_path_factory.mktemp("grpo")
    for strategy, served in (("single", engines[:1]), ("ddp", engines)):
        res = _fit(work, strategy, root / strategy, [e.url for e in served])
        assert res.returncode == 0, res.stderr[-6000:]
    return root


def _samples_by_prompt(states: list[dict], step: int) -> dict[str, list]:
    out: dict[str, list] = {}
    for state in states:
        s = state["samples"][step]
        for prompt, text, logps, version in zip(s["prompts"], s["texts"], s["logprobs"], s["versions"]):
            out.setdefault(prompt, []).append((text, logps, version))
    return out


def test_grpo_two_ranks_on_two_engines_matches_one_rank_on_one(grpo_runs, engines):
    from tests.distributed import multiproc_fit

    one = json.loads((grpo_runs / "single" / "grpo_served" / "rank-0.json").read_text())
    ranks = [json.loads((grpo_runs / "ddp" / "grpo_served" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for step in range(multiproc_fit.ROLLOUTS):
        expected = _samples_by_prompt([one], step)
        got = _samples_by_prompt(ranks, step)
        assert len(expected) == multiproc_fit.GLOBAL_BATCH and got.keys() == expected.keys()
        for prompt in expected:  # the same samples and the version of the step
            assert [t for t, _, _ in got[prompt]] == [t for t, _, _ in expected[prompt]], prompt
            assert {v for _, _, v in got[prompt]} == {step}
            # step 0: the same weights, the same engine log-probs; later steps: weights equal to round-off
            diffs = [
                abs(a - b)
                for (_, la, _), (_, lb, _) in zip(got[prompt], expected[prompt])
                for a, b in zip(la, lb)
            ]
            assert max(diffs) <= (0.0 if step == 0 else 1e-4), (step, prompt, max(diffs))
    # every sync pushed once and was acknowledged on every rank; each rank used both engines' halves
    assert (
        one["weight_pushes"]
        == ranks[0]["weight_pushes"]
        == ranks[1]["weight_pushes"]
        == multiproc_fit.ROLLOUTS
    )
    assert ranks[0]["label"] == ranks[1]["label"] and ranks[0]["version"] == multiproc_fit.ROLLOUTS - 1
    assert [r["requests"] for r in ranks] == [{engines[0].url: 8, engines[1].url: 0},
                                             {engines[0].url: 0, engines[1].url: 8}]  # fmt: skip
    assert max(one["parity"] + ranks[0]["parity"] + ranks[1]["parity"]) < 1e-3
    single = torch.load(grpo_runs / "single" / "grpo_served" / "weights.pt", weights_only=True)
    ddp = torch.load(grpo_runs / "ddp" / "grpo_served" / "weights.pt", weights_only=True)
    init = torch.load(grpo_runs / "single" / "grpo_served" / "init.pt", weights_only=True)
    moved = max((single[k] - init[k]).abs().max().item() for k in init)
    worst = max((ddp[k] - single[k]).abs().max().item() for k in single)
    assert moved > 1e-3 and worst <= 2e-5, (moved, worst)


def test_a_killed_engine_is_named_and_the_run_resumes_from_its_last_checkpoint(
    work, engines, grpo_runs, tmp_path
):
    """Engine 1 is SIGKILLed when step 1 starts: both ranks stop with an error naming it; the checkpoint of step
    0 resumes on engine 0 alone and ends where the uninterrupted two-engine run ended."""
    ckpt = tmp_path / "ckpt"
    endpoints = [e.url for e in engines]
    res = _fit(work, "ddp", tmp_path / "killed", endpoints, ALIGNLIT_TEST_CKPT=str(ckpt),
               ALIGNLIT_TEST_KILL=f"{engines[1].process.pid}:1")  # fmt: skip
    assert res.returncode != 0
    assert f"rollout engine {engines[1].url}" in res.stderr, res.stderr[-4000:]
    assert (ckpt / "last.ckpt").exists()
    res = _fit(work, "ddp", tmp_path / "resumed", endpoints[:1], ALIGNLIT_TEST_RESUME=str(ckpt / "last.ckpt"))
    assert res.returncode == 0, res.stderr[-6000:]
    resumed = torch.load(tmp_path / "resumed" / "grpo_served" / "weights.pt", weights_only=True)
    uninterrupted = torch.load(grpo_runs / "ddp" / "grpo_served" / "weights.pt", weights_only=True)
    worst = max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
    assert worst <= 1e-6, worst
    state = json.loads((tmp_path / "resumed" / "grpo_served" / "rank-0.json").read_text())
    assert len(state["samples"]) == 1 and state["weight_pushes"] == 1  # only step 1 ran, after one push


def test_grpo_at_staleness_one_samples_each_step_from_the_version_before(work, engines, tmp_path):
    """``max_staleness: 1`` on a served engine, 2 epochs of 2 steps: step j samples from the weights of the start
    of step j - 1 (version max(0, j - 1)), each of those versions pushed once, every token's label checked."""
    from tests.distributed import multiproc_fit

    res = _fit(work, "single", tmp_path / "async", [engines[0].url], ALIGNLIT_TEST_STALENESS="1",
               ALIGNLIT_TEST_EPOCHS="2")  # fmt: skip
    assert res.returncode == 0, res.stderr[-6000:]
    state = json.loads((tmp_path / "async" / "grpo_served" / "rank-0.json").read_text())
    steps = 2 * multiproc_fit.ROLLOUTS
    assert [sorted(set(s["versions"])) for s in state["samples"]] == [[max(0, j - 1)] for j in range(steps)]
    assert state["weight_pushes"] == steps - 1 and state["version"] == steps - 2


def test_a_push_whose_checksum_differs_fails(engines, tokenizer, policy, trained, monkeypatch):
    """Last: the failed update leaves engine 0 mid-reload."""
    import alignlit.rollout.weight_sync as weight_sync

    client = _client(engines[:1], tokenizer, policy)
    real = weight_sync.state_checksum
    monkeypatch.setattr(weight_sync, "state_checksum", lambda state: real(state) + 1)
    with pytest.raises(EngineError, match=rf"{engines[0].url} answered HTTP 500 to /update_weights"):
        client.sync(trained, version=11)
