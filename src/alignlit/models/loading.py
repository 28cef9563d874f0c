"""Load causal LMs and scalar-head models from Hugging Face directories or hub ids (:mod:`alignlit.hub`)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from alignlit.data.tokenizer import load_tokenizer
from alignlit.hub import (
    PACKAGE_PREFIX,
    ModelNotFoundError,
    Pretrained,
    check_remote_code,
    is_repo_id,
    resolve_model,
    snapshot_source,
)
from alignlit.models.export import interrupted_export_message, read_metadata
from alignlit.models.lora import HEAD_NAMES, adapter_base, is_adapter_dir, load_adapter_export
from alignlit.models.modes import disable_dropout
from alignlit.quiet import expected_load_report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Stages keep their __init__ arguments (a Pretrained among them) in checkpoints; let torch.load's
# weights-only unpickler rebuild it on resume.
torch.serialization.add_safe_globals([Pretrained])


def check_dtype(dtype: str, what: str = "dtype") -> str:
    """``dtype`` if it names one of :data:`DTYPES`, else ``ValueError`` naming ``what``."""
    if dtype not in DTYPES:
        raise ValueError(f"{what} must be one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Activation checkpointing of a Hugging Face model (or ScalarHeadModel): each decoder layer's
    activations are recomputed in the backward pass instead of kept (HF
    ``gradient_checkpointing_enable``, non-reentrant, so it works with frozen inputs and LoRA). The
    gradients are the same; memory per layer drops to its input, compute grows by about one forward.

    HF checkpoints only in train mode, and ``from_pretrained`` returns eval mode, in which some stages
    train (dropout off): the model is put in train mode with every dropout off
    (:func:`~alignlit.models.modes.disable_dropout`), the same function as before."""
    hf = getattr(model, "hf_model", model)
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(hf).__name__} does not support it")
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    disable_dropout(hf).train()
    return model


