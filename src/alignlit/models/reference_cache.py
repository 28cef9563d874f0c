"""Reference log-probs ``log π_0(y|x)`` of a preference dataset, computed once and cached on disk.

DPO-family losses read the frozen reference only through the sequence log-probs of the chosen and
rejected responses (algorithms.md §5), so they can be computed in one pass before training and no
reference model needs to be in memory while training. A cache is one ``.pt`` file,
``ref_logps-<data file name>-<key>.pt``, where ``key`` hashes everything the values depend on
(:func:`reference_fingerprint`): any change gives a new file name, a miss, and a recomputation.
Values are looked up by the content of each row (:func:`row_digests`), whatever the batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from alignlit.hub import Pretrained, resolve_model
from alignlit.losses.preference_registry import ReferenceLogps
from alignlit.models.forward import token_logprobs
from alignlit.models.modes import eval_mode

CACHE_DIRNAME = ".alignlit_cache"
"""Default cache directory, next to the training data file."""

FORMAT = "alignlit.reference_logps"
"""Marker stored in every cache file: files without it are never removed."""

_NOT_TOKENISATION = {"batch_size", "eval_batch_size", "num_workers"}
_KEY_CHARS = 20


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _dir_digest(path: Path) -> dict[str, str]:
    """sha256 of every file of a model directory (alignlit.json, which holds only metadata, excluded)."""
    return {
        str(p.relative_to(path)): _file_digest(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "alignlit.json"
    }


def _path_fingerprint(value: Any) -> Any:
    if isinstance(value, dict):  # a dataset spec: its local data files by content
        return {k: _path_fingerprint(v) for k, v in sorted(value.items())}
    if isinstance(value, str) and value:
        p = Path(value)
        if p.is_file():
            return {"file": _file_digest(p)}
        if p.is_dir():
            return {"dir": _dir_digest(p)}
    return value


def _state_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference_fingerprint(
    reference: str | Path | Pretrained | nn.Module, *, datamodule, tokenizer, dtype: str
) -> dict:
    """What cached reference log-probs depend on.

    Args:
        reference: the reference model's directory or hub id (the files of its directory or cached
            snapshot are hashed) or the model itself (its weights are hashed).
        datamodule: the preference DataModule; its class and settings enter, data files by content,
            loader-only settings (batch sizes, workers) left out.
        tokenizer: its serialised form and EOS id enter.
        dtype: the dtype the reference is loaded in.
    """
    if isinstance(reference, nn.Module):
        weights = {"initial_state": _state_digest(reference)}
    else:
        path = resolve_model(reference, what="reference model")  # a hub id: its cached snapshot
        weights = {"dir": _dir_digest(path)}
    data = {
        k: _path_fingerprint(v)
        for k, v in sorted(dict(datamodule.hparams).items())
        if k not in _NOT_TOKENISATION
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return {
        "reference": weights,
        "dtype": dtype,
        "data_class": type(datamodule).__name__,
        "data": data,
        "tokenizer": hashlib.sha256((backend.to_str() if backend else "").encode()).hexdigest(),
        "eos": tokenizer.eos_token_id,
    }


def cache_file(fingerprint: dict, *, train_file: str | None, cache_dir: str | Path | None = None) -> Path:
    """Where the cache of ``fingerprint`` lives: ``cache_dir`` (default ``.alignlit_cache/`` next to
    ``train_file``; without one, ``$ALIGNLIT_CACHE/reference_logps``, ``~/.cache/alignlit`` by default) /
    ``ref_logps-<train file name>-<key>.pt``."""
    if cache_dir is not None:
        directory = Path(cache_dir)
    elif train_file is not None:
        directory = Path(train_file).parent / CACHE_DIRNAME
    else:  # a hub dataset or in-memory records: the user's cache (the fingerprint names the source)
        directory = (
            Path(os.environ.get("ALIGNLIT_CACHE", "~/.cache/alignlit")).expanduser() / "reference_logps"
        )
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()
    stem = Path(train_file).name if train_file else "data"
    return directory / f"ref_logps-{stem}-{key[:_KEY_CHARS]}.pt"


def row_digests(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> list[str]:
    """One digest per row of the tokens it holds and which of them are response tokens (padding
    ignored), so a cached reference log-prob is found whatever the batch or its padding width."""
    out = []
    for ids, attn, loss in zip(input_ids.cpu(), attention_mask.cpu().bool(), loss_mask.cpu().bool()):
        h = hashlib.blake2b(digest_size=16)
        h.update(ids[attn].numpy().astype("int64").tobytes())
        h.update(loss[attn].numpy().tobytes())
        out.append(h.hexdigest())
    return out


def dataset_loaders(datamodule) -> list[DataLoader]:
    """Unshuffled, unsharded loaders over a set-up datamodule's train and val sets, with its collation."""
    loaders = []
    for loader in (datamodule.train_dataloader(), datamodule.val_dataloader()):
        if isinstance(loader, DataLoader):
            loaders.append(
                DataLoader(loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn)
            )
    return loaders


