"""Rollouts with Hugging Face ``generate`` on the training model itself (the embedded default)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation import CompileConfig

from alignlit.models.hf_internals import compile_on_every_device
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


class _BehaviourLogps(LogitsProcessor):
    """Each sampled token's log-prob, ``log_softmax(raw logits / T)``, taken as generation goes.

    ``generate`` calls it on the raw logits of every step, before its temperature, top-k and top-p warpers
    (custom processors run ahead of them; the blank generation config adds no other processor). It keeps
    one step's distribution, ``(B, V)``, and reads the sampled token's entry from it on the next call (or in
    :meth:`finish`); keeping every step's logits (``output_logits``) held ``S x B x V`` floats: ~10 GB for
    64 samples of 256 tokens at a 151,936-entry vocabulary.
    """

    def __init__(self, scale: float):
        self.scale = scale
        self.last: torch.Tensor | None = None
        self.taken: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.last is not None:  # input_ids ends with the token sampled from self.last
            self.taken.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.scale, dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``(B, S)`` log-probs of ``new_tokens`` (B, S), the generated columns."""
        if new_tokens.shape[1] and self.last is not None:
            self.taken.append(self.last.gather(-1, new_tokens[:, -1:]).squeeze(-1))
        self.last = None
        if not self.taken:
            return torch.zeros(new_tokens.shape, dtype=torch.float32, device=new_tokens.device)
        return torch.stack(self.taken, dim=1)


class _StopStringCriteria(StoppingCriteria):
    """Ends a sequence once the decoded tail of its response contains a stop string.

    Only the last ``len(longest stop) + 8`` tokens are decoded each step, so the check is cheap; it
    only decides when generation may end early. Where the response is cut is decided afterwards, on
    the full decoded text (:func:`alignlit.rollout.postprocess.stop_cut`). ``ended_at[b]`` records
    the response length at which row ``b`` was first flagged.
    """

    def __init__(self, tokenizer, stop: Sequence[str], prompt_width: int, batch: int):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.prompt_width = prompt_width
        self.tail = max(len(s) for s in self.stop) + 8
        self.ended_at: list[int | None] = [None] * batch

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        response = input_ids[:, self.prompt_width :]  # (B, t)
        texts = self.tokenizer.batch_decode(response[:, -self.tail :].tolist(), skip_special_tokens=True)
        done = [any(s in text for s in self.stop) for text in texts]
        for b, hit in enumerate(done):
            if hit and self.ended_at[b] is None:
                self.ended_at[b] = response.shape[1]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@dataclass(frozen=True)
class HFEngineOptions:
    """How :class:`HFEngine` runs ``generate`` (a stage's ``rollout.hf``; see the engine's arguments of the same
    names). The samples' distribution and log-probs are the same with any of them; only speed changes.

    Attributes:
        kv_cache: ``"dynamic"`` (the default) or ``"static"``.
        compile: ``torch.compile`` the decoding step (needs the static cache).
        share_prompt: compute each prompt's KV cache once for its ``n`` samples (not with ``compile``).
    """

    kv_cache: Literal["dynamic", "static"] = "dynamic"
    compile: bool = False
    share_prompt: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache not in ("dynamic", "static"):
            raise ValueError(f"kv_cache must be 'dynamic' or 'static', got {self.kv_cache!r}")
        if self.compile and self.kv_cache != "static":
            raise ValueError(
                "compile=True compiles the decoding step over a static KV cache: set kv_cache='static'"
            )
        if self.share_prompt and self.compile:
            raise ValueError(
                "share_prompt=True hands generate a prefilled cache, which the compiled step does not take"
            )


