"""The engine's side of served rollouts, loaded into vLLM's own worker processes (``alignlit serve`` passes
``--worker-extension-cls alignlit.rollout.vllm_worker.AlignlitWorkerExtension``).

Importing this module registers :class:`GlooWeightTransferEngine` as vLLM's weight-transfer backend ``"gloo"``
(``--weight-transfer-config '{"backend": "gloo"}'``): vLLM 0.32 ships ``nccl`` and ``ipc`` backends, both
CUDA-only, so on CPU (and across machines without NCCL) the trainer's tensors arrive over a gloo group instead
and are loaded with vLLM's own layerwise reload, exactly as its NCCL backend does. The wire format is
:mod:`alignlit.rollout.weight_sync`'s. The extension adds two worker calls reached through vLLM's
``/collective_rpc``: :meth:`~AlignlitWorkerExtension.alignlit_info` (what the client checks when it connects,
with the proof that this engine holds the shared secret), :meth:`~AlignlitWorkerExtension.alignlit_load_file`
(the file fallback) and :meth:`~AlignlitWorkerExtension.alignlit_last_checksum` (the checksum of the weights
the last collective push delivered). A push without a checksum is refused. The shared secret is
``$ALIGNLIT_API_KEY`` of the engine's processes (``alignlit serve`` sets it).

This module imports vLLM; nothing else in alignlit imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from alignlit.rollout.engine_auth import API_KEY_ENV, key_proof
from alignlit.rollout.hf_worker import WeightSyncError
from alignlit.rollout.vllm_internals import register_weight_transfer_backend
from alignlit.rollout.weight_sync import WirePlan, checksum_terms, combine, open_group, receive_buckets

RECEIVED: dict[str, int | None] = {"checksum": None}
"""The checksum of what the last collective push delivered to this worker (None: none, or it failed)."""


def _secret() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's rendezvous store listens, this engine's first rank in the group, the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0
    group_nonce: str = ""


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """:class:`~alignlit.rollout.weight_sync.WirePlan`'s fields."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[int]
    checksum: int | None = None


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives checkpoint-format weights broadcast by trainer rank 0 over gloo and loads them bucket by bucket
    inside vLLM's layerwise reload (``start_weight_update`` / ``finish_weight_update``), like vLLM's NCCL engine.
    The checksum of what arrived must equal the one the trainer sent, or the update fails."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.last_checksum: int | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s,
            secret=_secret(), nonce=init_info.group_nonce,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():  # vLLM's base synchronises the accelerator, which fails on CPU
            torch.cuda.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        plan = WirePlan(**vars(update_info))
        RECEIVED["checksum"] = None
        if not isinstance(plan.checksum, int) or isinstance(plan.checksum, bool):
            for _ in receive_buckets(self.group, plan):  # keep the broadcast in step, load nothing
                pass
            raise WeightSyncError(f"a weight push without a checksum is refused (got {plan.checksum!r})")
        terms: dict[str, int] = {}
        with disable_mtp_completeness_check():
            for names, tensors in receive_buckets(self.group, plan):
                terms.update(checksum_terms(names, tensors))
                self.model.load_weights(
                    [
                        (n, t.to(self.device) if self.device.type != "cpu" else t)
                        for n, t in zip(names, tensors)
                    ]
                )
        self.last_checksum = combine(terms)
        if self.last_checksum != plan.checksum:
            raise WeightSyncError(
                f"the engine received weights with checksum {self.last_checksum!r}, the trainer sent "
                f"{plan.checksum!r}"
            )
        RECEIVED["checksum"] = self.last_checksum

    def shutdown(self) -> None:
        self.group = None


register_weight_transfer_backend("gloo", GlooWeightTransferEngine)


class AlignlitWorkerExtension:
    """Worker calls alignlit's client makes through ``/collective_rpc`` (mixed into vLLM's worker class)."""

    def alignlit_info(self, nonce: str = "") -> dict:
        """The engine's settings the client depends on, and its proof of the shared secret for ``nonce``
        (:func:`~alignlit.rollout.engine_auth.key_proof`; None: the engine has no key)."""
        model_config = self.vllm_config.model_config
        transfer = self.vllm_config.weight_transfer_config
        return {
            "model": str(model_config.model),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "logprobs_mode": str(model_config.logprobs_mode),
            "max_model_len": int(model_config.max_model_len),
            "weight_transfer": None if transfer is None else transfer.backend,
            "generation_config": str(model_config.generation_config),
            "key_proof": key_proof(_secret(), str(nonce)),
        }

    def alignlit_last_checksum(self) -> int | None:
        """The checksum of the weights the last collective push delivered to this worker (None: none did)."""
        return RECEIVED["checksum"]

    def alignlit_load_file(self, folder: str, checksum: int) -> dict:
        """Load ``folder/model.safetensors`` into the model (vLLM's ``reload_weights``) if its checksum is
        ``checksum`` (required: None is refused); answers the checksum of what it loaded."""
        from pathlib import Path

        from safetensors.torch import load_file

        from alignlit.rollout.hf_worker import state_checksum

        if not isinstance(checksum, int) or isinstance(checksum, bool):
            raise WeightSyncError(f"loading {folder} without a checksum is refused (got {checksum!r})")
        state = load_file(str(Path(folder) / "model.safetensors"))
        got = state_checksum(state)
        if got != checksum:
            raise WeightSyncError(
                f"the engine read weights with checksum {got!r} from {folder}, expected {checksum!r}"
            )
        self.reload_weights(weights_iterator=list(state.items()), is_checkpoint_format=True)
        return {"checksum": got}
