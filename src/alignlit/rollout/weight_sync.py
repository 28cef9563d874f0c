"""Weights pushed from the trainer to served vLLM engines (``rollout.engine: vllm_server``).

The wire format both sides share, and the trainer's side of the push; the engine's side is a weight-transfer
backend of vLLM's own (:mod:`alignlit.rollout.vllm_worker`, registered as ``"gloo"``), driven through vLLM's
weight-transfer HTTP routes (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``). One push:

1. every engine is paused (running requests finish first: no request ever sees two weight versions);
2. ``/start_weight_update`` opens vLLM's layerwise reload on every engine;
3. ``/update_weights`` carries the names, dtypes and shapes, the bucket layout and the checksum of the state
   (:func:`~alignlit.rollout.hf_worker.state_checksum`); while every engine waits in it, trainer rank 0
   broadcasts the tensors over a ``torch.distributed`` group of its own with the engines' workers (gloo: the
   tensors travel as flat byte buffers of at most ``bucket_mb``); each worker loads every bucket as it arrives
   (vLLM's ``load_weights``, the checkpoint's names: fused projections and tensor-parallel shards are vLLM's
   business) and compares the checksum of what it received with the one sent: a mismatch fails the update; a
   plan without a checksum is refused; the client then reads every worker's checksum of what it received
   (``alignlit_last_checksum``) and compares it with the one it pushed;
4. ``/finish_weight_update`` closes the reload and labels the engine's weights with the version; vLLM stamps
   every sampled token with the label of the weights that sampled it, which the client checks on every sample;
5. the prefix cache is reset (no KV block of the old weights is reused) and generation resumes.

The file fallback (:meth:`alignlit.rollout.endpoint.EngineHTTP.load_file`) writes the state as safetensors into a folder both sides see
and has every engine load it through the same extension (checksum and label alike).

The group's rendezvous store listens on the address given only (:func:`listen_store`; torch's ``TCPStore``
alone listens on every interface), and its keys live under a prefix derived from the shared secret and a
nonce of this connection (:func:`~alignlit.rollout.engine_auth.group_prefix`): a process without the secret
cannot take a rank of the group.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignlit.rollout.endpoint import EngineHTTP, run_all
from alignlit.rollout.engine_auth import group_prefix
from alignlit.rollout.hf_worker import WeightSyncError, state_checksum, tensor_checksum

ALIGN = 16
"""Every tensor starts at a multiple of this many bytes in a bucket (a view of another dtype needs it)."""


# ---------------------------------------------------------------------------------------------- wire format
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[int]:
    """How many consecutive tensors each bucket holds: a bucket is closed before it would pass
    ``bucket_bytes`` (a tensor larger than that travels alone)."""
    counts, size, count = [], 0, 0
    for t in tensors:
        nbytes = _padded(t.numel() * t.element_size())
        if count and size + nbytes > bucket_bytes:
            counts.append(count)
            size, count = 0, 0
        size += nbytes
        count += 1
    if count:
        counts.append(count)
    return counts


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 CPU buffer holding the tensors' bytes, each from a multiple of ``ALIGN`` bytes."""
    parts = []
    for t in tensors:
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        if _padded(raw.numel()) > raw.numel():
            parts.append(torch.zeros(_padded(raw.numel()) - raw.numel(), dtype=torch.uint8))
    return torch.cat(parts)


