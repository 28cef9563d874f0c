"""Environments for multi-turn rollouts: alignlit's small protocol, tools and tool-call parsers.

An environment answers the model between its turns. alignlit's protocol is two methods::

    observation = env.reset(prompt, seed=seed)        # the first observation (the text the model sees)
    observation, reward, done, info = env.step(text)  # the model's turn -> the environment's reply

``step`` returns a :class:`Step` (or any ``(observation, reward, done)`` tuple, with an optional fourth
``info`` dict). A single-turn verifiable task is the one-step case: ``reset`` returns the prompt and
``step`` scores the answer with ``done=True``. The episode's return is the sum of its step rewards: a
final reward only, or a reward (e.g. a cost) per turn. :func:`alignlit.rollout.episodes.run_episodes`
runs episodes token in / token out; :class:`alignlit.rollout.gym.GymEnvironment` runs Gymnasium
environments unchanged.

Every episode steps its own shallow copy (``copy.copy``) of the configured environment, so ``reset``
must assign the episode's state (not mutate objects shared with the configured instance).

Tools: :class:`ToolEnvironment` wraps an environment with tools (Python callables); a
:class:`ToolParser` finds a tool call in the model's turn (:class:`JSONToolParser`: an OpenAI-style
``{"name": ..., "arguments": {...}}`` object; :class:`ChatTemplateToolParser`: the chat template's tool
format, Hermes/Qwen ``<tool_call>...</tool_call>``, with results rendered by the template). A tool's
result is the environment's reply; a malformed call, an unknown tool, a tool that raises (``SystemExit``
and ``KeyboardInterrupt`` included) or one that runs past ``tool_timeout_s`` is fed back as an
``error: ...`` observation, never raised out of the rollout (and never a hang).

A tool runs in a daemon worker thread that the episode waits on for at most ``tool_timeout_s``. A thread
cannot be killed: one past its limit is abandoned (it runs on without holding the episode back and never
blocks the process's exit), so a tool with side effects should bound its own work too. A real Ctrl-C
reaches only the main thread (Python delivers signals there), which is waiting on the tool and stops the
run as usual; a ``KeyboardInterrupt`` (or ``SystemExit``) raised inside the worker thread can only come
from the tool itself, and is the tool's error.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from alignlit.checks import import_object


class Step(NamedTuple):
    """What :meth:`Environment.step` returns.

    Attributes:
        observation: the environment's reply, appended to the episode (tokenised once) when it goes on.
        reward: this step's reward; the episode's return is the sum over its steps.
        done: the episode is over (the observation is then not appended).
        info: counts the runner aggregates per episode (``tool_calls``, ``tool_errors``) and anything else.
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = {}  # noqa: RUF012 - a NamedTuple default is never mutated here


@runtime_checkable
class Environment(Protocol):
    """reset → first observation; step(the model's turn) → observation, reward, done (:class:`Step`).

    The parameters are annotated ``Any`` on purpose: a config's ``class_path`` is checked against this
    protocol by jsonargparse, which requires an implementation's annotations to equal the protocol's, so a
    class without annotations would be refused."""

    def reset(self, prompt: Any, *, seed: Any) -> Any: ...

    def step(self, response: Any) -> Any: ...


COUNTS = ("tool_calls", "tool_errors", "tool_timeouts")
"""The ``info`` counts the episode runner adds up (non-negative integers)."""
FLOAT32_MAX = 3.4028234663852886e38


