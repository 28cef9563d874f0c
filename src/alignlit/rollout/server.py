"""Rollouts from vLLM engines served on their own devices or nodes: :class:`ServedVLLMEngine`
(``rollout.engine: vllm_server``) and the ``vllm serve`` command line ``alignlit serve`` runs.

An engine is vLLM's own OpenAI-compatible server (``vllm serve``) started from the policy's exported directory
with a few flags (:func:`vllm_serve_command`): ``--enable-scale-out`` opens vLLM's token-in/token-out route
``/inference/v1/generate`` (token ids, log-probs, and the weight version that sampled each token), and
``VLLM_SERVER_DEV_MODE=1`` its weight-transfer and ``/collective_rpc`` routes; the OpenAI API
(``/v1/completions``, ``/v1/chat/completions``) stays available to any OpenAI client. The trainer side is
:class:`ServedVLLMEngine`, a :class:`~alignlit.rollout.base.RolloutEngine`:

- **generation** is data-parallel over the engines: every training rank sends its own prompts, each sample a
  request of its own with the seed a single in-process :class:`~alignlit.rollout.VLLMEngine` gives it
  (``sampling.seed + j``, ``j`` the sample's index in the global batch, ranks' prompts interleaved as the data
  sampler dealt them), prompt ``g`` of the global batch going to engine ``g mod E``: the samples do not depend
  on the number of engines or of training ranks (as far as vLLM's seeded sampling is per request);
- **weights** are pushed by training rank 0 over a ``torch.distributed`` group with the engines' workers
  (gloo here, :mod:`alignlit.rollout.weight_sync`), or through a safetensors file (``weight_sync: file``);
  each push carries the state's checksum (compared by every engine) and a version label, and **every sampled
  token's version label is checked** against the last push: a stale or restarted engine is an error, never a
  silent off-policy rollout;
- **failures** name the endpoint: an engine that does not answer within ``timeout_s``, answers an error or
  dies fails the rollout on every rank (the ranks agree first, so none waits forever in a collective), and
  the run stops with its last checkpoint intact; restart the engine and resume with ``--ckpt_path``;
- **answers are checked**: a token id outside the vocabulary, a log-prob that is not finite or above 0, an
  answer that is not JSON or lacks a field is an error naming the endpoint and the sample
  (:func:`~alignlit.rollout.endpoint.parse_generated`);
- **a shared secret** (:mod:`alignlit.rollout.engine_auth`): every request carries it, each engine proves
  it holds it when the client connects, and the weight group's rendezvous is keyed by it.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from alignlit.models.state_dict import full_state_dict
from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.endpoint import EngineError, EngineHTTP, parse_generated
from alignlit.rollout.engine_auth import resolve_api_key
from alignlit.rollout.hf_worker import WeightSyncError
from alignlit.rollout.postprocess import (
    RawSample,
    assemble_rollout,
    check_prompts,
    encode_prompts,
    eos_token_ids,
    pad_prompt_ids,
    require_pad_token,
)
from alignlit.rollout.weight_sync import CollectivePush, FilePush

WEIGHT_SYNC_MODES = ("collective", "file")


def _data_parallel_rows(asked: list[tuple[int, int]], dp_rank: int) -> list[int]:
    """The global prompt rows of data-parallel rank ``dp_rank``, given every rank's ``(dp rank, prompts)``:
    interleaved as the data sampler dealt them when every data-parallel rank has as many prompts (row ``i`` of
    data-parallel rank ``r`` is global row ``i·W + r``), else consecutive (as
    :class:`~alignlit.rollout.served.RankZeroServedEngine` does)."""
    sizes = dict(asked)  # tensor-parallel peers ask for the same prompts
    groups = sorted(sizes)
    j = groups.index(dp_rank)
    if len(set(sizes.values())) == 1:
        return [i * len(groups) + j for i in range(sizes[dp_rank])]
    start = sum(sizes[g] for g in groups[:j])
    return list(range(start, start + sizes[dp_rank]))


class ServedVLLMEngine:
    """Samples with vLLM engines served elsewhere and pushes weights to them (module docstring).

    Construct it on every training rank (``group`` is then a gloo group of the training ranks, for agreeing
    on errors and on the global batch layout; :meth:`for_trainer` builds one).

    Args:
        endpoints: the engines' ``http://host:port`` (``alignlit serve`` / ``vllm serve`` with the flags of
            :func:`vllm_serve_command`).
        tokenizer: the policy's tokenizer (must have a pad token; the engines were exported with it).
        model_config: the policy's config (its EOS ids; None: the tokenizer's).
        weight_sync: ``"collective"`` (tensors broadcast over a gloo group) or ``"file"`` (safetensors in
            ``sync_dir``, which every engine must read at the same path).
        sync_dir: the folder of the file fallback (default ``/dev/shm``).
        bucket_mb: largest broadcast bucket, MiB.
        address: the address the engines reach training rank 0 at for the weight group (default: this
            machine's address on the route to the first engine).
        timeout_s: longest wait for one HTTP answer or one collective step before the engine counts as hung.
        start_timeout_s: longest wait for the engines to answer ``/health`` when connecting.
        max_concurrency: most requests in flight from this rank.
        verify: must be True: every push carries the state's checksum, each engine compares what it
            received and answers its checksum, which must equal the one pushed (the checksum is never skipped).
        api_key: the engines' shared secret (what ``alignlit serve`` printed); None: the contents of
            ``api_key_file``, else ``$ALIGNLIT_API_KEY``, else none (engines served with ``--insecure-no-auth``
            on a loopback address). In a config, use ``api_key_file`` or the environment variable: a key
            written in the config is saved with it.
        api_key_file: a file holding the shared secret.
        seed: seeds the stream of per-call seeds used when ``sampling.seed`` is None.
        group: a gloo process group of the training ranks (None: one training process).
        rank: this process's rank in ``group`` (rank 0 pushes the weights).
        data_parallel: this rank's ``(data-parallel rank, data-parallel size)``.
    """

    versioned = True
    """:meth:`sync` takes the policy's version (the rollout loop passes it)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        tokenizer,
        *,
        model_config=None,
        weight_sync: str = "collective",
        sync_dir: str | None = None,
        bucket_mb: float = 64.0,
        address: str | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float = 600.0,
        max_concurrency: int = 64,
        verify: bool = True,
        api_key: str | None = None,
        api_key_file: str | None = None,
        seed: int = 0,
        group=None,
        rank: int = 0,
        data_parallel: tuple[int, int] = (0, 1),
    ):
        if isinstance(endpoints, str) or not endpoints:
            raise ValueError(
                f"rollout endpoints must be a non-empty list of http://host:port, got {endpoints!r}"
            )
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {weight_sync!r}")
        if verify is not True:
            raise ValueError(
                f"verify must be True (got {verify!r}): every weight push is checked by its checksum, never skipped"
            )
        require_pad_token(tokenizer)
        self._api_key = resolve_api_key(api_key, api_key_file)
        self.engines = [EngineHTTP(url, timeout_s=timeout_s, api_key=self._api_key) for url in endpoints]
        if len({e.url for e in self.engines}) != len(self.engines):
            raise ValueError(f"rollout endpoints repeat an engine: {[e.url for e in self.engines]}")
        self.tokenizer = tokenizer
        self._eos_ids = eos_token_ids(tokenizer, model_config)
        self.vocab_size = int(getattr(model_config, "vocab_size", None) or len(tokenizer))
        """Token ids the engines may answer: ``[0, vocab_size)``."""
        self.weight_sync = weight_sync
        self.sync_dir, self.bucket_mb, self.address = sync_dir, bucket_mb, address
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.max_concurrency = max_concurrency
        self.group, self.rank = group, rank
        self.data_parallel = data_parallel
        self._seeds = random.Random(seed)
        self.logprobs_mode = "processed_logprobs"
        self.run_tag = ""
        self.version: int | None = None
        """The policy version every engine holds (acknowledged), None before the first push."""
        self.label: str | None = None
        self.weight_pushes = 0
        self.requests_per_engine = {e.url: 0 for e in self.engines}
        """Generation requests this rank sent to each engine."""
        self.last_push: dict[str, float] = {}
        self._pusher: CollectivePush | FilePush | None = None
        self._connected = False

    @classmethod
    def for_trainer(
        cls,
        endpoints,
        tokenizer,
        *,
        world_size: int = 1,
        data_parallel: tuple[int, int] | None = None,
        **kwargs,
    ) -> ServedVLLMEngine:
        """Build the client on every training rank (a collective when ``world_size > 1``: the ranks' gloo group)."""
        if world_size == 1:
            return cls(endpoints, tokenizer, **kwargs)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"rollout engine 'vllm_server' with world size {world_size} needs the torch.distributed process "
                "group (set up by the trainer's strategy) before setup"
            )
        group = dist.new_group(backend="gloo")
        rank = dist.get_rank()
        return cls(
            endpoints, tokenizer, group=group, rank=rank,
            data_parallel=data_parallel or (rank, dist.get_world_size()), **kwargs,
        )  # fmt: skip

    # ------------------------------------------------------------------ agreement between training ranks
    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed (each rank's message included)."""
        if self.group is None:
            if error is not None:
                raise error
            return
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        messages: list = [None] * world
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(messages, mine, group=self.group)
        failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
        if not failed:
            return
        if error is not None and len(failed) == 1:
            raise error
        kind = WeightSyncError if any("WeightSyncError" in m for m in failed) else EngineError
        raise kind(f"served rollout engines failed while {what}:\n" + "\n".join(failed)) from error

    def _broadcast_object(self, value):
        if self.group is None:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _gather_object(self, value) -> list:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    # ------------------------------------------------------------------ connecting
    def connect(self) -> None:
        """Wait for every engine, check its settings (a collective on the training ranks); idempotent."""
        if self._connected:
            return
        error = None
        infos: list[dict] = []
        try:
            for engine in self.engines:
                engine.wait_ready(self.start_timeout_s)
                infos.append(engine.info())
            modes = {info["logprobs_mode"] for info in infos}
            if len(modes) != 1:
                raise EngineError(f"the rollout engines report different logprobs modes: {modes}")
            self.logprobs_mode = modes.pop()
            for engine, info in zip(self.engines, infos):
                if info.get("generation_config") != "vllm":
                    raise EngineError(
                        f"rollout engine {engine.url} applies its model's generation_config.json sampling defaults "
                        "(start it with --generation-config vllm, as alignlit serve does)"
                    )
                if self.weight_sync == "collective" and info.get("weight_transfer") != "gloo":
                    raise EngineError(
                        f"rollout engine {engine.url} has weight transfer {info.get('weight_transfer')!r}, "
                        "weight_sync 'collective' needs 'gloo': start it with alignlit serve (or vllm serve "
                        '--weight-transfer-config \'{"backend": "gloo"}\' and the alignlit worker extension), '
                        "or use weight_sync 'file'"
                    )
        except BaseException as err:
            error = err
        self._agree(error, "connecting")
        self.run_tag = self._broadcast_object(secrets.token_hex(4))
        if self.rank == 0:
            self._pusher = (
                CollectivePush(self.engines, bucket_mb=self.bucket_mb, address=self.address,
                               timeout_s=self.timeout_s, secret=self._api_key)
                if self.weight_sync == "collective"
                else FilePush(self.engines, self.sync_dir)
            )  # fmt: skip
        self._connected = True

    # ------------------------------------------------------------------ weights
    def check_sampling(self, sampling: SamplingParams) -> None:
        from alignlit.rollout.vllm_engine import VLLMEngine

        VLLMEngine.check_sampling(
            self, sampling
        )  # the same rule as the in-process engine, on the served mode

    def sync(self, policy: torch.nn.Module, *, version: int) -> None:
        """Push ``policy``'s current weights as ``version`` to every engine (a collective of the training ranks:
        sharded weights are gathered by all of them, rank 0 pushes, every rank checks the engines' label)."""
        self.connect()
        sharded = any(type(p).__name__ == "DTensor" for p in policy.parameters())
        state = full_state_dict(policy, "cpu", merge_lora=True) if (sharded or self.rank == 0) else None
        self._push(version, state)

    def load_weights(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Push a full state dict (a snapshot of ``version``; only rank 0's is used) to every engine and check
        that every engine holds it; a collective of the training ranks. Raises :class:`WeightSyncError` when an
        engine reports other weights."""
        self.connect()
        self._push(version, state)

    def _push(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        label = f"alignlit-{self.run_tag}-v{version}"
        error = None
        try:
            if self.rank == 0:
                self.last_push = self._pusher.push(state, label)
        except BaseException as err:
            error = err
        self._agree(error, f"pushing weights of version {version}")
        error = None
        try:
            for engine in self.engines:
                held = engine.weight_version()
                if held != label:
                    raise WeightSyncError(
                        f"rollout engine {engine.url} holds weights {held!r} after the push of {label!r}: its "
                        "rollouts would come from other weights"
                    )
        except BaseException as err:
            error = err
        self._agree(error, f"checking the engines hold version {version}")
        self.version, self.label = version, label
        self.weight_pushes += 1

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> Rollout:
        """Sample ``n`` responses per prompt on the engines; see :class:`~alignlit.rollout.base.Rollout`. A
        collective of the training ranks."""
        prompts = check_prompts(prompts, n)
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts)  # (B, P)
        return self._generate(prompts, prompt_ids, prompt_mask, n, sampling)

    def generate_from_ids(
        self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> Rollout:
        """:meth:`generate` from token-id prompts, sent as they are (multi-turn episodes)."""
        texts, ids, mask = pad_prompt_ids(self.tokenizer, prompt_ids)  # (B, P)
        return self._generate(check_prompts(texts, n), ids, mask, n, sampling)

    def _request(self, ids: list[int], sampling: SamplingParams, seed: int) -> dict[str, Any]:
        return {
            "token_ids": ids,
            "output_mode": "tokens",
            "sampling_params": {
                "n": 1, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "max_tokens": sampling.max_new_tokens, "stop": list(sampling.stop) or None, "seed": seed,
                "logprobs": 0, "skip_special_tokens": True,
            },
        }  # fmt: skip

    def _parse(self, engine: EngineHTTP, answer: dict, sample: str = "a sample") -> RawSample:
        ids, logps, versions, reason = parse_generated(
            engine.url, answer, vocab_size=self.vocab_size, sample=sample
        )
        stale = [v for v in versions or [] if v != self.label]
        if ids and (stale or not versions):
            raise WeightSyncError(
                f"rollout engine {engine.url} sampled tokens with weights {stale or None}, "
                f"not the pushed {self.label!r} (restarted or updated by someone else?): the rollout would be "
                "off-policy"
            )
        eos_at = next((t for t, tok in enumerate(ids) if tok in self._eos_ids), None)
        if eos_at is not None:
            ids, logps = ids[: eos_at + 1], logps[: eos_at + 1]
        return RawSample(ids, logps, ended_early=reason == "stop")

    def _generate(
        self, prompts: list[str], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int,
        sampling: SamplingParams,
    ) -> Rollout:  # fmt: skip
        self.check_sampling(sampling)
        self.connect()
        if self.version is None:
            raise RuntimeError("ServedVLLMEngine.generate before any weight push: sync or load_weights first")
        base_seed = sampling.seed if sampling.seed is not None else self._seeds.randrange(2**31)
        asked = self._gather_object((self.data_parallel[0], len(prompts)))
        rows = _data_parallel_rows(asked, self.data_parallel[0])
        jobs: list[tuple[EngineHTTP, dict, str]] = []
        for i, g in enumerate(rows):
            engine = self.engines[g % len(self.engines)]
            ids = prompt_ids[i, prompt_mask[i]].tolist()
            jobs += [
                (engine, self._request(ids, sampling, base_seed + g * n + k), f"sample {k} of prompt {g}")
                for k in range(n)
            ]
            self.requests_per_engine[engine.url] += n
        what = f"generating {len(prompts)} prompts x {n}"
        error, samples = None, []
        start = time.perf_counter()
        try:
            samples = self._run(
                [
                    lambda e=e, body=body, row=row: self._parse(
                        e, e.call("/inference/v1/generate", body, what=what), row
                    )
                    for e, body, row in jobs
                ]
            )
        except BaseException as err:
            error = err
        self._agree(error, what)
        self.last_generate_s = time.perf_counter() - start
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

    def _run(self, calls: list[Callable[[], RawSample]]) -> list[RawSample]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(calls)))) as pool:
            futures = [pool.submit(c) for c in calls]
            return [f.result() for f in futures]

    def close(self) -> None:
        """Forget the weight group (the engines keep running)."""
        self._pusher = None
        self._connected = False