def unpack(
    buffer: torch.Tensor, dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The tensors :func:`pack` put in ``buffer`` (views into it)."""
    out, offset = [], 0
    for name, shape in zip(dtypes, shapes):
        nbytes = _nbytes(name, shape)
        if offset + nbytes > buffer.numel():
            break
        out.append(
            buffer[offset : offset + nbytes].view(getattr(torch, name)).reshape([int(s) for s in shape])
        )
        offset += _padded(nbytes)
    if offset != buffer.numel() or len(out) != len(dtypes):
        raise WeightSyncError(f"a weight bucket of {buffer.numel()} bytes held {offset} bytes of tensors")
    return out


def checksum_terms(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> dict[str, int]:
    """Each tensor's term of :func:`~alignlit.rollout.hf_worker.state_checksum`; :func:`combine` of all terms
    equals the checksum of the whole state exactly (integers), whatever the buckets."""
    return {name: tensor_checksum(name, t) for name, t in zip(names, tensors)}


def combine(terms: dict[str, int]) -> int:
    return sum(terms.values()) % 2**64


@dataclass
class WirePlan:
    """What ``/update_weights`` tells the engines (JSON): names, dtypes, shapes, tensors per bucket, and the
    checksum of the whole state (an engine refuses a plan without one)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[int]
    checksum: int | None = None

    @classmethod
    def of(cls, state: dict[str, torch.Tensor], bucket_bytes: int) -> WirePlan:
        names = list(state)
        tensors = [state[k] for k in names]
        return cls(
            names=names,
            dtype_names=[dtype_name(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            buckets=plan_buckets(tensors, bucket_bytes),
            checksum=state_checksum(state),
        )

    def bucket_slices(self) -> Iterator[slice]:
        start = 0
        for count in self.buckets:
            yield slice(start, start + count)
            start += count

    def bucket_bytes(self, part: slice) -> int:
        return sum(_padded(_nbytes(d, s)) for d, s in zip(self.dtype_names[part], self.shapes[part]))


# ---------------------------------------------------------------------------------------------- the group
def listen_store(address: str, world_size: int, timeout_s: float):
    """The rendezvous store of the weight group, listening on ``address`` only, on a free port (``.port``).

    ``TCPStore(address, 0, is_master=True)`` listens on every interface whatever ``address`` says; here the
    listening socket is bound to ``address`` first and handed to the store (``master_listen_fd``), which owns
    it from then on."""
    import torch.distributed as dist

    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(sockaddr)
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
    except OSError as err:
        sock.close()
        raise WeightSyncError(f"cannot listen for the weight group on {address}: {err}") from None
    return dist.TCPStore(
        address, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(),
    )  # fmt: skip


def open_group(
    address: str, port: int, rank: int, world_size: int, timeout_s: float, *, store=None,
    secret: str | None = None, nonce: str = "",
):  # fmt: skip
    """A gloo process group of its own (not the trainer's default group) between trainer rank 0 (rank 0,
    which hosts the rendezvous store) and the engines' workers; returns the ``ProcessGroupGloo``. Its keys
    live under :func:`~alignlit.rollout.engine_auth.group_prefix` of ``secret`` and ``nonce``: members with
    another secret never meet, and each side fails after ``timeout_s`` with :class:`WeightSyncError`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        return dist.ProcessGroupGloo(
            dist.PrefixStore(group_prefix(secret, nonce), store), rank, world_size, timeout
        )
    # DistStoreError is a RuntimeError; its text names the group's keys, so it is left out
    except (RuntimeError, OSError) as err:
        raise WeightSyncError(
            f"rank {rank} of {world_size} could not form the weight group at {address}:{port} within "
            f"{timeout_s:.0f} s ({type(err).__name__}): every member must reach that address and hold the same "
            "shared secret (ALIGNLIT_API_KEY)"
        ) from None


def broadcast_buckets(group, plan: WirePlan, tensors: Sequence[torch.Tensor]) -> None:
    """Trainer side: send every bucket from rank 0."""
    for part in plan.bucket_slices():
        buffer = pack(tensors[part])
        group.broadcast(buffer, 0).wait()


def receive_buckets(group, plan: WirePlan) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
    """Engine side: receive every bucket from rank 0, as ``(names, tensors)``."""
    for part in plan.bucket_slices():
        buffer = torch.empty(plan.bucket_bytes(part), dtype=torch.uint8)
        group.broadcast(buffer, 0).wait()
        yield plan.names[part], unpack(buffer, plan.dtype_names[part], plan.shapes[part])


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the engines connect back to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class CollectivePush:
    """Trainer rank 0's side of the collective weight push to every engine (module docstring).

    Args:
        engines: the engines' endpoints.
        bucket_mb: largest bucket broadcast at once (MiB).
        address: the address the engines reach this process at (default: this machine's address on the route
            to the first engine).
        timeout_s: the group's timeout (a broadcast nobody answers fails after it).
        secret: the shared secret (the group's rendezvous keys derive from it; None: no key, loopback only).

    Every push carries the state's checksum; every engine compares it with what it received, and answers the
    checksum it computed, which must equal the one pushed.
    """

    def __init__(
        self,
        engines: Sequence[EngineHTTP],
        *,
        bucket_mb: float = 64.0,
        address: str | None = None,
        timeout_s: float = 600.0,
        secret: str | None = None,
    ):
        self.engines = list(engines)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.address = address or route_address(self.engines[0].host, self.engines[0].port)
        self.timeout_s = timeout_s
        self._secret = secret
        self.group = None
        self.world_size = 0

    def connect(self) -> None:
        """Form the group: rank 0 here, then each engine's workers (``/get_world_size``) in endpoint order."""

        sizes = [
            int(e.call("/get_world_size?include_dp=true", what="asking its number of workers")["world_size"])
            for e in self.engines
        ]
        self.world_size = 1 + sum(sizes)
        store = listen_store(self.address, self.world_size, self.timeout_s)
        nonce = secrets.token_hex(16)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        result: dict[str, Any] = {}

        def join_here() -> None:
            result["group"] = open_group(
                self.address, store.port, 0, self.world_size, self.timeout_s, store=store,
                secret=self._secret, nonce=nonce,
            )  # fmt: skip

        calls: list[Callable[[], Any]] = [
            lambda e=e, off=off: e.call(
                "/init_weight_transfer_engine",
                {
                    "init_info": {
                        "master_address": self.address,
                        "master_port": store.port,
                        "rank_offset": off,
                        "world_size": self.world_size,
                        "timeout_s": self.timeout_s,
                        "group_nonce": nonce,
                    }
                },
                what=f"joining the weight group at {self.address}:{store.port}",
            )
            for e, off in zip(self.engines, offsets)
        ]
        run_all([*calls, join_here])
        self.group = result["group"]
        self._store = store  # the rendezvous store lives as long as the group

    def push(self, state: dict[str, torch.Tensor], label: str) -> dict[str, float]:
        """Broadcast ``state`` (CPU tensors, the checkpoint's names) to every engine and label it ``label``;
        returns timings."""
        if self.group is None:
            self.connect()
        start = time.perf_counter()
        names = list(state)
        tensors = [state[k].detach().cpu().contiguous() for k in names]
        plan = WirePlan.of(dict(zip(names, tensors)), self.bucket_bytes)
        planned = time.perf_counter()
        run_all(
            [
                lambda e=e: e.call("/pause?mode=wait&clear_cache=false", {}, what="pausing")
                for e in self.engines
            ]
        )
        try:
            run_all(
                [
                    lambda e=e: e.call("/start_weight_update", {}, what=f"starting update {label}")
                    for e in self.engines
                ]
            )
            sent: dict[str, float] = {}

            def send() -> None:
                t0 = time.perf_counter()
                broadcast_buckets(self.group, plan, tensors)
                sent["broadcast_s"] = time.perf_counter() - t0

            updates: list[Callable[[], Any]] = [
                lambda e=e: e.call(
                    "/update_weights", {"update_info": vars(plan)}, what=f"receiving weights {label}"
                )
                for e in self.engines
            ]
            run_all([*updates, send])
            run_all([lambda e=e: check_received(e, plan.checksum, label) for e in self.engines])
            body = {"weight_version": label}
            run_all(
                [
                    lambda e=e: e.call("/finish_weight_update", body, what=f"finishing update {label}")
                    for e in self.engines
                ]
            )
            run_all([lambda e=e: e.reset_prefix_cache(label) for e in self.engines])
        finally:
            run_all([lambda e=e: e.call("/resume", {}, what="resuming") for e in self.engines])
        return {
            "plan_s": planned - start,
            "broadcast_s": sent.get("broadcast_s", float("nan")),
            "total_s": time.perf_counter() - start,
            "bytes": float(sum(t.numel() * t.element_size() for t in tensors)),
        }


def check_received(engine: EngineHTTP, checksum: int, label: str) -> None:
    """Every worker of ``engine`` must answer (``alignlit_last_checksum``) the checksum of the push: else
    :class:`WeightSyncError` naming the endpoint."""
    got = engine.rpc_all("alignlit_last_checksum", what=f"reading the checksum of weights {label}")
    wrong = [c for c in got if str(c) != str(checksum)]  # JSON may carry a 64-bit checksum as a string
    if wrong:
        raise WeightSyncError(
            f"rollout engine {engine.url} received weights {label} with checksum {wrong[0]!r}, the trainer "
            f"pushed {checksum!r}: it holds other weights than the trainer's"
        )


class FilePush:
    """The file fallback: rank 0 writes the state as safetensors into ``folder`` (a path every engine reads,
    e.g. ``/dev/shm`` on one machine or a shared filesystem), and each engine loads it, checks the checksum
    and answers the checksum of what it loaded, which must equal the one pushed."""

    def __init__(self, engines: Sequence[EngineHTTP], folder: str | Path | None = None):
        self.engines = list(engines)
        shm = Path("/dev/shm")
        self.folder = Path(folder) if folder is not None else (shm if shm.is_dir() else Path("/tmp"))

    def push(self, state: dict[str, torch.Tensor], label: str) -> dict[str, float]:
        import shutil
        import tempfile

        from safetensors.torch import save_file

        start = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="alignlit-served-sync-", dir=self.folder))
        try:
            # tied weights share storage, which safetensors refuses: every tensor is written on its own
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
            checksum = state_checksum(tensors)
            save_file(tensors, str(folder / "model.safetensors"))
            written = time.perf_counter()
            run_all([lambda e=e: e.load_file(str(folder), label, checksum) for e in self.engines])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {
            "write_s": written - start,
            "total_s": time.perf_counter() - start,
            "bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
        }
