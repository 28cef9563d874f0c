"""Served engines against strangers and broken answers (issue 36: "Security", silent item 7, the unclear
served-engine errors).

Without vLLM, the engine is a stand-in that runs alignlit's own engine-side code: the HTTP routes sit behind
the real :class:`~alignlit.rollout.engine_auth.BearerAuthMiddleware` (an ASGI app served over real HTTP on
127.0.0.1 by a small bridge), and the weight routes call the real worker extension and gloo weight-transfer
backend of :mod:`alignlit.rollout.vllm_worker` (imported against a stub of the few vLLM base classes it
subclasses). The trainer side is the real :class:`~alignlit.rollout.server.ServedVLLMEngine`. The last test
runs a real ``alignlit serve`` engine (``vllm`` mark, ``nox -s vllm``). Every address is 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import math
import re
import socket
import sys
import threading
import types
import typing
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import pytest
import torch

import alignlit.rollout as rollout_pkg
from alignlit.rollout import SamplingParams
from alignlit.rollout.endpoint import EngineError, EngineHTTP, vllm_serve_command
from alignlit.rollout.engine_auth import API_KEY_ENV, MIDDLEWARE, BearerAuthMiddleware
from alignlit.rollout.hf_worker import WeightSyncError, state_checksum
from alignlit.rollout.server import ServedVLLMEngine

KEY = "k" * 8 + "-test-secret-0123456789"
OTHER = "o" * 8 + "-another-secret-98765"


# ---------------------------------------------------------------------------------------------- helpers
def _listening(port: int) -> list[str]:
    """The local addresses with a socket listening on TCP ``port`` (``/proc/net/tcp`` and ``tcp6``)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    raw = bytes.fromhex(address)
                    if len(raw) == 4:
                        found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                    else:  # four little-endian 32-bit words
                        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                        found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found


def _stub_vllm() -> dict[str, types.ModuleType]:
    """The vLLM names :mod:`alignlit.rollout.vllm_worker` imports: base classes and a registry."""
    init_t, update_t = TypeVar("init_t"), TypeVar("update_t")

    class WeightTransferEngine(Generic[init_t, update_t]):
        def __init__(self, config, vllm_config, device, model):
            self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model

    @dataclasses.dataclass
    class WeightTransferInitInfo:
        pass

    @dataclasses.dataclass
    class WeightTransferUpdateInfo:
        pass

    class WeightTransferEngineFactory:
        _registry: typing.ClassVar[dict] = {}

        @classmethod
        def register_engine(cls, name, engine):
            cls._registry[name] = engine

    mods = {
        name: types.ModuleType(name)
        for name in (
            "vllm", "vllm.distributed", "vllm.distributed.weight_transfer", "vllm.distributed.weight_transfer.base",
            "vllm.distributed.weight_transfer.factory", "vllm.model_executor", "vllm.model_executor.model_loader",
            "vllm.model_executor.model_loader.mtp_validation",
        )
    }  # fmt: skip
    base = mods["vllm.distributed.weight_transfer.base"]
    base.WeightTransferEngine = WeightTransferEngine
    base.WeightTransferInitInfo = WeightTransferInitInfo
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo
    mods["vllm.distributed.weight_transfer.factory"].WeightTransferEngineFactory = WeightTransferEngineFactory
    mods[
        "vllm.model_executor.model_loader.mtp_validation"
    ].disable_mtp_completeness_check = contextlib.nullcontext
    return mods


@pytest.fixture
def worker_module(monkeypatch):
    """:mod:`alignlit.rollout.vllm_worker` imported against the vLLM stub; every module restored afterwards."""
    name = "alignlit.rollout.vllm_worker"
    for loaded in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.") or n == name]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.delattr(rollout_pkg, "vllm_worker", raising=False)
    for stub_name, stub in _stub_vllm().items():
        monkeypatch.setitem(sys.modules, stub_name, stub)
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)
    rollout_pkg.__dict__.pop("vllm_worker", None)


