"""full_state_dict: the one gatherer of a model's full state dict (exports, engine syncs, weight snapshots)."""

from __future__ import annotations

import copy
import socket

import pytest
import torch

from alignlit.models import make_tiny_llama
from alignlit.models.lora import LoRA, apply_lora, merged_state_dict
from alignlit.models.state_dict import full_state_dict
from tests.conftest import TINY


@pytest.fixture(scope="module")
def policy(tokenizer):
    return make_tiny_llama(tokenizer, seed=0, **TINY)


def test_plain_model_gives_its_state_dict_detached_on_the_device(policy):
    expected = policy.state_dict()
    state = full_state_dict(policy)
    assert list(state) == list(expected)
    for name, tensor in state.items():
        assert tensor.device.type == "cpu" and not tensor.requires_grad, name
        assert torch.equal(tensor, expected[name]), name
    kept = full_state_dict(policy, None)
    assert all(kept[k].device == v.device for k, v in expected.items())


def test_merge_lora_gives_the_merged_weights_under_the_checkpoint_names(policy):
    lora_policy = apply_lora(copy.deepcopy(policy), LoRA(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, p in lora_policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    merged = full_state_dict(lora_policy, merge_lora=True)
    assert merged.keys() == policy.state_dict().keys()
    expected = merged_state_dict(lora_policy)
    assert all(torch.equal(merged[k], expected[k]) for k in merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], policy.state_dict()[q]), "the adapter was not merged"
    # without merge_lora the adapter's own names stay (what an export of the adapter writes)
    assert any(".lora_A." in k for k in full_state_dict(lora_policy))
    # merge_lora on a model without an adapter is its plain state dict
    assert full_state_dict(policy, merge_lora=True).keys() == policy.state_dict().keys()


def test_fsdp2_dtensor_shards_become_full_tensors(policy):
    """One gloo process, a one-device mesh: every tensor of the sharded copy is a DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    assert not dist.is_initialized(), "a process group leaked from another test"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        sharded = copy.deepcopy(policy)
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        assert all(isinstance(t, DTensor) for t in sharded.state_dict().values())
        gathered = full_state_dict(sharded, merge_lora=True)
    finally:
        dist.destroy_process_group()
    expected = policy.state_dict()
    assert set(gathered) == set(expected)
    for name, tensor in gathered.items():
        assert type(tensor) is torch.Tensor and torch.equal(tensor, expected[name]), name
