"""Command-line and config errors of ``alignlit fit`` in one line that names the field, where it was
given (the command line or which YAML file) and, for a misspelt name, the closest valid one.

jsonargparse reports an unknown model argument as a ``Union`` failure followed by a dump of the whole
model config, a YAML syntax error at ``"<unicode string>", line 2``, and prints the 50-line usage
before every error. :class:`AlignArgumentParser` prints only the explained message
(:func:`explain`) and where to find the options.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser

from alignlit.cli.jsonargparse_internals import debug_mode_active, parser_actions

TOP_LEVEL = (
    "trainer",
    "model",
    "data",
    "seed_everything",
    "ckpt_path",
    "config",
    "optimizer",
    "lr_scheduler",
)


class AlignArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one explained message instead of the usage dump."""

    #: the command line being parsed (set by ``AlignCLI``), to tell which config file holds a bad key
    argv: list[str] | None = None

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        if debug_mode_active():
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        text = explain(message, parser, AlignArgumentParser.argv or [])
        sys.stderr.write(f"{prog}: error: {text}\n(`{prog} --help` lists every option)\n")
        self.exit(2)

    def fail(self, message: str):
        """Exit with status 2 and ``message`` (an error of the run's settings, not of the options)."""
        self._logger.error(message)
        if not self.exit_on_error:
            return super().error(message)
        sys.stderr.write(f"{self.prog.replace(' [options]', '')}: error: {message}\n")
        self.exit(2)


def config_files(argv: list[str]) -> list[Path]:
    """The ``--config``/``-c`` files of a command line, in order."""
    out = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            out.append(Path(argv[i + 1]))
        elif arg.startswith("--config="):
            out.append(Path(arg.split("=", 1)[1]))
    return out


def _load_yaml(path: Path):
    import yaml

    return yaml.safe_load(path.read_text())


def _file_with(argv: list[str], keys: list[str]) -> Path | None:
    """The last config file of ``argv`` in which the nested ``keys`` are set."""
    found = None
    for path in config_files(argv):
        try:
            node = _load_yaml(path)
        except Exception:
            continue
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            found = path
    return found


def _import(class_path: str):
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _classes(annotation) -> list[type]:
    """The classes in a type annotation (``Optim | None`` -> [Optim])."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [c for a in typing.get_args(annotation) for c in _classes(a)]
    return [annotation] if isinstance(annotation, type) and annotation is not type(None) else []


def arguments(cls: type) -> dict[str, Any]:
    """Argument name -> annotation of ``cls`` (a dataclass's fields, else its ``__init__`` parameters,
    following ``**kwargs`` into the base classes)."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        return {f.name: hints.get(f.name) for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:
            hints = {}
        params = inspect.signature(init).parameters
        for name, p in params.items():
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                out.setdefault(name, hints.get(name))
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return out


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_argument(class_path: str, dotted: str) -> str | None:
    """``"SFTModule has no argument 'optm' (did you mean 'optim'?)"`` for the first unknown name of
    ``dotted`` (``optm.lr``) below ``class_path``; None when every name exists."""
    cls = _import(class_path)
    if cls is None:
        return None
    for name in dotted.split("."):
        args = arguments(cls)
        if name not in args:
            return f"{cls.__name__} has no argument {name!r}{_did_you_mean(name, args)}"
        nested = _classes(args[name])
        if not nested:
            return None
        cls = nested[0]
    return None


KEY = re.compile(r'Parser key "(?P<key>[\w.]+)":\s*(?P<rest>.*)')
CLASS = re.compile(r"Problem with given class_path '(?P<cls>[\w.]+)':")
UNKNOWN = re.compile(r"unrecognized arguments: --(?P<name>[\w.]+)|Option '(?P<opt>[\w.]+)' is not accepted")


PROTOCOL = re.compile(r"Import path (?P<cls>[\w.]+) does not implement protocol (?P<proto>\w+)")


