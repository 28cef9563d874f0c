"""Tools (issue 36): each case failed on main before the fix, and passes after.

- a tool that sleeps hung the rollout: every tool call is bounded by ``tool_timeout_s``, answered with an
  ``error: ...`` reply and counted (``episode/tool_timeouts``);
- ``SystemExit`` / ``KeyboardInterrupt`` raised by a tool escaped the rollout: they are the tool's errors
  (while a real Ctrl-C of the trainer, delivered to the main thread, still stops it);
- the JSON parser looked for the literal ``{"name"``: ``{ "name": ...}``, pretty-printed calls and
  ``{"arguments": ..., "name": ...}`` were stepped as final answers;
- after ``max_tool_calls`` a malformed call still got an error reply and counted as a call;
- a chat template with no tool role rendered a result as if the user had said it.

Every test that could hang on a regression runs its body in a thread joined with a timeout.
"""

from __future__ import annotations

import _thread
import threading
import time

import pytest

from alignlit.rollout import (
    ChatTemplateToolParser,
    JSONToolParser,
    SamplingParams,
    ToolCall,
    ToolEnvironment,
    run_episodes,
)
from alignlit.sim import SimHintEnvironment
from tests.rollout.test_episodes import PROMPT, ScriptedEngine, words


def bounded(fn, timeout_s: float = 20.0):
    """``fn()`` in a thread: its result, or a failure (never a hang) when it runs past ``timeout_s``."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as err:
            box["err"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert not worker.is_alive(), f"hung: still running after {timeout_s} s"
    err = box.get("err")
    if err is not None and not isinstance(err, Exception):  # would end the test session, not fail a test
        raise AssertionError(f"{type(err).__name__} escaped out of the rollout") from err
    if err is not None:
        raise err
    return box["out"]


def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def exits() -> str:
    raise SystemExit(3)


def interrupts() -> str:
    raise KeyboardInterrupt


CALL = '{"name": "%s", "arguments": %s}'


def test_a_tool_that_sleeps_is_cut_at_its_timeout_and_counted():
    env = ToolEnvironment(SimHintEnvironment(), tools={"sleep": sleep}, tool_timeout_s=0.3)
    env.reset(PROMPT, seed=0)
    start = time.perf_counter()
    step = bounded(lambda: env.step(CALL % ("sleep", '{"seconds": 60}')))
    assert time.perf_counter() - start < 5
    assert "error: the tool 'sleep' did not return within 0.3 s (tool_timeout_s)" in step.observation
    assert not step.done and step.info == {"tool_calls": 1, "tool_errors": 1, "tool_timeouts": 1}
    # a quick call under the same limit returns its result
    assert "slept" in env.step(CALL % ("sleep", '{"seconds": 0}')).observation


def test_a_timed_out_tool_is_counted_in_the_episode_metrics(tokenizer):
    env = ToolEnvironment(SimHintEnvironment(), tools={"sleep": sleep}, tool_timeout_s=0.2)
    call, answer = words(tokenizer, CALL % ("sleep", '{"seconds": 60}')), words(tokenizer, " a c d")
    engine = ScriptedEngine(tokenizer, [[call], [answer]])
    rollout, stats = bounded(
        lambda: run_episodes(
            engine,
            tokenizer,
            env,
            [PROMPT],
            1,
            SamplingParams(max_new_tokens=64, seed=0),
            max_turns=3,
            max_episode_tokens=256,
        )
    )
    metrics = stats.metrics()
    assert metrics["episode/tool_timeouts"] == 1.0 and metrics["episode/tool_errors"] == 1.0
    assert "did not return within" in rollout.texts[0] and metrics["episode/turns"] == 2.0


@pytest.mark.parametrize(
    ("tool", "expected"), [(exits, "error: SystemExit: 3"), (interrupts, "error: KeyboardInterrupt")]
)
def test_systemexit_and_keyboardinterrupt_from_a_tool_are_its_errors(tool, expected):
    env = ToolEnvironment(SimHintEnvironment(), tools={"t": tool})
    env.reset(PROMPT, seed=0)
    step = bounded(lambda: env.step(CALL % ("t", "{}")))
    assert expected in step.observation and step.info["tool_errors"] == 1 and not step.done


def test_a_real_ctrl_c_during_a_tool_call_still_stops_the_run():
    """The trainer's Ctrl-C (SIGINT, delivered to the main thread that waits on the tool) propagates.

    Python's own SIGINT handler is installed for the test: ``_thread.interrupt_main`` does nothing while
    SIGINT is ignored or at SIG_DFL, which a test run earlier in the same process may have left."""
    import signal

    env = ToolEnvironment(SimHintEnvironment(), tools={"sleep": sleep}, tool_timeout_s=30)
    env.reset(PROMPT, seed=0)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            env.step(CALL % ("sleep", '{"seconds": 5}'))
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 4


@pytest.mark.parametrize(
    "text",
    [
        '{ "name": "check", "arguments": {"answer": "a c d"}}',
        'I will check.\n{\n  "name": "check",\n  "arguments": {\n    "answer": "a c d"\n  }\n}\n',
        '{"arguments": {"answer": "a c d"}, "name": "check"}',
        'first {"note": 1} then {"arguments": {"answer": "a c d"},\n "name": "check"}',
    ],
)
def test_tool_calls_in_any_json_spacing_or_key_order_are_calls(text):
    assert JSONToolParser().parse(text) == ToolCall("check", {"answer": "a c d"})
    env = ToolEnvironment(SimHintEnvironment(tool=True))
    env.reset(PROMPT, seed=0)
    step = env.step(text)
    assert step.info["tool_calls"] == 1 and "right" in step.observation and not step.done


def test_objects_that_are_not_calls_are_not_calls():
    parser = JSONToolParser()
    assert parser.parse('the set {1, 2} and {"answer": {"name": "x"}} and { broken') is None
    with pytest.raises(ValueError, match="not valid JSON"):
        parser.parse('{ "name": "check", "arguments": {"answer": ')


def test_after_max_tool_calls_a_malformed_call_is_stepped_as_an_answer():
    env = ToolEnvironment(SimHintEnvironment(tool=True, attempts=3), max_tool_calls=1)
    env.reset(PROMPT, seed=0)
    assert env.step(CALL % ("check", '{"answer": "x"}')).info["tool_calls"] == 1
    step = env.step('{"name": "check", "arguments": {"answer": ')
    assert step.info.get("tool_calls", 0) == 0 and step.info.get("tool_errors", 0) == 0
    assert "copy" in step.observation  # the hint environment's reply to a wrong answer, not a tool error
    assert env.step(CALL % ("nope", "{}")).info.get("tool_calls", 0) == 0


GENERIC = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTENT_ONLY = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
USER_FOR_TOOL = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% else %}U: {% endif %}{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
RAISES = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


@pytest.fixture()
def chat_tokenizer(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path) if tokenizer.name_or_path else tokenizer
    yield tok


@pytest.mark.parametrize(
    ("template", "match"),
    [
        (CONTENT_ONLY, "renders a tool message exactly as a user message"),
        (USER_FOR_TOOL, "renders a tool message exactly as a user message"),
        (RAISES, "cannot render a tool message .*Only user and assistant"),
    ],
)
def test_a_chat_template_without_a_tool_turn_is_refused_at_set_up(chat_tokenizer, template, match):
    chat_tokenizer.chat_template = template
    with pytest.raises(ValueError, match=match):
        ChatTemplateToolParser(chat_tokenizer)


def test_a_chat_template_with_a_tool_role_is_accepted(chat_tokenizer):
    chat_tokenizer.chat_template = GENERIC
    parser = ChatTemplateToolParser(chat_tokenizer)
    assert (
        parser.format_result("check", "right") == "<|im_start|>tool\nright<|im_end|>\n<|im_start|>assistant\n"
    )