def resolve_source(
    spec, what: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> tuple[Path, dict]:
    """The local directory of model ``spec`` (a directory, ``package:<module>``, a hub id
    ``org/name[@revision]`` or a :class:`~alignlit.hub.Pretrained`; :func:`alignlit.hub.resolve_model`)
    and the ``from_pretrained`` options it carries (``trust_remote_code``, ``attn_implementation``).

    A missing export interrupted between its two renames says how to restore it; a model whose config
    names its own code is refused unless ``trust_remote_code`` (:class:`~alignlit.hub.RemoteCodeError`).
    """
    attn = None
    if isinstance(spec, Pretrained):
        revision = revision or spec.revision
        trust_remote_code = trust_remote_code or spec.trust_remote_code
        attn = spec.attn_implementation
        spec = spec.path
    text = os.fspath(spec)
    hint = interrupted_export_message(Path(text)) if not text.startswith(PACKAGE_PREFIX) else None
    if hint is not None:
        raise FileNotFoundError(f"{what} {text!r}: {hint}")
    p = resolve_model(text, what=what, revision=revision, trust_remote_code=trust_remote_code)
    if snapshot_source(p) is not None and not any(p.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{what} {text!r}: its snapshot {p} has no *.safetensors weights (alignlit downloads weights as "
            f"safetensors only, never pickled .bin files); holds {sorted(f.name for f in p.iterdir())}"
        )
    check_remote_code(p, what=what, spec=text, trust_remote_code=trust_remote_code)
    options: dict = {"trust_remote_code": True} if trust_remote_code else {}
    if attn is not None:
        options["attn_implementation"] = attn
    return p, options


def describe_source(spec, directory: Path) -> dict[str, str]:
    """Where a loaded model came from, as exports record it: ``spec`` as given, the local ``directory``
    it resolved to and, for a hub snapshot, its ``hub_id`` and ``revision`` (the commit hash)."""
    info = {"spec": str(spec), "dir": str(directory)}
    return {**info, **(snapshot_source(directory) or {})}


def model_source(model: nn.Module | None) -> dict[str, str] | None:
    """The :func:`describe_source` record that :func:`load_policy` / :func:`load_scalar_model` attached to
    ``model`` (found through wrappers: LoRA, :class:`ScalarHeadModel`); None for a model built otherwise."""
    if model is None:
        return None
    for sub in model.modules():
        source = getattr(sub, "alignlit_source", None)
        if isinstance(source, dict):
            return source
    return None


def _adapter_base(path: Path, what: str, options: dict) -> Path:
    """The base model of a LoRA adapter export: a local directory, or a hub id / hub snapshot path
    (an adapter trained elsewhere) resolved through the hub cache."""
    try:
        return adapter_base(path)
    except FileNotFoundError:
        base = str(
            json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        )
        source = snapshot_source(base)
        if source is not None:
            base = f"{source['hub_id']}@{source['revision']}"
        if not is_repo_id(base):
            raise
        base_dir = resolve_model(
            base, what=f"{what} {path}'s LoRA base", trust_remote_code=options.get("trust_remote_code", False)
        )
        check_remote_code(
            base_dir, what=f"{what} {path}'s LoRA base", spec=base,
            trust_remote_code=options.get("trust_remote_code", False),
        )  # fmt: skip
        return base_dir


def load_policy(
    path,
    *,
    dtype: str = "float32",
    revision: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (from the same directory).

    ``path`` is a local Hugging Face directory (any stage's export works), a hub id
    ``org/name[@revision]`` (through the hub cache; offline with ``HF_HUB_OFFLINE=1``), ``package:<module>``
    or a :class:`~alignlit.hub.Pretrained` (its settings, unless given here). It may also be a model spec
    with ``build() -> (model, tokenizer)`` (e.g. :class:`alignlit.models.TinyLlama`), which builds a fresh
    model instead. A LoRA adapter export (``lora.export: adapter``) loads as its base model with the adapter
    merged. ``trust_remote_code`` is off by default: a model that needs its own code is refused, naming it.
    """
    if not isinstance(path, (str, os.PathLike, Pretrained)) and hasattr(path, "build"):
        return path.build()
    check_dtype(dtype)
    p, options = resolve_source(path, "policy", revision=revision, trust_remote_code=trust_remote_code)
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if is_adapter_dir(p):
        base = AutoModelForCausalLM.from_pretrained(
            str(_adapter_base(p, "policy", options)), dtype=DTYPES[dtype], **options
        )
        model = load_adapter_export(p, base)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=DTYPES[dtype], **options)
    tok = load_tokenizer(p, trust_remote_code=options.get("trust_remote_code", False))
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    model.alignlit_source = describe_source(path, p)
    return model, tok


#: stages whose export is a trained scalar-head model
REWARD_STAGES = frozenset({"reward"})

HeadMode = Literal["trained", "fresh"]


class NotARewardModelError(ValueError):
    """A directory loaded as a reward model (or trained critic) holds no trained scalar head."""


def _has_trained_head_config(path: Path, base: Path, options: dict) -> tuple[bool, str]:
    """Whether ``path`` (its weights' directory ``base``: itself, or a LoRA adapter's base) claims a
    trained scalar head (reward-stage metadata, or a ``…ForSequenceClassification`` config with one
    label), and what it is, for messages."""
    stage = read_metadata(path).get("stage")
    config = AutoConfig.from_pretrained(str(base), **options)
    archs = list(getattr(config, "architectures", None) or [])
    what = f"{', '.join(archs) or type(config).__name__}" + (f", alignlit stage {stage!r}" if stage else "")
    seq_cls = any(a.endswith("ForSequenceClassification") for a in archs) and config.num_labels == 1
    return stage in REWARD_STAGES or seq_cls, what


def load_scalar_model(
    path: str | Path | Pretrained,
    *,
    head: HeadMode = "fresh",
    dtype: str = "float32",
    revision: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[ScalarHeadModel, PreTrainedTokenizerBase]:
    """Load a scalar-head model (reward model or critic) as a :class:`ScalarHeadModel`.

    Args:
        path: a local Hugging Face directory, a hub id ``org/name[@revision]``, ``package:<module>`` or a
            :class:`~alignlit.hub.Pretrained` (as :func:`load_policy`; the tokenizer comes from the same
            directory).
        head: ``"trained"`` requires a trained scalar head: the export of a reward stage, or a
            ``…ForSequenceClassification`` with ``num_labels`` 1, *and* the head's weights in the
            checkpoint (the loader's missing keys are checked, not only the config); anything else
            (a policy, a pairwise preference model, a bare encoder) raises
            :class:`NotARewardModelError`. ``"fresh"`` accepts a backbone: a causal-LM directory
            (e.g. the SFT export) gets a freshly initialised linear head, to be trained (a reward
            model's start, or a PPO critic started from the policy); a head the checkpoint holds is
            loaded. Any encoder with a sequence-classification class (e.g. MiniLM) works as well.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        revision, attn_implementation, trust_remote_code: as :func:`load_policy`.

    A LoRA adapter export of a reward stage (``lora.export: adapter``, its head saved with the adapter)
    loads as its base with the adapter and the head merged.
    """
    if head not in ("trained", "fresh"):
        raise ValueError(f"head must be 'trained' or 'fresh', got {head!r}")
    check_dtype(dtype)
    p, options = resolve_source(path, "model", revision=revision, trust_remote_code=trust_remote_code)
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    adapter = is_adapter_dir(p)
    base = _adapter_base(p, "model", options) if adapter else p
    if head == "trained":
        claims, what = _has_trained_head_config(p, base, options)
        if not claims:
            raise NotARewardModelError(
                f"{p} is not a reward model: it is a {what} with no trained scalar head, so its scores would "
                "come from a randomly initialised head. Give the export of a reward stage "
                "(alignlit.modules.RewardModule) or a …ForSequenceClassification directory with num_labels 1"
            )
    tok = load_tokenizer(p, trust_remote_code=options.get("trust_remote_code", False))
    with expected_load_report() if head == "fresh" else contextlib.nullcontext():
        hf, info = AutoModelForSequenceClassification.from_pretrained(
            str(base), num_labels=1, dtype=DTYPES[dtype], output_loading_info=True, **options
        )
    if head == "fresh" and not adapter:
        _report_fresh_head(p, info)
    if adapter:
        hf.config.pad_token_id = (
            hf.config.pad_token_id if hf.config.pad_token_id is not None else tok.pad_token_id
        )
        hf = load_adapter_export(p, hf)
        saved = set(json.loads((p / "adapter_config.json").read_text()).get("modules_to_save") or [])
        info["missing_keys"] = [k for k in info["missing_keys"] if k.split(".")[0] not in saved]
    if head == "trained" and info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise NotARewardModelError(
            f"{p} is not a usable reward model: its config names a scalar head but the checkpoint lacks the "
            f"weights {missing[:4]}{' ...' if len(missing) > 4 else ''}, which would be freshly initialised"
        )
    if hf.config.pad_token_id is None:
        hf.config.pad_token_id = tok.pad_token_id
    hf.alignlit_source = describe_source(path, p)
    return ScalarHeadModel(hf), tok


def _report_fresh_head(path: Path, info: dict) -> None:
    """transformers' load report of a backbone loaded with a fresh scalar head, in one line: the new head
    and an unused LM head are expected; any other missing or unexpected weight is a real problem and
    is warned about, naming the weights."""
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    head = [k for k in missing if k.split(".")[0] in HEAD_NAMES]
    other_missing = [k for k in missing if k not in head]
    other_unexpected = [k for k in unexpected if not k.startswith("lm_head.")]
    if other_missing or other_unexpected:
        warnings.warn(
            f"{path}: loading it as a scalar-head model left weights freshly initialised that the directory "
            f"should hold: missing {other_missing[:6]}, unexpected {other_unexpected[:6]}",
            stacklevel=3,
        )
    if head:
        print(f"alignlit: {path}: a new scalar head ({', '.join(head)}) is initialised, to be trained")


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last real token of each row (works for left and right padding)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


class ScalarHeadModel(nn.Module):
    """A backbone with a linear head giving one scalar per position (reward model, critic).

    Wraps a Hugging Face ``…ForSequenceClassification`` model with ``num_labels=1`` so that the
    exported directory loads in any Hugging Face code. For decoder backbones (which have a
    per-token ``score`` head) :meth:`values` gives the head at every position and :meth:`forward`
    reads it at the last non-padding token; encoder backbones (e.g. BERT/MiniLM) use their own
    pooled classifier output and have no per-token values.
    """

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        self.hf_model = hf_model

    @property
    def config(self):
        return self.hf_model.config

    @property
    def per_token(self) -> bool:
        return hasattr(self.hf_model, "score") and hasattr(self.hf_model, "model")

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) head output at every position (decoder backbones only)."""
        if not self.per_token:
            raise TypeError(
                f"{type(self.hf_model).__name__} has no per-token head; a critic needs a decoder backbone"
            )
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.hf_model.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.hf_model.score(hidden).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) score of each sequence, read at its last non-padding token."""
        if self.per_token:
            values = self.values(input_ids, attention_mask)
            return values.gather(-1, last_token_index(attention_mask)[:, None]).squeeze(-1)
        return self.hf_model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)

    def save_pretrained(self, out_dir: str | Path, **kwargs) -> None:
        self.hf_model.save_pretrained(str(out_dir), **kwargs)
