"""``packing="auto"``: a batch runs packed only when that removes enough of its padded token positions."""

from __future__ import annotations

import pytest
import torch

from alignlit.models import forward as fwd
from alignlit.models import make_tiny_llama, packing
from alignlit.models.dispatch import plan_forward
from alignlit.models.forward_settings import MIN_PACKING_SAVING, ForwardSettings, use_forward_settings
from tests.conftest import TINY
from tests.models.test_forward import right_padded


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_tiny_llama(tokenizer, seed=0, **TINY)


def test_saving_by_hand():
    """Rows a = [1 2 | 3 4], b = [1 2 | 5], c = [7 | 8] in width 4: 12 padded positions; packed, a and b
    hold their prompt [1 2] once: 2 + 2 + 1 (group ab) + 1 + 1 (c) = 7 tokens, so 5/12 removed. Without
    the shared prompt (b's prompt [1 9]) the padding alone: 12 - 9 = 3 of 12."""
    ids, attention, loss = right_padded([[1, 2, 3, 4], [1, 2, 5], [7, 8]], [2, 2, 1])
    lengths = packing.prompt_lengths(attention, loss)
    assert packing.packing_saving(ids, attention, lengths) == pytest.approx(5 / 12)
    ids, attention, loss = right_padded([[1, 2, 3, 4], [1, 9, 5], [7, 8]], [2, 2, 1])
    assert packing.packing_saving(ids, attention, packing.prompt_lengths(attention, loss)) == pytest.approx(
        3 / 12
    )
    ids, attention, loss = right_padded([[1, 2], [3, 4]], [1, 1])
    assert packing.packing_saving(ids, attention, packing.prompt_lengths(attention, loss)) == 0.0


def test_auto_packs_from_the_threshold_and_says_why(model):
    assert ForwardSettings().packing == "auto" and ForwardSettings().min_packing_saving == MIN_PACKING_SAVING
    below, above = MIN_PACKING_SAVING / 2, min(0.99, MIN_PACKING_SAVING + 0.1)
    plan = plan_forward(model, saving=lambda: below)
    assert plan.direct and not plan.packed and f"remove {below:.0%}" in plan.reason
    assert plan_forward(model, saving=lambda: above).packed
    assert plan_forward(model, packing=True, saving=lambda: 0.0).packed  # True: whenever possible
    with use_forward_settings(min_packing_saving=0.0):
        assert plan_forward(model, saving=lambda: 0.0).packed
    looked = []
    plan_forward(
        model, layout=lambda: "the rows are not right-padded", saving=lambda: looked.append(1) or 1.0
    )
    assert not looked  # the saving is computed only for a batch that can be packed


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="packing must be True, False or 'auto'"):
        ForwardSettings(packing="yes")
    with pytest.raises(ValueError, match="min_packing_saving must be in"):
        ForwardSettings(min_packing_saving=1.0)


def rollout(n: int, prompt: int, response: int, rows: int = 8):
    """``rows`` samples, ``n`` per prompt, every prompt ``prompt`` and every response ``response`` tokens."""
    g = torch.Generator().manual_seed(n)
    prompt_ids = torch.randint(3, 60, (rows // n, prompt), generator=g).repeat_interleave(n, 0)
    response_ids = torch.randint(3, 60, (rows, response), generator=g)
    return prompt_ids, torch.ones_like(prompt_ids), response_ids, torch.ones_like(response_ids)


def test_forwards_choose_per_batch_with_the_same_values(model, monkeypatch):
    """Eight samples, four per prompt of 6 tokens, 4-token responses: 80 padded positions, 2 * 6 + 8 * 4
    = 44 packed, so 45% removed; one sample per prompt without padding: nothing. The values are those of
    the padded path either way."""
    calls = []
    decoder_hidden = fwd.decoder_hidden

    def spy(*args, prompt_lengths, **kwargs):
        calls.append(prompt_lengths is not None)
        return decoder_hidden(*args, prompt_lengths=prompt_lengths, **kwargs)

    monkeypatch.setattr(fwd, "decoder_hidden", spy)
    shared, single = rollout(4, 6, 4), rollout(1, 6, 4)
    with use_forward_settings(min_packing_saving=0.2):
        for batch, packed in ((shared, True), (single, False)):
            calls.clear()
            auto = fwd.response_token_logprobs(model, *batch).logprobs
            assert calls == [packed]
            torch.testing.assert_close(
                auto, fwd.response_token_logprobs(model, *batch, packing=False).logprobs
            )
    assert packing.packing_saving(
        *fwd.concat_response(*shared[:2], *shared[2:]), torch.tensor([6] * 8)
    ) == pytest.approx(0.45)
    with use_forward_settings(min_packing_saving=0.46):
        calls.clear()
        fwd.response_token_logprobs(model, *shared)
        assert calls == [False]
