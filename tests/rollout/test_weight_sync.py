"""The served-engine client without vLLM: the weight wire format, a gloo broadcast between two processes, the
data-parallel layout of requests, and errors naming the endpoint of a dead or hung engine."""

from __future__ import annotations

import io
import multiprocessing as mp
import socket
import threading

import pytest
import torch

from alignlit.rollout.endpoint import EngineError, EngineHTTP
from alignlit.rollout.hf_worker import WeightSyncError, state_checksum
from alignlit.rollout.server import ServedVLLMEngine, _data_parallel_rows
from alignlit.rollout.weight_sync import (
    WirePlan,
    broadcast_buckets,
    checksum_terms,
    combine,
    open_group,
    pack,
    plan_buckets,
    receive_buckets,
    unpack,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(17, 8, generator=g),
        "layers.0.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "layers.0.scale": torch.randn((), generator=g),  # a 0-d tensor
        "big": torch.randn(300, 64, generator=g),  # larger than one bucket: travels alone
        "steps": torch.arange(7, dtype=torch.int64),
        "half": torch.randn(3, 3, generator=g).half().t(),  # not contiguous
    }


def test_buckets_pack_and_unpack_round_trip_bit_for_bit():
    state = _state()
    tensors = list(state.values())
    counts = plan_buckets(tensors, bucket_bytes=1024)
    plan = WirePlan.of(state, 1024)
    assert sum(counts) == len(tensors) and len(counts) > 1
    assert [plan.names[p] for p in plan.bucket_slices() if "big" in plan.names[p]] == [["big"]]
    assert plan.buckets == counts and plan.checksum == state_checksum(state)
    received = {}
    start = 0
    for part, count in zip(plan.bucket_slices(), counts):
        buffer = pack(tensors[part])
        assert buffer.dtype == torch.uint8 and buffer.numel() == plan.bucket_bytes(part)
        received.update(
            zip(plan.names[part], unpack(buffer.clone(), plan.dtype_names[part], plan.shapes[part]))
        )
        start += count
    assert list(received) == list(state)
    for name, t in state.items():
        assert received[name].dtype == t.dtype and received[name].shape == t.shape
        assert torch.equal(received[name], t), name
    # the per-tensor terms add up to the whole state's checksum exactly, in any arrival order
    terms = checksum_terms(list(reversed(state)), list(reversed(tensors)))
    assert combine(terms) == state_checksum(state)
    with pytest.raises(WeightSyncError, match="bytes"):
        unpack(torch.zeros(3, dtype=torch.uint8), ["float32"], [[1]])


def test_the_checksum_is_exact_whatever_the_threads_and_matches_an_independent_computation():
    """A float sum's rounding follows the threads' split of the reduction (a 570 MB push once failed its check on
    2402278.930051839 vs 2402278.9300518394); the integer checksum does not, and equals numpy's on the bytes."""
    import zlib

    import numpy as np

    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(3_000_000, generator=g), "half": torch.randn(7, generator=g).to(torch.bfloat16),
             "flag": torch.tensor([True, False, True]), "double": torch.randn(5, dtype=torch.float64, generator=g)}  # fmt: skip
    threads = torch.get_num_threads()
    try:
        sums = []
        for n in (1, 2):
            torch.set_num_threads(n)
            sums.append(state_checksum(state))
    finally:
        torch.set_num_threads(threads)
    assert sums[0] == sums[1]

    def reference(name, t):
        raw = (
            t.contiguous().view(torch.uint8).numpy().tobytes()
            if t.dtype != torch.bool
            else t.numpy().tobytes()
        )
        word = {1: np.uint8, 2: np.int16}.get(t.element_size(), np.int32)
        b = np.frombuffer(raw, dtype=word).astype(object)  # Python integers: exact
        return (
            int(sum(int(v) * (1 + i % 7) for i, v in enumerate(b))) * (zlib.crc32(name.encode()) | 1) % 2**64
        )

    small = {k: v for k, v in state.items() if k != "big"} | {"big": state["big"][:1000]}
    assert state_checksum(small) == sum(reference(k, v) for k, v in small.items()) % 2**64
    flipped = state["double"].clone()
    flipped.view(torch.int64)[2] ^= 1  # the last bit of one float64
    assert state_checksum({**state, "double": flipped}) != sums[0]
    assert state_checksum({"a": state["double"]}) != state_checksum({"b": state["double"]})


