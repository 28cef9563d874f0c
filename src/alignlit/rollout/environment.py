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
result is the environment's reply; a malformed call, an unknown tool or a tool that raises is fed back
as an ``error: ...`` observation, never raised out of the rollout.
"""

from __future__ import annotations

import copy
import json
import re
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
    """reset → first observation; step(the model's turn) → observation, reward, done (:class:`Step`)."""

    def reset(self, prompt: str, *, seed: int) -> str: ...

    def step(self, response: str) -> Any: ...


def as_step(result: Any) -> Step:
    """A :class:`Step` from what an environment's ``step`` returned (a Step or an ``(observation, reward,
    done[, info])`` tuple), checked: ValueError saying what came back instead."""
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise ValueError(
            f"environment step returned {type(result).__name__} ({result!r:.80}); expected a Step or an "
            "(observation, reward, done[, info]) tuple"
        )
    observation, reward, done = result[:3]
    info = result[3] if len(result) == 4 else {}
    if not isinstance(observation, str):
        raise ValueError(
            f"environment step returned an observation of type {type(observation).__name__}, not str"
        )
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward:
        raise ValueError(f"environment step returned reward {reward!r}; expected a real number")
    return Step(observation, float(reward), bool(done), dict(info or {}))


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


class JSONToolParser:
    """A JSON function call in the model's turn, OpenAI's function-call format:
    ``{"name": "check", "arguments": {"answer": "a c d"}}`` (the first object with a ``"name"`` key).

    Args:
        result_template: the environment's reply for a tool result, with ``{name}`` and ``{result}``.
    """

    def __init__(self, result_template: str = "\n\nTool ({name}): {result}\n\nAssistant:"):
        self.result_template = result_template

    def parse(self, text: str) -> ToolCall | None:
        start = text.find('{"name"')
        if start < 0:
            return None
        try:
            payload, _ = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError as err:
            raise ToolCallError(
                f"the tool call is not valid JSON: {err.msg} at character {err.pos}"
            ) from None
        return _call_from_json(payload)

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
        message = {"role": "tool", "name": name, "content": result}
        full = self.tokenizer.apply_chat_template(
            [*self._base, message], tokenize=False, add_generation_prompt=True
        )
        if not full.startswith(self._head) or len(full) == len(self._head):
            raise ValueError(
                "the chat template does not render a tool message after an assistant turn as a suffix; "
                "use JSONToolParser with a result_template"
            )
        return full[len(self._head) :]


def _tool_error(err: BaseException) -> str:
    return f"error: {type(err).__name__}: {err}"


class ToolEnvironment:
    """An environment with tools: a model turn holding a tool call runs the tool and its result is the
    environment's reply (the episode goes on); a turn without one is the answer, stepped by the wrapped
    environment. Errors (a malformed call, an unknown tool, bad arguments, a tool that raises) become an
    ``error: ...`` reply.

    Tools: ``tools`` (a name → callable mapping, or dotted paths of functions), plus the wrapped
    environment's own ``tools()`` (bound to its episode, e.g. a ``check`` that knows the answer).

    Args:
        environment: the environment that judges answers.
        tools: extra tools.
        parser: the tool-call format (default :class:`JSONToolParser`).
        tool_cost: reward of each tool call (e.g. -0.1).
        max_tool_calls: the most tool calls per episode; after that every turn is stepped as an answer
            (None: no limit).
    """

    def __init__(
        self,
        environment: Environment,
        tools: Mapping[str, Callable[..., Any] | str] | None = None,
        parser: ToolParser | None = None,
        tool_cost: float = 0.0,
        max_tool_calls: int | None = None,
    ):
        self.environment = environment
        self.extra_tools = {
            name: import_object(fn) if isinstance(fn, str) else fn for name, fn in dict(tools or {}).items()
        }
        self.parser = parser if parser is not None else JSONToolParser()
        self.tool_cost, self.max_tool_calls = tool_cost, max_tool_calls
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
        try:
            call = self.parser.parse(response)
        except ToolCallError as err:
            return self._reply("error", f"error: {err}", error=True)
        if call is None or (self.max_tool_calls is not None and self._calls >= self.max_tool_calls):
            return as_step(self._inner.step(response))
        tools = self.tools()
        if call.name not in tools:
            return self._reply(
                call.name, f"error: unknown tool {call.name!r}; tools: {sorted(tools)}", error=True
            )
        try:
            result, error = str(tools[call.name](**call.arguments)), False
        except Exception as err:  # any failure of the tool is the model's observation, never a crash
            result, error = _tool_error(err), True
        return self._reply(call.name, result, error=error)

    def _reply(self, name: str, result: str, *, error: bool) -> Step:
        self._calls += 1
        info = {"tool_calls": 1, "tool_errors": int(error)}
        try:
            observation = self.parser.format_result(name, result)
        except Exception as err:
            observation, info["tool_errors"] = _tool_error(err), 1
        return Step(observation, -self.tool_cost, False, info)