# ---------------------------------------------------------------------------------------------- the stand-in
class _Bridge(BaseHTTPRequestHandler):
    """HTTP on 127.0.0.1 -> the server's ASGI app (one request, one asyncio run)."""

    def _serve(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = urlsplit(self.path)
        scope = {
            "type": "http", "method": self.command, "path": parts.path, "root_path": "",
            "query_string": parts.query.encode(),
            "headers": [(k.lower().encode(), v.encode()) for k, v in self.headers.items()],
        }  # fmt: skip
        out: dict[str, Any] = {"body": b""}

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            if message["type"] == "http.response.start":
                out["status"], out["headers"] = message["status"], message.get("headers", [])
            else:
                out["body"] += message.get("body", b"")

        asyncio.run(self.server.asgi(scope, receive, send))
        self.send_response(out["status"])
        for k, v in out["headers"]:
            if k.lower() != b"content-length":
                self.send_header(k.decode(), v.decode())
        self.send_header("Content-Length", str(len(out["body"])))
        self.end_headers()
        self.wfile.write(out["body"])

    do_GET = do_POST = do_PUT = _serve

    def log_message(self, *args) -> None:
        pass


class FakeEngine:
    """A served engine's routes around alignlit's real engine-side code (module docstring).

    ``key``: the engine's shared secret (the middleware's and the worker's); ``auth=False`` serves without
    the middleware (an impostor). ``answer``: what ``/inference/v1/generate`` answers (a callable of the
    request: a JSON-able object, or bytes sent as HTML). ``tamper``: worker methods replaced by callables."""

    def __init__(self, vw, monkeypatch, *, key: str | None = KEY, auth: bool = True):
        self.vw, self.key = vw, key
        monkeypatch.setattr(vw, "_secret", lambda: key)  # the engine's $ALIGNLIT_API_KEY
        self.label = "initial"
        self.loaded: list[dict] = []
        self.listening: list[str] = []
        self.answer = self.valid_answer
        self.tamper: dict[str, Any] = {}
        engine = self

        class Worker(vw.AlignlitWorkerExtension):
            vllm_config = SimpleNamespace(
                model_config=SimpleNamespace(
                    model="fake", dtype="torch.float32", logprobs_mode="processed_logprobs", max_model_len=256,
                    generation_config="vllm",
                ),
                weight_transfer_config=SimpleNamespace(backend="gloo"),
            )  # fmt: skip

            def reload_weights(self, weights_iterator, is_checkpoint_format):
                engine.loaded.append(dict(weights_iterator))

        class Model:
            def load_weights(self, weights):
                engine.loaded.append(dict(weights))

        self.worker = Worker()
        self.transfer = object.__new__(vw.GlooWeightTransferEngine)
        self.transfer.group, self.transfer.last_checksum = None, None
        self.transfer.model, self.transfer.device = Model(), torch.device("cpu")
        self.transfer.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        app = BearerAuthMiddleware(self.asgi, api_key=key) if auth else self.asgi
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Bridge)
        self.server.daemon_threads = True
        self.server.asgi = app
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def valid_answer(self, body) -> dict:
        ids = [5, 6, 7]
        return {
            "choices": [
                {
                    "token_ids": ids,
                    "logprobs": {"content": [{"token_id": t, "logprob": -1.0 - 0.25 * i} for i, t in enumerate(ids)]},
                    "weight_versions": [{"version": self.label, "start": 0, "end": len(ids)}],
                    "finish_reason": "length",
                }
            ]
        }  # fmt: skip

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        vw = self.vw
        if path == "/health":
            return 200, {}
        if path == "/get_world_size":
            return 200, {"world_size": 1}
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            self.listening = _listening(info["master_port"])
            self.transfer.init_transfer_engine(vw.GlooInitInfo(**info))
            return 200, {}
        if path == "/update_weights":
            self.transfer.receive_weights(vw.GlooUpdateInfo(**body["update_info"]))
            return 200, {}
        if path == "/finish_weight_update":
            self.label = body["weight_version"]
            return 200, {}
        if path == "/update_weight_version":
            self.label = body["new_version"]
            return 200, {}
        if path == "/weight_info":
            return 200, {"weight_version": self.label}
        if path == "/collective_rpc":
            method_name = body["method"]
            call = self.tamper.get(method_name) or getattr(self.worker, method_name)
            return 200, {"results": [call(*body.get("args", []))]}
        if path == "/inference/v1/generate":
            return 200, self.answer(body)
        if path in ("/pause", "/resume", "/start_weight_update", "/reset_prefix_cache"):
            return 200, {}
        return 404, {"error": f"no route {path}"}

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        raw = (await receive()).get("body", b"")
        try:
            status, payload = self.route(scope["method"], scope["path"], json.loads(raw) if raw else None)
        except Exception as err:  # what vLLM answers for an exception in a route
            status, payload = 500, {"error": f"{type(err).__name__}: {err}"}
        if isinstance(payload, bytes):
            data, kind = payload, b"text/html"
        else:
            data, kind = json.dumps(payload).encode(), b"application/json"
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": data})