class ReferenceCache:
    """Reference log-probs ``log π_0(y|x)`` of every sequence of a dataset, looked up by row content.

    Args:
        table: row digest (:func:`row_digests`) -> sequence log-prob.
    """

    def __init__(self, table: dict[str, float]):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def lookup(self, batch) -> ReferenceLogps:
        """Reference log-probs of a (2B, T) preference batch (rows ``[0, B)`` chosen, ``[B, 2B)`` rejected)."""
        keys = row_digests(batch.input_ids, batch.attention_mask, batch.loss_mask)
        missing = [i for i, k in enumerate(keys) if k not in self.table]
        if missing:
            raise KeyError(
                f"rows {missing} of this batch have no cached reference log-probs; the cache does not "
                "match the data (delete it or set precompute_reference: false)"
            )
        values = torch.tensor(
            [self.table[k] for k in keys], dtype=torch.float32, device=batch.input_ids.device
        )
        half = len(keys) // 2
        return ReferenceLogps(values[:half], values[half:])

    @classmethod
    @torch.no_grad()
    def compute(cls, reference: nn.Module, loaders: list[DataLoader], device) -> ReferenceCache:
        """Run ``reference`` (in eval mode) over every batch of ``loaders``."""
        table: dict[str, float] = {}
        with eval_mode(reference):
            for loader in loaders:
                for batch in loader:
                    ids, attn, loss = batch.input_ids, batch.attention_mask, batch.loss_mask
                    sums = token_logprobs(reference, ids.to(device), attn.to(device), loss.to(device)).sum()
                    table.update(zip(row_digests(ids, attn, loss), sums.float().cpu().tolist()))
        return cls(table)

    def save(self, path: Path) -> None:
        """Write atomically (a temporary file renamed into place), with the :data:`FORMAT` marker."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        keys = list(self.table)
        try:
            torch.save(
                {"format": FORMAT, "keys": keys, "logps": torch.tensor([self.table[k] for k in keys])}, tmp
            )
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> ReferenceCache:
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises several types for a file it cannot read
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            raise ValueError(f"cannot read the reference log-prob cache {path} ({reason}); delete it") from e
        if not _is_cache(state, marked=False):
            raise ValueError(f"{path} is not an alignlit reference log-prob cache; delete it or move it away")
        return cls(dict(zip(state["keys"], state["logps"].tolist())))

    @staticmethod
    def remove_stale(path: Path) -> list[Path]:
        """Remove the other caches of the same data file in ``path``'s directory and return them.

        Only files named ``ref_logps-<same data file name>-<key>.pt`` that hold the :data:`FORMAT`
        marker are removed; anything else there is left alone.
        """
        path = Path(path)
        name = re.fullmatch(rf"(ref_logps-.+-)[0-9a-f]{{{_KEY_CHARS}}}\.pt", path.name)
        if name is None or not path.parent.is_dir():
            return []
        pattern = re.compile(re.escape(name.group(1)) + rf"[0-9a-f]{{{_KEY_CHARS}}}\.pt")
        removed = []
        for other in sorted(path.parent.iterdir()):
            if other != path and pattern.fullmatch(other.name) and other.is_file() and _written_here(other):
                other.unlink()
                removed.append(other)
        return removed


def _is_cache(state: Any, *, marked: bool) -> bool:
    """Whether ``state`` is what :meth:`ReferenceCache.save` writes (``marked``: with the marker; files of
    earlier versions lack it)."""
    return (
        isinstance(state, dict)
        and (state.get("format") == FORMAT or not marked)
        and isinstance(state.get("keys"), list)
        and torch.is_tensor(state.get("logps"))
        and len(state["keys"]) == state["logps"].numel()
    )


def _written_here(path: Path) -> bool:
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception:  # unreadable: not ours to remove
        return False
    return _is_cache(state, marked=True)