class HFEngine:
    """Samples with ``model.generate`` from the policy being trained (no copy of the weights).

    Prompts are left-padded and generated in chunks of at most ``micro_batch_size`` prompts (each
    with its ``n`` samples), with the KV cache on, in eval mode under ``torch.no_grad``; the
    model's train/eval mode is restored afterwards. Log-probs are ``log_softmax(logits / T)`` of
    the sampled tokens from the raw logits (before top-k/top-p; ``T = 1`` for greedy).

    With ``sampling.seed`` set, the call runs on a forked RNG seeded with it: the same call with
    the same ``micro_batch_size`` gives the same samples, and the global RNG state is unchanged
    afterwards. Without a seed the global RNG is used (and advanced).

    ``kv_cache``, ``compile`` and ``share_prompt`` choose how ``generate`` runs; the samples'
    distribution and log-probs are the same either way. None is faster at every shape measured
    (``benchmarks/bench_generation.py``; docs/results/performance.md): the static cache with a
    shared prompt pays with many samples of long prompts, so the default stays the dynamic cache.

    Args:
        tokenizer: the policy's tokenizer; must have a pad token.
        model: the policy; may be given later with :meth:`sync`.
        micro_batch_size: most prompts per ``generate`` call (None: all at once).
        kv_cache: Hugging Face's ``"dynamic"`` KV cache (grown every step) or its ``"static"`` one
            (preallocated for the prompt plus ``max_new_tokens``).
        compile: ``torch.compile`` the decoding step (Hugging Face's compiled forward; needs the static
            cache; the first call of each batch shape compiles it).
        share_prompt: with ``n > 1`` samples per prompt, run each prompt through the model once and
            give its ``n`` samples copies of its KV cache, instead of ``n`` copies of the prompt (not
            with ``compile``).
    """

    def __init__(
        self,
        tokenizer,
        model: torch.nn.Module | None = None,
        *,
        micro_batch_size: int | None = None,
        kv_cache: Literal["dynamic", "static"] = "dynamic",
        compile: bool = False,
        share_prompt: bool = False,
    ):
        require_pad_token(tokenizer)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
        HFEngineOptions(kv_cache, compile, share_prompt)  # checks the combination
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.kv_cache, self.compile, self.share_prompt = kv_cache, compile, share_prompt
        self.model: torch.nn.Module | None = None
        if model is not None:
            self.sync(model)

    def sync(self, policy: torch.nn.Module) -> None:
        """Generate with ``policy`` from now on (binds the module; nothing is copied)."""
        if not callable(getattr(policy, "generate", None)):
            raise TypeError(
                f"HFEngine needs a Hugging Face causal LM with .generate(), got {type(policy).__name__}"
            )
        self.model = policy

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> Rollout:
        """Sample ``n`` responses per prompt; see :class:`~alignlit.rollout.base.Rollout`."""
        prompts = check_prompts(prompts, n)
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts)  # (B, P)
        return self._generate(prompts, prompt_ids, prompt_mask, n, sampling)

    def generate_from_ids(
        self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> Rollout:
        """:meth:`generate` from prompts given as token ids, used as they are (nothing is re-tokenised: a
        multi-turn episode's history); same seeding, stop strings, EOS and padding."""
        texts, ids, mask = pad_prompt_ids(self.tokenizer, prompt_ids)  # (B, P)
        return self._generate(check_prompts(texts, n), ids, mask, n, sampling)

    def _generate(
        self, prompts: list[str], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int,
        sampling: SamplingParams,
    ) -> Rollout:  # fmt: skip
        check_sampling(sampling)
        if self.model is None:
            raise RuntimeError("HFEngine has no model: pass model= or call sync(policy) before generate")
        model = self.model
        eos_ids = eos_token_ids(self.tokenizer, getattr(model, "generation_config", None))
        chunk = self.micro_batch_size or len(prompts)
        device = next(model.parameters()).device
        rng_devices = [device] if device.type == "cuda" else []

        was_training = model.training
        model.eval()
        try:
            with (
                torch.no_grad(),
                torch.random.fork_rng(devices=rng_devices, enabled=sampling.seed is not None),
            ):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                samples: list[RawSample] = []
                for start in range(0, len(prompts), chunk):
                    rows = slice(start, start + chunk)
                    samples += self._generate_chunk(
                        prompt_ids[rows], prompt_mask[rows], n, sampling, eos_ids, device
                    )
        finally:
            model.train(was_training)
        return assemble_rollout(
            self.tokenizer,
            prompts,
            n,
            prompt_ids,
            prompt_mask,
            samples,
            stop=sampling.stop,
            eos_ids=eos_ids,
        )

    def _generation_config(self, sampling: SamplingParams, eos_ids: set[int]) -> GenerationConfig:
        """Exactly the sampling asked for: no stored defaults (penalties, lengths, top-k=50) apply."""
        common = dict(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=sorted(eos_ids) or None,
            use_cache=True,
            return_dict_in_generate=True,
            num_beams=1,
        )
        if self.kv_cache == "static":
            common["cache_implementation"] = "static"
        if self.compile:
            compile_config = CompileConfig(fullgraph=False, dynamic=None)
            compile_on_every_device(compile_config)  # transformers compiles on accelerators only otherwise
            common["compile_config"] = compile_config
        else:
            common["disable_compile"] = True
        if sampling.temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            **common,
        )

    def _shared_prompt_cache(
        self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, max_new_tokens: int
    ) -> DynamicCache | StaticCache:
        """The KV cache of every prompt column but the last, computed once per prompt ``(b, p)`` and
        repeated for its ``n`` samples; ``generate`` then runs the last prompt column and samples."""
        config = self.model.config
        if self.kv_cache == "static":  # sized as generate sizes its own: the prompt plus the new tokens
            cache = StaticCache(config=config, max_cache_len=prompt_ids.shape[1] + max_new_tokens)
        else:
            cache = DynamicCache(config=config)
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # as generate's
        self.model(
            input_ids=prompt_ids[:, :-1], attention_mask=attention_mask[:, :-1],
            position_ids=positions[:, :-1], past_key_values=cache, use_cache=True,
        )  # fmt: skip
        if isinstance(cache, DynamicCache):
            cache.batch_repeat_interleave(n)
            return cache
        for layer in cache.layers:  # a static layer has no batch_repeat_interleave of its own
            layer.keys = layer.keys.repeat_interleave(n, dim=0)
            layer.values = layer.values.repeat_interleave(n, dim=0)
            layer.batch_size = layer.keys.shape[0]
        return cache

    def _generate_chunk(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        n: int,
        sampling: SamplingParams,
        eos_ids: set[int],
        device: torch.device,
    ) -> list[RawSample]:
        """Generate for one chunk of prompts; returns ``len(chunk) * n`` raw samples in rollout order."""
        real_cols = prompt_mask.any(0).nonzero()
        first = int(real_cols[0]) if len(real_cols) else 0
        prompts, prompt_attention = prompt_ids[:, first:].to(device), prompt_mask[:, first:].long().to(device)
        input_ids = prompts.repeat_interleave(n, dim=0)  # (b*n, p)
        attention_mask = prompt_attention.repeat_interleave(n, dim=0)  # (b*n, p)
        width = input_ids.shape[1]
        extra = {}
        generation_config = self._generation_config(sampling, eos_ids)
        if self.share_prompt and n > 1 and width > 1:
            extra["past_key_values"] = self._shared_prompt_cache(
                prompts, prompt_attention, n, sampling.max_new_tokens
            )
            generation_config.cache_implementation = None  # the cache is given
        criteria = StoppingCriteriaList()
        stop_criteria = None
        if sampling.stop:
            stop_criteria = _StopStringCriteria(self.tokenizer, sampling.stop, width, input_ids.shape[0])
            criteria.append(stop_criteria)

        behaviour = _BehaviourLogps(sampling.temperature if sampling.temperature > 0 else 1.0)
        # generate() fills every unset field from model.generation_config and then from global
        # defaults (top_k=50, ...): swap in a blank one so only this call's parameters apply.
        stored, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=generation_config,
                stopping_criteria=criteria,
                logits_processor=LogitsProcessorList([behaviour]),
                **extra,
            )
        finally:
            self.model.generation_config = stored
        new_tokens = out.sequences[:, width:]  # (b*n, S)
        token_logps = behaviour.finish(new_tokens)  # (b*n, S)

        samples = []
        for b, (ids, lps) in enumerate(zip(new_tokens.tolist(), token_logps.tolist())):
            length = len(ids)
            eos_at = next((t for t, tok in enumerate(ids) if tok in eos_ids), None)
            if eos_at is not None:
                length = eos_at + 1
            ended_at = stop_criteria.ended_at[b] if stop_criteria is not None else None
            if ended_at is not None and ended_at < length:
                length = ended_at
            samples.append(
                RawSample(ids[:length], lps[:length], ended_early=eos_at is not None or ended_at is not None)
            )
        return samples