def as_step(result: Any, source: str = "environment") -> Step:
    """A :class:`Step` from what an environment's ``step`` returned (a Step or an ``(observation, reward,
    done[, info])`` tuple), checked: ValueError naming ``source`` (the environment), the field and what
    came back. ``reward``: a finite real number (numpy scalars too) within float32's range (rewards are
    float32 tensors); ``done``: a bool (or numpy bool), never a string; ``info``: a dict (or None) whose
    counts (:data:`COUNTS`) are non-negative integers."""
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise ValueError(
            f"{source} step returned {type(result).__name__} ({result!r:.80}); expected a Step or an "
            "(observation, reward, done[, info]) tuple"
        )
    observation, reward, done = result[:3]
    info = result[3] if len(result) == 4 else {}
    if not isinstance(observation, str):
        raise ValueError(
            f"{source} step returned an observation of type {type(observation).__name__}, not str"
        )
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise ValueError(
            f"{source} step returned reward {reward!r} of type {type(reward).__name__}; expected a real number"
        )
    value = float(reward)
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(
            f"{source} step returned reward {reward!r}; expected a finite number within float32's range "
            f"(|reward| <= {FLOAT32_MAX:.3g}: rewards are float32 tensors)"
        )
    numpy_bool = type(done).__module__ == "numpy" and type(done).__name__ in ("bool", "bool_")
    if not isinstance(done, bool) and not numpy_bool:  # numpy's bool too, never "False"
        raise ValueError(
            f"{source} step returned done {done!r} of type {type(done).__name__}; expected a bool "
            '(a string or a number is refused: "False" would end the episode)'
        )
    if info is None:
        info = {}
    if not isinstance(info, Mapping):
        raise ValueError(
            f"{source} step returned info {info!r:.80} of type {type(info).__name__}; expected a dict or None"
        )
    for key in COUNTS:
        count = info.get(key, 0)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(
                f"{source} step returned info[{key!r}] = {count!r}; expected a non-negative integer (a count)"
            )
    return Step(observation, value, bool(done), dict(info))


def spawn(environment: Environment) -> Environment:
    """The environment one episode steps: a shallow copy of the configured one."""
    return copy.copy(environment)


# ---------------------------------------------------------------------------------------------- tools
class ToolCallError(ValueError):
    """A tool call the parser found but could not read (fed back to the model as an observation)."""


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@runtime_checkable
class ToolParser(Protocol):
    """Finds a tool call in a model turn and renders a tool's result as the environment's reply."""

    def parse(self, text: str) -> ToolCall | None: ...

    def format_result(self, name: str, result: str) -> str: ...


def _call_from_json(payload: Any) -> ToolCall:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ToolCallError(
            f'a tool call is an object {{"name": ..., "arguments": {{...}}}}, got {payload!r:.80}'
        )
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's wire format encodes the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ToolCallError(f"the arguments of {payload['name']!r} are not valid JSON: {err}") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"the arguments of {payload['name']!r} must be an object, got {arguments!r:.60}")
    return ToolCall(payload["name"], arguments)


CALL_START = re.compile(r'\{\s*"(?:name|arguments|parameters)"\s*:')


def find_json_call(text: str) -> Any | None:
    """The first JSON object in ``text`` with a ``"name"`` key, whatever its spacing, line breaks or key
    order (``json.JSONDecoder.raw_decode`` from each ``{``; an object decoded whole is skipped as a whole,
    so an object nested in another is not a call). None when there is none; :class:`ToolCallError` when
    the first text that opens like a call (``{"name":``, ``{"arguments":``) is not valid JSON."""
    decoder, position = json.JSONDecoder(), 0
    while (start := text.find("{", position)) >= 0:
        try:
            payload, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as err:
            if CALL_START.match(text, start):
                raise ToolCallError(
                    f"the tool call is not valid JSON: {err.msg} at character {err.pos - start}"
                ) from None
            position = start + 1
            continue
        if isinstance(payload, dict) and "name" in payload:
            return payload
        position = end
    return None


class JSONToolParser:
    """A JSON function call in the model's turn, OpenAI's function-call format:
    ``{"name": "check", "arguments": {"answer": "a c d"}}`` (the first JSON object with a ``"name"`` key,
    in any spacing or key order, :func:`find_json_call`).

    Args:
        result_template: the environment's reply for a tool result, with ``{name}`` and ``{result}``.
    """

    def __init__(self, result_template: str = "\n\nTool ({name}): {result}\n\nAssistant:"):
        self.result_template = result_template

    def parse(self, text: str) -> ToolCall | None:
        payload = find_json_call(text)
        return None if payload is None else _call_from_json(payload)

    def format_result(self, name: str, result: str) -> str:
        return self.result_template.format(name=name, result=result)