def protocol_gaps(text: str, message: str) -> str:
    """``text`` plus what the class lacks when it is jsonargparse's "does not implement protocol": the
    protocol's methods it does not have, or else the signatures it must match (the protocol is found by
    name among the ``<class '...'>`` paths of ``message``)."""
    found = PROTOCOL.search(text)
    if not found:
        return text
    paths = re.findall(r"<class '([\w.]+)'>", message)
    proto = next((_import(p) for p in paths if p.rsplit(".", 1)[-1] == found.group("proto")), None)
    cls = _import(found.group("cls"))
    if proto is None or cls is None:
        return text
    members = [n for n, v in vars(proto).items() if not n.startswith("_") and callable(v)]
    missing = [n for n in members if not callable(getattr(cls, n, None))]
    if missing:
        return f"{text}: it has no method {', '.join(missing)} (needs {', '.join(members)})"

    def bare(fn) -> inspect.Signature:  # names and kinds only: the protocol's annotations are Any
        sig = inspect.signature(fn)
        params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
        return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)

    wanted = "; ".join(f"{n}{bare(getattr(proto, n))}" for n in members)
    return f"{text}: its methods must accept the protocol's arguments: {wanted}"


def _union_message(message: str, argv: list[str]) -> str | None:
    """A (nested) "Does not validate against any of the Union subtypes" error: the path of keys and
    classes down to the first real problem, as one line."""
    if "Does not validate against any of the Union subtypes" not in message:
        return None
    keys: list[str] = []
    classes: list[str] = []
    why = None
    for line in message.splitlines():
        text = line.strip().removeprefix("- ").strip()
        if not text or text.startswith(
            ("Does not validate", "Subtypes:", "Errors:", "Expected a <class 'NoneType'>")
        ):
            continue
        if text.startswith("Given value"):
            break
        key, cls, unknown = KEY.match(text), CLASS.match(text), UNKNOWN.search(text)
        if key:
            keys.append(key.group("key"))
            if key.group("rest"):
                why = key.group("rest")
                break
        elif cls:
            classes.append(cls.group("cls"))
        elif unknown:
            dotted = unknown.group("name") or unknown.group("opt")
            keys.append(dotted)
            why = (
                unknown_argument(classes[-1], dotted) if classes else None
            ) or f"not an argument of {classes[-1]}"
            break
        else:
            why = protocol_gaps(text, message)
            break
    if not keys or why is None:
        return None
    field = ".".join([keys[0], "init_args", *keys[1:]] if classes else keys)
    where = ""
    if "Given value type: <class 'dict'>" in message:
        path = _file_with(argv, field.split("."))
        where = f" (in {path})" if path else " (in the config)"
    elif any(a.startswith(f"--{field}") for a in argv):
        where = " (on the command line)"
    return f"{field}{where}: {why}"


def _unrecognized(message: str, parser) -> str | None:
    m = re.match(r"unrecognized arguments: (.*)", message.strip(), flags=re.S)
    if not m:
        return None
    options = {s for a in parser_actions(parser) for s in a.option_strings if s.startswith("--")}
    out = []
    for token in m.group(1).split():
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        head, _, rest = name[2:].partition(".")
        if not close and rest and head not in TOP_LEVEL:
            top = difflib.get_close_matches(head, TOP_LEVEL, n=1, cutoff=0.6)
            close = [f"--{top[0]}.{rest}"] if top else []
        out.append(f"unknown option {name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return "; ".join(out) or None


def _yaml_syntax(message: str, argv: list[str]) -> str | None:
    if "<unicode string>" not in message:
        return None
    for path in config_files(argv):
        try:
            _load_yaml(path)
        except FileNotFoundError:
            continue
        except Exception:
            text = message.replace('"<unicode string>"', str(path)).replace("<unicode string>", str(path))
            return f"{path} is not valid YAML: " + " ".join(
                text.replace("Problems parsing config:", "").split()
            )
    return None


def explain(message: str, parser, argv: list[str]) -> str:
    """jsonargparse's ``message`` as one line naming the field, where it was given and the likely fix."""
    for rewrite in (
        lambda: _yaml_syntax(message, argv),
        lambda: _union_message(message, argv),
        lambda: _unrecognized(message, parser),
    ):
        try:
            text = rewrite()
        except Exception:  # an explanation must never hide the error itself
            text = None
        if text:
            return text
    message = re.sub(r"\n\s*Given value:.*", "", message, flags=re.S)
    key = re.match(r'Parser key "([\w.]+)":\s*(.*)', message, flags=re.S)
    return f"{key.group(1)}: {' '.join(key.group(2).split())}" if key else message
