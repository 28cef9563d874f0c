"""A reward's own counters (``metrics()``: math-verify timeouts, judge failures) are logged with each rollout."""

from __future__ import annotations

from alignlit.models import load_policy
from alignlit.rollout import RolloutLoop, SamplingParams
from alignlit.rollout.reward_protocol import reward_counters


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, responses):
        self.calls += 1
        return [0.0] * len(responses)

    def metrics(self):
        return {"counting/calls": self.calls}


def test_reward_counters_reach_the_rollout_metrics(tiny_policy_dir):
    policy, tokenizer = load_policy(str(tiny_policy_dir))
    loop = RolloutLoop(sampling=SamplingParams(max_new_tokens=3), samples_per_prompt=2)
    loop.setup(policy, tokenizer)
    reward = Counting()
    loop.collect(["\n\nHuman: sort b a\n\nAssistant:"], reward)
    exp = loop.collect(["\n\nHuman: sort b a\n\nAssistant:"], reward)
    assert exp.metrics["counting/calls"] == 2.0
    assert reward_counters(lambda p, r: [0.0]) == {}
