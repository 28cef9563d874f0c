"""Hugging Face ``generate`` in a worker process with its own copy of the weights (asynchronous rollouts).

The trainer keeps updating its policy while :class:`HFWorkerEngine` samples in another process (no GIL
shared with the trainer), from the weights it was last given: :meth:`HFWorkerEngine.load_weights` sends a
full state dict (a snapshot of one policy version) and the worker answers with the version and a checksum
of what it loaded, which must equal the snapshot's (a sync that silently did nothing is an error, not a
stale rollout). Generation is :class:`~alignlit.rollout.HFEngine`'s, seeded the same way, so a call gives
the samples an in-process engine on the same weights gives (with the same number of threads).
"""

from __future__ import annotations

import os
import queue
import sys
import traceback
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.hf_engine import HFEngineOptions

REPLY_POLL_S = 1.0


_CHUNK = 7 << 26
_WORDS = {1: torch.uint8, 2: torch.int16}
_POSITION = torch.arange(1, 8, dtype=torch.int64)


def tensor_checksum(name: str, tensor: torch.Tensor) -> int:
    """An exact integer checksum of one named tensor: ``Σ_i b_i·(1 + i mod 7)`` over its bytes read as int32
    words (int16 for 2-byte, uint8 for 1-byte dtypes), times an odd number drawn from the name, mod 2^64.
    Integer sums are exact, so it is the same in any process on any thread count (a float sum is not: its
    rounding follows the threads' split); any change of a bit, of a word's position or of the name changes it.
    Computed as ``Σ_r (1 + r)·Σ_{i ≡ r mod 7} b_i`` (one pass over the words)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    words = flat.view(_WORDS.get(flat.element_size(), torch.int32))
    total = 0
    for start in range(0, words.numel(), _CHUNK):  # |b|·2^26 < 2^63: no int64 overflow within a chunk
        part = words[start : start + _CHUNK]
        if part.numel() % 7:
            part = torch.cat([part, part.new_zeros(7 - part.numel() % 7)])
        total += int((part.view(-1, 7).sum(0, dtype=torch.int64) * _POSITION).sum())
    return (total * (zlib.crc32(name.encode()) | 1)) % 2**64


def state_checksum(state: dict[str, torch.Tensor]) -> int:
    """The exact checksum of a state dict: the sum of its tensors' :func:`tensor_checksum` mod 2^64 (in any
    order: the trainer and an engine receiving buckets compute the same number)."""
    return sum(tensor_checksum(name, t) for name, t in state.items()) % 2**64


class WeightSyncError(RuntimeError):
    """The engine's weights are not the version the trainer sent."""