class ChatTemplateToolParser:
    """The chat template's tool format: calls in ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    (Hermes, Qwen 2.5/3), results rendered by the tokenizer's own chat template as a ``tool`` message
    followed by the generation prompt (the difference between the template applied to a two-message
    conversation with and without the tool message, so no history is re-rendered).

    Args:
        tokenizer: a tokenizer with a chat template that renders ``tool`` messages, or its local directory.
        open_tag: the tag that opens a call.
        close_tag: the tag that closes it.
    """

    def __init__(self, tokenizer: Any, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "ChatTemplateToolParser needs a tokenizer with a chat template; use JSONToolParser"
            )
        self.tokenizer, self.open_tag, self.close_tag = tokenizer, open_tag, close_tag
        self._pattern = re.compile(re.escape(open_tag) + r"(.*?)(?:" + re.escape(close_tag) + r"|\Z)", re.S)
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        self._head = tokenizer.apply_chat_template(base, tokenize=False)
        self._base = base
        self._check_tool_turn()

    def _check_tool_turn(self) -> None:
        """Refuse a template that cannot render a tool turn: one that raises on the ``tool`` role, drops
        the result, or renders it exactly as a user (or assistant) message of the same text (no role, no
        name: the model could not tell a tool's result from the user)."""
        probe = "alignlit-tool-result-7f3a"
        try:
            rendered = self.format_result("alignlit_probe", probe)
        except Exception as err:
            raise ValueError(
                f"ChatTemplateToolParser: the tokenizer's chat template cannot render a tool message "
                f"({type(err).__name__}: {err}); use a template with a tool role, or JSONToolParser with a "
                "result_template"
            ) from None
        if probe not in rendered:
            raise ValueError(
                "ChatTemplateToolParser: the tokenizer's chat template drops a tool message's content; use a "
                "template with a tool role, or JSONToolParser with a result_template"
            )
        for role in ("user", "assistant"):
            try:
                other = self._render({"role": role, "content": probe})
            except Exception:
                continue
            if other == rendered:
                raise ValueError(
                    f"ChatTemplateToolParser: the tokenizer's chat template renders a tool message exactly as a "
                    f"{role} message (no tool role, no tool name), so a tool's result would read as the "
                    f"{role}'s words: {rendered!r:.120}. Use a template with a tool role, or JSONToolParser "
                    "with a result_template"
                )

    def _render(self, message: dict[str, str]) -> str:
        full = self.tokenizer.apply_chat_template(
            [*self._base, message], tokenize=False, add_generation_prompt=True
        )
        if not full.startswith(self._head) or len(full) == len(self._head):
            raise ValueError(
                "the chat template does not render a message after an assistant turn as a suffix; "
                "use JSONToolParser with a result_template"
            )
        return full[len(self._head) :]

    def parse(self, text: str) -> ToolCall | None:
        match = self._pattern.search(text)
        if match is None:
            return None
        try:
            payload = json.loads(match.group(1).strip())
        except json.JSONDecodeError as err:
            raise ToolCallError(
                f"the tool call is not valid JSON: {err.msg} at character {err.pos}"
            ) from None
        return _call_from_json(payload)

    def format_result(self, name: str, result: str) -> str:
        return self._render({"role": "tool", "name": name, "content": result})


def _tool_error(err: BaseException) -> str:
    return f"error: {type(err).__name__}: {err}"


