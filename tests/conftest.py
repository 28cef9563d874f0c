"""Shared fixtures: a tokenizer trained locally and tiny models built from configs (no network)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

SYMBOLS = "abcdefgh"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason in the summary, when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_vllm() -> None:
    """vLLM tests skip with the reason where vLLM is not installed, except under ``ALIGNLIT_REQUIRE_VLLM=1``
    (``nox -s vllm``), where a missing vLLM is an error: that session cannot pass by skipping everything."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("ALIGNLIT_REQUIRE_VLLM") == "1":
            raise ImportError("ALIGNLIT_REQUIRE_VLLM=1 but vllm is not importable: run .ci/install-vllm.sh")
        pytest.skip("vllm is not installed (install it with .ci/install-vllm.sh; `nox -s vllm` runs these)")


@pytest.fixture(autouse=True, scope="module")
def _vllm_module(request):
    """A module marked ``vllm`` checks before its module-scoped fixtures (e.g. engines) start."""
    if request.node.get_closest_marker("vllm") is not None:
        require_vllm()


@pytest.fixture(autouse=True)
def _vllm_test(request):
    if request.node.get_closest_marker("vllm") is not None:
        require_vllm()


@pytest.fixture(autouse=True)
def _no_global_seed(monkeypatch):
    """Each test starts without a global seed: seeds that default to ``seed_everything``'s
    (``alignlit.data.args.resolve_seed``) are 0 unless the test seeds, whatever an earlier test did."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


def dialogue_texts(n: int = 400) -> list[str]:
    """Small HH-style corpus for training a test tokenizer."""
    out = []
    for i in range(n):
        seq = " ".join(SYMBOLS[(i * 7 + j * 3) % 8] for j in range(3 + i % 4))
        op = ("sort", "reverse", "copy", "dedupe")[i % 4]
        out.append(f"\n\nHuman: {op} {seq}\n\nAssistant: {seq} ok done")
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from alignlit.models import train_bpe_tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(dialogue_texts(), vocab_size=320, out_dir=d)
    return d


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from alignlit.models import load_tokenizer

    return load_tokenizer(tokenizer_dir)


TINY = dict(hidden_size=64, num_layers=2, num_heads=1, head_dim=64, intermediate_size=128)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory, tokenizer):
    """An exported tiny random policy directory (read-only for tests)."""
    from alignlit.models import export_pretrained, make_tiny_llama

    d = tmp_path_factory.mktemp("policy") / "tiny"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer, d, stage="init")
    return d


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face hub cache holding a tiny random ``Qwen/Qwen2.5-0.5B-Instruct`` (tests/hubcache.py),
    used offline: ``HF_HUB_CACHE`` points at it and ``HF_HUB_OFFLINE=1``, in the environment and in
    huggingface_hub's import-time constants (so raw ``from_pretrained("Qwen/...")`` finds it too).
    Returns the cache root; add more ids with ``make_hub_cache(hub_cache, "org/name", seed=1)`` and run
    subprocesses with ``env=hub_env(hub_cache)``."""
    from huggingface_hub import constants

    from tests.hubcache import make_hub_cache

    root = make_hub_cache(tmp_path / "hf-hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root