def _serve(config, dtype, tokenizer, micro_batch_size, options, threads, requests, replies, parent) -> None:
    """The worker's loop: ``("load", version, state)`` and ``("generate", prompts, n, sampling)`` requests,
    one reply each; it exits on None or when its parent is gone."""
    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    from alignlit.rollout.hf_engine import HFEngine

    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    engine = HFEngine(tokenizer, model, micro_batch_size=micro_batch_size, **vars(options))
    while True:
        try:
            request = requests.get(timeout=REPLY_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the trainer was killed: nothing will ask again
                return
            continue
        if request is None:
            return
        try:
            if request[0] == "load":
                _, version, state = request
                model.load_state_dict(state, strict=True)
                replies.put(("loaded", version, state_checksum(model.state_dict())))
            elif request[0] == "options":
                replies.put(("options", engine.kv_cache, engine.compile, engine.share_prompt))
            elif request[0] == "generate_from_ids":
                _, prompt_ids, n, sampling = request
                replies.put(("rollout", engine.generate_from_ids(prompt_ids, n, sampling)))
            else:
                _, prompts, n, sampling = request
                replies.put(("rollout", engine.generate(prompts, n, sampling)))
        except Exception:
            replies.put(("error", traceback.format_exc()))


@contextmanager
def _main_not_reimported() -> Iterator[None]:
    """A spawned process runs the parent's ``__main__`` script again before its target (to find what the
    target needs); the worker needs nothing from it, and a training script without an ``if __name__ ==
    "__main__"`` guard would start training again in the worker. Hide the script while starting it."""
    main = sys.modules["__main__"]
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    for name in saved:
        setattr(main, name, None) if name == "__spec__" else delattr(main, name)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


class HFWorkerEngine:
    """A rollout engine whose model lives in a spawned worker process (see the module docstring).

    Args:
        policy: the trained policy (its config, dtype and tokenizer are copied; not its weights: send them
            with :meth:`load_weights`).
        tokenizer: the policy's tokenizer.
        micro_batch_size: most prompts per ``generate`` call in the worker (None: all at once).
        options: how the worker's :class:`~alignlit.rollout.HFEngine` runs ``generate`` (None: its defaults).
        threads: torch threads of the worker (the trainer keeps its own).
        timeout_s: longest wait for one reply before the worker counts as hung.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        *,
        micro_batch_size: int | None = None,
        options: HFEngineOptions | None = None,
        threads: int = 1,
        timeout_s: float = 1800.0,
    ):
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        dtype = next(base.parameters()).dtype
        context = torch.multiprocessing.get_context("spawn")
        self.requests, self.replies = context.Queue(), context.Queue()
        self.timeout_s = timeout_s
        self.version: int | None = None
        self.options = options if options is not None else HFEngineOptions()
        self.process = context.Process(
            target=_serve,
            args=(
                base.config,
                dtype,
                tokenizer,
                micro_batch_size,
                self.options,
                threads,
                self.requests,
                self.replies,
                os.getpid(),
            ),
            daemon=True,
            name="alignlit-hf-rollout-worker",
        )
        with _main_not_reimported():
            self.process.start()

    def _reply(self, what: str):
        waited = 0.0
        while True:
            try:
                reply = self.replies.get(timeout=REPLY_POLL_S)
                break
            except queue.Empty:
                waited += REPLY_POLL_S
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the HF rollout worker (pid {self.process.pid}) died while {what} (exit code "
                        f"{self.process.exitcode})"
                    ) from None
                if waited > self.timeout_s:
                    raise TimeoutError(
                        f"the HF rollout worker gave no answer in {self.timeout_s:.0f} s while {what}"
                    ) from None
        if reply[0] == "error":
            raise RuntimeError(f"the HF rollout worker failed while {what}:\n{reply[1]}")
        return reply

    def load_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Load ``state`` (a full state dict of the policy at ``version``) into the worker and check that it
        holds exactly those weights; raises :class:`WeightSyncError` otherwise."""
        state = {k: v.detach().cpu() for k, v in state.items()}
        self.requests.put(("load", version, state))
        _, loaded, checksum = self._reply(f"loading the weights of version {version}")
        expected = state_checksum(state)
        if loaded != version or checksum != expected:
            raise WeightSyncError(
                f"the rollout worker holds version {loaded} with checksum {checksum!r} after a sync to version "
                f"{version} (checksum {expected!r}): its rollouts would come from other weights"
            )
        self.version = version

    def engine_options(self) -> HFEngineOptions:
        """The options of the engine the worker process built (asked of the worker, not this object's copy)."""
        self.requests.put(("options",))
        return HFEngineOptions(*self._reply("reading the engine's options")[1:])

    def sync(self, policy: torch.nn.Module) -> None:
        raise TypeError("HFWorkerEngine takes weights by version: load_weights(version, state)")

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> Rollout:
        """Sample ``n`` responses per prompt in the worker; see :class:`~alignlit.rollout.base.Rollout`."""
        if self.version is None:
            raise RuntimeError(
                "HFWorkerEngine.generate before any load_weights: the worker holds random weights"
            )
        self.requests.put(("generate", list(prompts), n, sampling))
        return self._reply(f"generating {len(prompts)} prompts x {n}")[1]

    def generate_from_ids(
        self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> Rollout:
        """:meth:`generate` from token-id prompts, used as they are (multi-turn episodes)."""
        if self.version is None:
            raise RuntimeError(
                "HFWorkerEngine.generate before any load_weights: the worker holds random weights"
            )
        self.requests.put(("generate_from_ids", [list(p) for p in prompt_ids], n, sampling))
        return self._reply(f"generating {len(prompt_ids)} prompts x {n}")[1]

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=5)
