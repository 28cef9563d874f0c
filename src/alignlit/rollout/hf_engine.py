"""Rollouts with Hugging Face ``generate`` on the training model itself (the embedded default)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

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


class HFEngine:
    """Samples with ``model.generate`` from the policy being trained (no copy of the weights).

    Prompts are left-padded and generated in chunks of at most ``micro_batch_size`` prompts (each
    with its ``n`` samples), with the KV cache on, in eval mode under ``torch.no_grad``; the
    model's train/eval mode is restored afterwards. Log-probs are ``log_softmax(logits / T)`` of
    the sampled tokens from the raw logits (before top-k/top-p; ``T = 1`` for greedy).

    With ``sampling.seed`` set, the call runs on a forked RNG seeded with it: the same call with
    the same ``micro_batch_size`` gives the same samples, and the global RNG state is unchanged
    afterwards. Without a seed the global RNG is used (and advanced).

    Args:
        tokenizer: the policy's tokenizer; must have a pad token.
        model: the policy; may be given later with :meth:`sync`.
        micro_batch_size: most prompts per ``generate`` call (None: all at once).
    """

    def __init__(
        self, tokenizer, model: torch.nn.Module | None = None, *, micro_batch_size: int | None = None
    ):
        require_pad_token(tokenizer)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
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
            output_logits=True,
            num_beams=1,
        )
        if sampling.temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            **common,
        )

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
        input_ids = prompt_ids[:, first:].repeat_interleave(n, dim=0).to(device)  # (b*n, p)
        attention_mask = prompt_mask[:, first:].repeat_interleave(n, dim=0).long().to(device)  # (b*n, p)
        width = input_ids.shape[1]
        criteria = StoppingCriteriaList()
        stop_criteria = None
        if sampling.stop:
            stop_criteria = _StopStringCriteria(self.tokenizer, sampling.stop, width, input_ids.shape[0])
            criteria.append(stop_criteria)

        # generate() fills every unset field from model.generation_config and then from global
        # defaults (top_k=50, ...): swap in a blank one so only this call's parameters apply.
        stored, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=self._generation_config(sampling, eos_ids),
                stopping_criteria=criteria,
            )
        finally:
            self.model.generation_config = stored
        new_tokens = out.sequences[:, width:]  # (b*n, S)
        scale = sampling.temperature if sampling.temperature > 0 else 1.0
        # out.logits: S raw (unprocessed) float32 logits of shape (b*n, V); one step at a time.
        token_logps = torch.stack(
            [
                torch.log_softmax(step_logits / scale, dim=-1).gather(-1, new_tokens[:, t, None]).squeeze(-1)
                for t, step_logits in enumerate(out.logits)
            ],
            dim=1,
        )  # (b*n, S)

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