def call_tool(
    fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float | None, name: str | None = None
) -> tuple[str, str]:
    """Run ``fn(**arguments)`` in a daemon worker thread and wait at most ``timeout_s`` seconds (None: no
    limit): ``("ok", str(result))``, ``("error", "error: ...")`` when it raised anything, ``SystemExit``
    and ``KeyboardInterrupt`` included (raised in the worker, they can only come from the tool), or
    ``("timeout", "error: ...")`` when it ran past the limit (the thread is abandoned; module docstring).
    A real Ctrl-C interrupts the caller's wait and propagates."""
    box: dict[str, tuple[str, str]] = {}

    def work() -> None:
        try:
            box["out"] = ("ok", str(fn(**arguments)))
        except BaseException as err:  # a tool's SystemExit/KeyboardInterrupt is the tool's error
            box["out"] = ("error", _tool_error(err))

    name = name or getattr(fn, "__name__", type(fn).__name__)
    worker = threading.Thread(target=work, name=f"alignlit-tool-{name}", daemon=True)
    worker.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while worker.is_alive() and (deadline is None or time.monotonic() < deadline):
        # short waits: the main thread gets back to the interpreter, which raises a pending Ctrl-C (a
        # SIGINT handled by another thread does not wake a long wait on the lock)
        worker.join(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
    if worker.is_alive():
        return "timeout", f"error: the tool {name!r} did not return within {timeout_s:g} s (tool_timeout_s)"
    return box.get("out", ("error", "error: the tool ended without a result"))


class ToolEnvironment:
    """An environment with tools: a model turn holding a tool call runs the tool and its result is the
    environment's reply (the episode goes on); a turn without one is the answer, stepped by the wrapped
    environment. Errors (a malformed call, an unknown tool, bad arguments, a tool that raises, one that
    runs past ``tool_timeout_s``) become an ``error: ...`` reply, counted (``tool_errors``; timeouts also
    ``tool_timeouts``).

    Tools: ``tools`` (a name → callable mapping, or dotted paths of functions), plus the wrapped
    environment's own ``tools()`` (bound to its episode, e.g. a ``check`` that knows the answer).

    Args:
        environment: the environment that judges answers.
        tools: extra tools.
        parser: the tool-call format (default :class:`JSONToolParser`).
        tool_cost: reward of each tool call (e.g. -0.1).
        max_tool_calls: the most tool calls per episode; after that every turn, a malformed call
            included, is stepped as an answer by the wrapped environment (None: no limit).
        tool_timeout_s: the most seconds one tool call may run (None: no limit); past it the episode gets
            an ``error: ...`` reply and the tool's thread is abandoned (module docstring).
    """

    def __init__(
        self,
        environment: Environment,
        tools: Mapping[str, Callable[..., Any] | str] | None = None,
        parser: ToolParser | None = None,
        tool_cost: float = 0.0,
        max_tool_calls: int | None = None,
        tool_timeout_s: float | None = 30.0,
    ):
        if max_tool_calls is not None and max_tool_calls < 0:
            raise ValueError(f"ToolEnvironment: max_tool_calls must be >= 0 or None, got {max_tool_calls}")
        if tool_timeout_s is not None and not tool_timeout_s > 0:
            raise ValueError(f"ToolEnvironment: tool_timeout_s must be > 0 or None, got {tool_timeout_s}")
        self.environment = environment
        self.extra_tools = {
            name: import_object(fn) if isinstance(fn, str) else fn for name, fn in dict(tools or {}).items()
        }
        self.parser = parser if parser is not None else JSONToolParser()
        self.tool_cost, self.max_tool_calls, self.tool_timeout_s = tool_cost, max_tool_calls, tool_timeout_s
        self._inner: Environment | None = None
        self._calls = 0

    def reset(self, prompt: str, *, seed: int) -> str:
        self._inner, self._calls = spawn(self.environment), 0
        return self._inner.reset(prompt, seed=seed)

    def tools(self) -> dict[str, Callable[..., Any]]:
        own = getattr(self._inner, "tools", None)
        return {**(own() if callable(own) else {}), **self.extra_tools}

    def step(self, response: str) -> Step:
        if self._inner is None:
            raise RuntimeError("ToolEnvironment.step before reset")
        if self.max_tool_calls is not None and self._calls >= self.max_tool_calls:
            return as_step(self._inner.step(response), type(self._inner).__name__)
        try:
            call = self.parser.parse(response)
        except ToolCallError as err:
            return self._reply("error", f"error: {err}", error=True)
        if call is None:
            return as_step(self._inner.step(response), type(self._inner).__name__)
        tools = self.tools()
        if call.name not in tools:
            return self._reply(
                call.name, f"error: unknown tool {call.name!r}; tools: {sorted(tools)}", error=True
            )
        status, result = call_tool(tools[call.name], call.arguments, self.tool_timeout_s, call.name)
        return self._reply(call.name, result, error=status != "ok", timeout=status == "timeout")

    def _reply(self, name: str, result: str, *, error: bool, timeout: bool = False) -> Step:
        self._calls += 1
        info = {"tool_calls": 1, "tool_errors": int(error), "tool_timeouts": int(timeout)}
        try:
            observation = self.parser.format_result(name, result)
        except Exception as err:
            observation, info["tool_errors"] = _tool_error(err), 1
        return Step(observation, -self.tool_cost, False, info)