@pytest.fixture
def fake(worker_module, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engines: list[FakeEngine] = []

    def make(**kwargs) -> FakeEngine:
        engines.append(FakeEngine(worker_module, monkeypatch, **kwargs))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(11, 4, generator=g), "norm.weight": torch.randn(4, generator=g)}


def _client(engine: FakeEngine, tokenizer, **kwargs) -> ServedVLLMEngine:
    config = SimpleNamespace(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    kwargs = {
        "weight_sync": "collective",
        "address": "127.0.0.1",
        "timeout_s": 20,
        "start_timeout_s": 5,
        **kwargs,
    }
    return ServedVLLMEngine([engine.url], tokenizer, model_config=config, **kwargs)


def _raw(url: str, path: str, *, body: Any = None, key: str | None = None, method: str | None = None) -> int:
    """The HTTP status of one request (``key``: sent as a bearer token)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


PROTECTED = [
    ("POST", "/collective_rpc", {"method": "alignlit_load_file", "args": ["/tmp/x", None]}),
    ("POST", "/update_weight_version", {"new_version": "someone-else"}),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
    ("POST", "/update_weights", {"update_info": {}}),
    ("POST", "/v1/completions", {"prompt": "a"}),
    ("POST", "/v1/chat/completions", {"messages": []}),
    ("POST", "/inference/v1/generate", {"token_ids": [1]}),
    ("GET", "/weight_info", None),
    ("GET", "/metrics", None),
    ("GET", "/healthz", None),
    ("GET", "/health/../weight_info", None),
    ("POST", "/health", {}),
]


# ---------------------------------------------------------------------------------------------- the shared secret
def test_every_route_but_get_health_needs_the_key(fake):
    engine = fake()
    assert _raw(engine.url, "/health") == 200  # liveness probes stay open
    for method, path, body in PROTECTED:
        for key in (None, OTHER, KEY[:-1], KEY + "x", "Bearer"):
            assert _raw(engine.url, path, body=body, key=key, method=method) == 401, (path, key)
    assert _raw(engine.url, "/weight_info", key=KEY) == 200
    assert _raw(engine.url, "/update_weight_version", body={"new_version": "v"}, key=KEY) == 200
    # another scheme than Bearer with the right key is refused too
    request = urllib.request.Request(engine.url + "/weight_info", headers={"Authorization": f"Basic {KEY}"})
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(request, timeout=30)


def test_the_middleware_closes_websockets_and_refuses_to_start_without_a_key(monkeypatch):
    sent: list[dict] = []
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    middleware = BearerAuthMiddleware(app, api_key=KEY)
    asyncio.run(middleware({"type": "websocket", "path": "/v1/realtime", "headers": []}, None, send))
    assert sent == [{"type": "websocket.close", "code": 1008}] and not reached
    headers = [(b"authorization", f"Bearer {KEY}".encode())]
    asyncio.run(middleware({"type": "websocket", "path": "/v1/realtime", "headers": headers}, None, send))
    asyncio.run(middleware({"type": "lifespan", "path": "startup"}, None, send))
    assert reached == ["/v1/realtime", "startup"]  # the keyed websocket and the lifespan pass
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=API_KEY_ENV):
        BearerAuthMiddleware(app)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert BearerAuthMiddleware(app)._key == KEY.encode()


def test_a_trainer_without_the_key_or_with_another_is_refused_naming_the_endpoint(
    fake, tokenizer, monkeypatch
):
    engine = fake()
    with pytest.raises(
        EngineError, match=rf"rollout engine {engine.url} refused .*HTTP 401.*no API key was sent"
    ):
        _client(engine, tokenizer).connect()
    with pytest.raises(
        EngineError, match=rf"rollout engine {engine.url} refused .*HTTP 401.*not the engine's"
    ):
        _client(engine, tokenizer, api_key=OTHER).connect()
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the environment variable is the trainer's default source
    client = _client(engine, tokenizer)
    client.connect()
    assert KEY not in repr(client.engines[0]) and KEY not in repr(vars(client))


def test_an_engine_that_does_not_hold_the_key_is_refused(fake, tokenizer):
    """An impostor answering every request (no middleware) cannot prove the key the trainer holds."""
    for impostor in (fake(key=None, auth=False), fake(key=OTHER, auth=False)):
        with pytest.raises(
            EngineError, match=rf"rollout engine {impostor.url} (holds no API key|does not hold)"
        ):
            _client(impostor, tokenizer, api_key=KEY).connect()
    open_engine = fake(key=KEY)
    with pytest.raises(EngineError, match="no API key was sent"):
        _client(open_engine, tokenizer, api_key=None).connect()


def test_a_key_file_is_read_and_a_weak_key_refused(fake, tokenizer, tmp_path):
    engine = fake()
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    _client(engine, tokenizer, api_key_file=str(path)).connect()
    with pytest.raises(ValueError, match="fewer than 16"):
        _client(engine, tokenizer, api_key="short")
    with pytest.raises(ValueError, match="cannot read the API key file"):
        _client(engine, tokenizer, api_key_file=str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------- the weight push
def test_collective_push_binds_the_rendezvous_to_the_address_and_checks_every_checksum(fake, tokenizer):
    engine = fake()
    client = _client(engine, tokenizer, api_key=KEY)
    state = _state()
    client.load_weights(3, state)
    assert engine.listening == ["127.0.0.1"]  # the store listened on loopback only, not on every interface
    assert engine.label == client.label and engine.vw.RECEIVED["checksum"] == state_checksum(state)
    got = {k: v for part in engine.loaded for k, v in part.items()}
    assert all(torch.equal(got[k], state[k]) for k in state)
    rollout = client.generate(["hello"], 2, SamplingParams(temperature=1.0, max_new_tokens=3))
    assert rollout.response_ids.tolist() == [[5, 6, 7]] * 2
    assert torch.allclose(rollout.logprobs, torch.tensor([[-1.0, -1.25, -1.5]] * 2))


def test_an_engine_answering_another_checksum_than_the_push_is_an_error(fake, tokenizer, tmp_path):
    engine = fake()
    engine.tamper["alignlit_last_checksum"] = lambda: state_checksum(_state()) + 1
    with pytest.raises(
        WeightSyncError, match=rf"rollout engine {engine.url} received weights .* with checksum"
    ):
        _client(engine, tokenizer, api_key=KEY).load_weights(1, _state())
    # the file fallback: the engine answers the checksum of what it loaded
    other = fake()
    other.tamper["alignlit_load_file"] = lambda folder, checksum: {"checksum": checksum - 1}
    with pytest.raises(WeightSyncError, match=rf"rollout engine {other.url} loaded weights .* with checksum"):
        _client(other, tokenizer, api_key=KEY, weight_sync="file", sync_dir=str(tmp_path)).load_weights(
            1, _state()
        )
    other.tamper["alignlit_load_file"] = lambda folder, checksum: {"checksum": None}  # "skipped"
    with pytest.raises(WeightSyncError, match="checksum None"):
        _client(other, tokenizer, api_key=KEY, weight_sync="file", sync_dir=str(tmp_path)).load_weights(
            1, _state()
        )


def test_the_checksum_is_never_skipped(fake, tokenizer, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="verify must be True"):
        _client(fake(), tokenizer, api_key=KEY, verify=False)
    # the engine's file load refuses a null checksum and loads nothing
    engine = fake()
    with pytest.raises(WeightSyncError, match="without a checksum is refused"):
        engine.worker.alignlit_load_file(str(tmp_path), None)
    assert not engine.loaded
    # a collective push without a checksum is refused by every engine, which loads nothing of it
    import alignlit.rollout.weight_sync as weight_sync

    monkeypatch.setattr(weight_sync, "state_checksum", lambda state: None)
    with pytest.raises(
        EngineError, match=rf"{engine.url} answered HTTP 500 to /update_weights.*without a checksum"
    ):
        _client(engine, tokenizer, api_key=KEY).load_weights(1, _state())
    assert not engine.loaded and engine.label == "initial"


# ---------------------------------------------------------------------------------------------- the rendezvous
def test_the_rendezvous_listens_only_on_the_address_given():
    from alignlit.rollout.weight_sync import listen_store

    store = listen_store("127.0.0.1", 2, 10)
    assert _listening(store.port) == ["127.0.0.1"]
    del store


def test_a_member_without_the_secret_cannot_join_the_weight_group():
    from alignlit.rollout.weight_sync import listen_store, open_group

    def form(secret_here: str, secret_there: str) -> dict[str, Any]:
        store = listen_store("127.0.0.1", 2, 10)
        result: dict[str, Any] = {}

        def member(rank, secret, **kw):
            try:
                result[rank] = open_group(
                    "127.0.0.1", store.port, rank, 2, 3, secret=secret, nonce="n1", **kw
                )
            except WeightSyncError as err:
                result[rank] = err

        threads = [threading.Thread(target=member, args=(0, secret_here), kwargs={"store": store}),
                   threading.Thread(target=member, args=(1, secret_there))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return result

    refused = form(KEY, OTHER)
    for rank in (0, 1):
        assert isinstance(refused[rank], WeightSyncError), refused
        assert "shared secret" in str(refused[rank]) and "alignlit-weights" not in str(refused[rank])
    joined = form(KEY, KEY)
    assert not any(isinstance(v, Exception) for v in joined.values()) and len(joined) == 2


# ---------------------------------------------------------------------------------------------- the answers
def _answer(ids, logps, label_of):
    return lambda body: {
        "choices": [
            {
                "token_ids": ids,
                "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logps)]},
                "weight_versions": [{"version": label_of()}],
                "finish_reason": "length",
            }
        ]
    }


HOSTILE = {
    "token id 10**9": (lambda e: _answer([5, 10**9], [-1.0, -1.0], lambda: e.label), r"token id 1000000000 at position 1, outside the vocabulary \[0, \d+\)"),
    "negative token id": (lambda e: _answer([-3], [-1.0], lambda: e.label), r"token id -3 at position 0, outside the vocabulary"),
    "float token id": (lambda e: _answer([5.5], [-1.0], lambda: e.label), r"token id 5.5 at position 0"),
    "NaN log-prob": (lambda e: _answer([5, 6], [-1.0, math.nan], lambda: e.label), r"log-prob nan at position 1 \(token 6\): not a finite number"),
    "-inf log-prob": (lambda e: _answer([5], [-math.inf], lambda: e.label), r"log-prob -inf at position 0 \(token 5\): not a finite number"),
    "log-prob +5": (lambda e: _answer([5], [5.0], lambda: e.label), r"log-prob 5.0 at position 0 \(token 5\): above 0"),
    "string log-prob": (lambda e: _answer([5], ["-1"], lambda: e.label), r"log-prob '-1' at position 0"),
    "HTML": (lambda e: (lambda body: b"<html><body><h1>502 Bad Gateway</h1></body></html>"), r"not JSON .*'<html><body><h1>502 Bad Gateway"),
    "no choices": (lambda e: (lambda body: {"object": "error", "message": "model not loaded"}), r"without choices: .*model not loaded"),
    "empty choices": (lambda e: (lambda body: {"choices": []}), r"without choices"),
    "no log-probs": (lambda e: (lambda body: {"choices": [{"token_ids": [5, 6]}]}), r"with 2 tokens but 0 log-probs"),
    "token_ids not a list": (lambda e: (lambda body: {"choices": [{"token_ids": "5 6"}]}), r"token_ids that are not a list: '5 6'"),
    "bad weight_versions": (lambda e: (lambda body: {"choices": [{"token_ids": [5], "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}]}, "weight_versions": "v1"}]}), r"malformed weight_versions: 'v1'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_or_impossible_answer_is_refused_naming_endpoint_sample_and_value(
    case, fake, tokenizer, tmp_path
):
    engine = fake()
    client = _client(engine, tokenizer, api_key=KEY, weight_sync="file", sync_dir=str(tmp_path))
    client.load_weights(1, _state())
    make, pattern = HOSTILE[case]
    engine.answer = make(engine)
    with pytest.raises(EngineError) as info:
        client.generate(["a", "b"], 2, SamplingParams(temperature=1.0, max_new_tokens=3))
    message = str(info.value)
    assert f"rollout engine {engine.url}" in message and "/inference/v1/generate" in message, message
    assert re.search(pattern, message), message
    if "not JSON" not in message:
        assert re.search(r"for sample [01] of prompt [01] with", message), message


def test_a_log_prob_within_round_off_of_zero_is_kept(fake, tokenizer, tmp_path):
    engine = fake()
    client = _client(engine, tokenizer, api_key=KEY, weight_sync="file", sync_dir=str(tmp_path))
    client.load_weights(1, _state())
    engine.answer = _answer([5], [5e-5], lambda: engine.label)
    rollout = client.generate(["a"], 1, SamplingParams(temperature=1.0, max_new_tokens=1))
    assert rollout.logprobs[0, 0].item() == pytest.approx(5e-5)


def test_other_routes_answering_html_or_missing_fields_name_the_endpoint(fake):
    engine = fake()
    http = EngineHTTP(engine.url, api_key=KEY)
    engine.route = lambda method, path, body: (200, b"<!DOCTYPE html><title>login</title>")
    with pytest.raises(
        EngineError, match=rf"rollout engine {engine.url} answered /weight_info .*not JSON.*DOCTYPE"
    ):
        http.weight_version()
    engine.route = lambda method, path, body: (200, {"version": "x"})
    with pytest.raises(EngineError, match=rf"{engine.url} answered /weight_info without weight_version"):
        http.weight_version()
    with pytest.raises(EngineError, match=rf"{engine.url} gave no answer to alignlit_info"):
        http.info()


# ---------------------------------------------------------------------------------------------- alignlit serve
def test_alignlit_serve_generates_prints_and_requires_a_key(tmp_path, capsys, monkeypatch):
    from alignlit.cli import serve

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert serve.main([str(model), "--print"]) == 0
    out = capsys.readouterr().out
    key = out.rsplit("): ", 1)[1].strip()
    assert len(key) >= 40 and out.count(key) == 1  # printed once, not in the command line or its environment
    assert f"--middleware {MIDDLEWARE}" in out and f"{API_KEY_ENV}=<the API key>" in out
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY)
    keyfile.chmod(0o600)
    assert serve.main([str(model), "--host", "0.0.0.0", "--api-key-file", str(keyfile), "--print"]) == 0
    out = capsys.readouterr().out
    assert KEY not in out and "API key from --api-key-file" in out and "--host 0.0.0.0" in out
    for argv in (
        ["--host", "0.0.0.0", "--insecure-no-auth"],
        ["--insecure-no-auth", "--", "--host", "0.0.0.0"],
    ):
        with pytest.raises(SystemExit, match="loopback"):
            serve.main([str(model), *argv, "--print"])
    assert serve.main([str(model), "--insecure-no-auth", "--print"]) == 0
    assert "--middleware" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="needs an API key"):
        vllm_serve_command(model, host="10.1.2.3")
    command, env = vllm_serve_command(model, host="10.1.2.3", api_key=KEY)
    assert env[API_KEY_ENV] == KEY and KEY not in " ".join(command)


# ---------------------------------------------------------------------------------------------- a real engine
@pytest.mark.vllm
def test_a_real_served_engine_refuses_strangers_and_serves_its_trainer(tiny_policy_dir, tokenizer, tmp_path):
    """``alignlit serve``'s engine (real vLLM, CPU build): every weight and generation route refuses a request
    without the key or with another; ``/health`` answers; a file load without a checksum is refused; the
    trainer holding the key pushes (collective and file) and samples, and one holding another key is refused."""
    from transformers import AutoModelForCausalLM

    from alignlit.rollout.endpoint import EngineProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = EngineProcess(tiny_policy_dir, port, extra=["--max-model-len", "256"], api_key=KEY,
                           log=tmp_path / "engine.log", env={"VLLM_LOGGING_LEVEL": "WARNING"})  # fmt: skip
    try:
        engine.wait_ready(1200)
        assert _raw(engine.url, "/health") == 200
        for method, path, body in PROTECTED:
            for key in (None, OTHER):
                assert _raw(engine.url, path, body=body, key=key, method=method) == 401, (path, key)
        http = engine.http()
        before = http.weight_version()
        try:  # the worker refuses: vLLM answers an error, or the error's text as the result
            got = http.rpc("alignlit_load_file", str(tmp_path), None, what="loading without a checksum")
        except EngineError as err:
            assert f"{engine.url} answered HTTP" in str(err) and "/collective_rpc" in str(err), err
        else:
            assert isinstance(got, str) and "without a checksum is refused" in got, got
        assert http.weight_version() == before
        policy = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32).eval()
        for mode in ("collective", "file"):
            client = ServedVLLMEngine([engine.url], tokenizer, model_config=policy.config, api_key=KEY,
                                      weight_sync=mode, sync_dir=str(tmp_path), address="127.0.0.1")  # fmt: skip
            client.sync(policy, version=1)
            assert http.weight_version() == client.label
            rollout = client.generate(
                ["\n\nHuman: sort b a\n\nAssistant:"], 2, SamplingParams(max_new_tokens=4)
            )
            assert rollout.response_mask.any() and (rollout.logprobs <= 0).all()
        with pytest.raises(EngineError, match=rf"{engine.url} refused .*HTTP 401"):
            ServedVLLMEngine([engine.url], tokenizer, api_key=OTHER, start_timeout_s=60).connect()
    finally:
        engine.stop()