def _receiver(port: int, plan: dict, out) -> None:
    group = open_group("127.0.0.1", port, 1, 2, 60)
    got = {}
    for names, tensors in receive_buckets(group, WirePlan(**plan)):
        got.update({n: t.clone() for n, t in zip(names, tensors)})
    buffer = io.BytesIO()  # bytes, not tensors: a queued tensor's shared storage dies with this process
    torch.save(got, buffer)
    out.put(buffer.getvalue())


def test_gloo_broadcast_delivers_equal_tensors_to_another_process():
    import datetime

    import torch.distributed as dist

    state = _state()
    plan = WirePlan.of(state, bucket_bytes=2048)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(store.port, vars(plan), out))
    proc.start()
    group = open_group("127.0.0.1", store.port, 0, 2, 60, store=store)
    broadcast_buckets(group, plan, list(state.values()))
    got = torch.load(io.BytesIO(out.get(timeout=60)))
    proc.join(timeout=30)
    assert list(got) == list(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert combine(checksum_terms(list(got), list(got.values()))) == plan.checksum


def test_data_parallel_rows_interleave_like_the_data_sampler():
    # two ranks with 3 prompts each: rank r's row i is global row 2i + r (RankZeroServedEngine's layout)
    asked = [(0, 3), (1, 3)]
    assert _data_parallel_rows(asked, 0) == [0, 2, 4] and _data_parallel_rows(asked, 1) == [1, 3, 5]
    # tensor-parallel peers (same data-parallel rank) get the same rows
    assert _data_parallel_rows([(0, 2), (0, 2), (1, 2), (1, 2)], 1) == [1, 3]
    # unequal shares: consecutive
    assert _data_parallel_rows([(0, 1), (1, 3)], 1) == [1, 2, 3]


def test_a_dead_endpoint_is_named(tokenizer):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = ServedVLLMEngine([f"127.0.0.1:{port}"], tokenizer, start_timeout_s=2)
    with pytest.raises(EngineError, match=rf"http://127.0.0.1:{port} did not start"):
        engine.connect()
    http = EngineHTTP(f"http://127.0.0.1:{port}")
    with pytest.raises(
        EngineError, match=rf"rollout engine http://127.0.0.1:{port} failed .* while generating"
    ):
        http.call("/inference/v1/generate", {}, what="generating")


def test_a_hung_endpoint_times_out_with_its_name():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    thread.start()  # accepts the connection and never answers
    try:
        http = EngineHTTP(f"http://127.0.0.1:{port}", timeout_s=1.5)
        with pytest.raises(
            EngineError, match=rf"rollout engine http://127.0.0.1:{port} timed out .*timeout 2 s"
        ):
            http.call("/inference/v1/generate", {"token_ids": [1]}, what="generating 1 prompts x 1")
    finally:
        for conn, _ in accepted:
            conn.close()
        server.close()


def test_client_arguments_are_checked(tokenizer):
    with pytest.raises(ValueError, match="non-empty list"):
        ServedVLLMEngine("http://a:1", tokenizer)
    with pytest.raises(ValueError, match="weight_sync"):
        ServedVLLMEngine(["http://a:1"], tokenizer, weight_sync="nfs")
    with pytest.raises(ValueError, match="repeat"):
        ServedVLLMEngine(["http://a:1", "a:1/"], tokenizer)


def test_rollout_loop_needs_endpoints_with_vllm_server():
    from alignlit.rollout import RolloutLoop

    with pytest.raises(ValueError, match="endpoints"):
        RolloutLoop(engine="vllm_server")
    with pytest.raises(ValueError, match="endpoints"):
        RolloutLoop(engine="hf", endpoints=["http://a:1"])
    assert RolloutLoop(engine="vllm_server", endpoints=["http://a:1"]).endpoints == ["http://a:1"]
