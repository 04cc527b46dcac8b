"""The admin HTTP API: SGLang's HiCache admin endpoints (same paths and bodies), health and
metrics. aiohttp, on its own thread and event loop; handlers call the Daemon's thread-safe
methods, in an executor when they may block (never on the aiohttp loop).

    GET    /health                      alive: the control loop answers (503 while draining)
    GET    /ready                       arena mapped, L3 backend not failing, not draining
    GET    /metrics                     Prometheus text (``metrics.py``)
    GET    /stats                       JSON per tier and pool (``metrics.stats_json``)
    GET    /                            the live status page (``status.py``, ``status.html``)
    GET    /status.json                 its data: the ring of samples, as chart series
    PUT    /hicache/storage-backend     attach   (admin key)
    DELETE /hicache/storage-backend     detach   (admin key)
    GET    /hicache/storage-backend     status   (admin key, as in SGLang)
    POST   /hicache/storage-backend/clear   clear L3   (admin key; also the deprecated
                                        GET|POST /clear_hicache_storage_backend)
    GET|POST /flush_cache?tier=l2|l3|all    drop pages (default l2, as SGLang's flush_cache
                                        empties the host tier and leaves L3)   (admin key)
             [&namespace=NAME]          only that namespace's pages (the answer names it)

Admin key rule (SGLang's): no ``admin_api_key`` configured -> 400 with how to enable it; key
configured -> ``Authorization: Bearer <key>`` required, else 401. The key is compared in
constant time and never logged (aiohttp's access log, which could show headers in custom
formats, is off; the daemon logs each mutating call itself, without headers).

Errors are JSON ``{"error": message, "code": code}``: ``BackendConflict`` 409, bad request
(``ProtocolError`` / ``ConfigError`` / ``BackendError``) 400, ``BackendUnavailable`` /
``StoreUnavailable`` (the store could not be opened or reached) 502, ``ShuttingDown`` 503.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import socket
import threading
from typing import NamedTuple

from aiohttp import web

from hicached.backends.guard import StoreUnavailable
from hicached.daemon.config import parse_options
from hicached.daemon.metrics import stats_json
from hicached.errors import (
    BackendConflict,
    BackendError,
    BackendUnavailable,
    ConfigError,
    HicachedError,
    ProtocolError,
    ShuttingDown,
)
from hicached.ops.status import Sampler, StatusRing, status_page
from hicached.settings import WRITE_POLICIES

log = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")  # engine-side, recorded only
# extra-config keys SGLang's engine consumes itself (prefetch knobs, dynamic-backend loading):
# they never reach a backend
ENGINE_SIDE_KEYS = frozenset({
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max", "hicache_storage_pass_prefix_keys", "tp_lcm_size", "backend_name",
    "module_path", "class_name", "interface_v1",
})
ATTACH_FIELDS = ("hicache_storage_backend", "hicache_storage_backend_extra_config_json",
                 "hicache_storage_prefetch_policy", "hicache_write_policy")
ATTACH_TIMEOUT_S = 600.0  # connecting to a store (Mooncake) can take a while
NO_KEY_MESSAGE = ("This endpoint requires an admin API key, but hicached was started without "
                  "one. Restart it with --admin-api-key (or admin_api_key in the config file, "
                  "or HICACHED_ADMIN_API_KEY) to enable.")


class AttachRequest(NamedTuple):
    """A ``PUT /hicache/storage-backend`` body, mapped onto the daemon's terms."""

    backend: str
    options: dict  # backend keyword options
    write_policy: str | None
    prefetch_policy: str | None  # engine-side; recorded in the status
    engine_options: dict  # extra-config keys the engine consumes (recorded, not passed)
    extra_config_json: str  # as sent, for the status


def attach_request(body: object) -> AttachRequest:
    """The one place SGLang's attach body is mapped onto backend options and daemon policies."""
    if not isinstance(body, dict):
        raise ProtocolError("attach body must be a JSON object with hicache_storage_backend")
    unknown = sorted(set(body) - set(ATTACH_FIELDS))
    if unknown:
        raise ProtocolError(f"unknown attach fields {unknown}; valid: {list(ATTACH_FIELDS)}")
    name = body.get("hicache_storage_backend")
    if not isinstance(name, str) or not name:
        raise ProtocolError("hicache_storage_backend: required, a backend name such as "
                            "'file' or 'mooncake'")
    raw = body.get("hicache_storage_backend_extra_config_json") or "{}"
    if isinstance(raw, str) and raw.startswith("@"):
        raise ProtocolError("hicache_storage_backend_extra_config_json: @file is not read "
                            "over HTTP; send the JSON itself (hicached attach --config @file "
                            "reads the file on the client)")
    options = parse_options(raw, "hicache_storage_backend_extra_config_json")
    engine = {k: options.pop(k) for k in sorted(ENGINE_SIDE_KEYS & set(options))}
    prefetch = body.get("hicache_storage_prefetch_policy") or None
    if prefetch is not None and prefetch not in PREFETCH_POLICIES:
        raise ProtocolError(f"hicache_storage_prefetch_policy: unknown {prefetch!r}; "
                            f"valid: {list(PREFETCH_POLICIES)}")
    write = body.get("hicache_write_policy") or None
    if write is not None and write not in WRITE_POLICIES:
        raise ProtocolError(f"hicache_write_policy: unknown {write!r}; "
                            f"valid: {list(WRITE_POLICIES)}")
    raw_json = raw if isinstance(raw, str) else json.dumps(raw)
    return AttachRequest(name, options, write, prefetch, engine, raw_json)


def error_status(e: BaseException) -> int:
    """HTTP status of a daemon error."""
    if isinstance(e, BackendConflict):
        return 409
    if isinstance(e, (BackendUnavailable, StoreUnavailable)):
        return 502
    if isinstance(e, (ProtocolError, ConfigError, BackendError)):
        return 400
    if isinstance(e, ShuttingDown):
        return 503
    return 500


def _json(data: object, status: int = 200) -> web.Response:
    return web.json_response(data, status=status,
                             dumps=functools.partial(json.dumps, default=str))


def _error(e: BaseException) -> web.Response:
    code = getattr(e, "code", "internal")
    return _json({"error": str(e), "code": code}, error_status(e))


class AdminServer:
    """The admin API of one ``Daemon``: ``start()`` binds (raises if it cannot), ``close()``
    stops it. Owns its thread, its event loop and the attach record SGLang's status shows."""

    def __init__(self, daemon, host: str, port: int, api_key: str = ""):
        self.daemon = daemon
        self.host, self.port = host, port
        self._key = api_key.encode() if api_key else None  # (the Bearer credentials)
        self._record = {"hicache_storage_backend_extra_config": json.dumps(
                            dict(daemon.config.l3_options)),
                        "hicache_storage_prefetch_policy": "best_effort",
                        "engine_options": {}}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.status = StatusRing(daemon.config.status_sample_s)  # the status page's samples

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread = threading.Thread(target=self._run, name="hicached-admin", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise HicachedError(f"admin API did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error
        if self.host not in ("127.0.0.1", "::1", "localhost") and self._key is None:
            log.warning("admin API on %s without an admin API key: anyone who reaches it can "
                        "read stats; mutating endpoints stay refused", self.url)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._started.set()
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as e:
            self._error = ConfigError(f"admin_port: cannot listen on {self.host}:{self.port}: "
                                      f"{e.strerror or e}")
            self._started.set()
            await runner.cleanup()
            return
        log.info("admin API on %s (status page: %s/)", self.url, self.url)
        sampler = asyncio.create_task(Sampler(self.daemon, self.status).run())
        self._started.set()
        await self._stopping.wait()
        sampler.cancel()
        await runner.cleanup()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving (requests in progress get ``timeout_s`` to finish). Idempotent."""
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # loop already closed
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------ routes

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/ready", self.ready)
        r.add_get("/metrics", self.metrics)
        r.add_get("/stats", self.stats)
        r.add_get("/", self.page)
        r.add_get("/status.json", self.status_json)
        r.add_put("/hicache/storage-backend", self._admin(self.attach))
        r.add_delete("/hicache/storage-backend", self._admin(self.detach))
        r.add_get("/hicache/storage-backend", self._admin(self.backend_status))
        r.add_post("/hicache/storage-backend/clear", self._admin(self.clear))
        r.add_route("*", "/clear_hicache_storage_backend", self._admin(self.clear))
        r.add_get("/flush_cache", self._admin(self.flush))
        r.add_post("/flush_cache", self._admin(self.flush))
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status not in (404, 405):
                raise
            answer = _json({"error": f"{e.reason}: {request.method} {request.path}",
                            "code": "not_found" if e.status == 404 else "method_not_allowed"},
                           e.status)
            if "Allow" in e.headers:
                answer.headers["Allow"] = e.headers["Allow"]
            return answer
        except HicachedError as e:
            return _error(e)
        except Exception as e:  # a bug costs this request, never the daemon
            log.exception("admin %s %s failed", request.method, request.path)
            return _json({"error": f"{type(e).__name__}: {e}", "code": "internal"}, 500)

    def _admin(self, handler):
        """Wrap a handler with SGLang's admin key rule."""

        @functools.wraps(handler)
        async def checked(request: web.Request) -> web.StreamResponse:
            if self._key is None:
                return _json({"error": NO_KEY_MESSAGE, "code": "admin_api_key_missing"}, 400)
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(  # scheme: any case
                    given.strip().encode(), self._key):
                return web.json_response(
                    {"error": "unauthorized: send Authorization: Bearer <admin API key>",
                     "code": "unauthorized"}, status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="hicached"'})
            return await handler(request)

        return checked

    async def _blocking(self, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(fn, *args, **kw))

    # ------------------------------------------------------------ open endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self.daemon.draining:
            return _json({"status": "draining"}, 503)
        try:
            await self._blocking(self.daemon.call, lambda: None, 5.0)
        except HicachedError as e:
            return _json({"status": "unresponsive", "error": str(e)}, 503)
        return _json({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        try:
            body = await self._blocking(self.daemon.call, self.daemon.operations.readiness, 5.0)
        except HicachedError as e:
            return _json({"ready": False, "reason": str(e)}, 503)
        return _json(body, 200 if body["ready"] else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        body = await self._blocking(self.daemon.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(self, request: web.Request) -> web.Response:
        d = self.daemon
        snap = await self._blocking(d.call, d.metrics.snapshot, 10.0)
        return _json(stats_json(snap))

    async def page(self, request: web.Request) -> web.Response:
        body, headers = status_page()
        return web.Response(body=body, headers=headers)

    async def status_json(self, request: web.Request) -> web.Response:
        """The ring (never the control loop): derived once per sample, whoever asks."""
        return web.Response(body=self.status.view(), headers={
            "Content-Type": "application/json", "Cache-Control": "no-store"})

    # ------------------------------------------------------------ admin endpoints

    def _status(self, tier: dict) -> dict:
        """SGLang's status fields first, then the daemon's view of the L3 tier."""
        return {"hicache_storage_backend": tier["backend"] if tier["attached"] else None,
                "hicache_storage_backend_extra_config":
                    self._record["hicache_storage_backend_extra_config"],
                "hicache_storage_prefetch_policy":
                    self._record["hicache_storage_prefetch_policy"],
                "hicache_write_policy": tier["write_policy"],
                "engine_options": self._record["engine_options"], **tier}

    async def attach(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise ProtocolError(f"attach body is not JSON: {e}") from None
        req = attach_request(body)
        log.info("admin: attach L3 backend %s (write policy %s) from %s", req.backend,
                 req.write_policy or "unchanged", request.remote)
        tier = await self._blocking(self.daemon.operations.attach_backend, req.backend, req.options,
                                    write_policy=req.write_policy, timeout_s=ATTACH_TIMEOUT_S)
        if req.options or not tier.get("reattached"):  # (a re-attach keeps its options)
            self._record["hicache_storage_backend_extra_config"] = req.extra_config_json
        if req.prefetch_policy:
            self._record["hicache_storage_prefetch_policy"] = req.prefetch_policy
        self._record["engine_options"] = req.engine_options
        return _json({"success": True, "message": "HiCache storage backend attached.",
                      **self._status(tier)})

    async def detach(self, request: web.Request) -> web.Response:
        log.info("admin: detach L3 backend from %s", request.remote)
        tier = await self._blocking(self.daemon.operations.detach_backend)
        message = ("HiCache storage backend detached." if tier.pop("detached")
                   else "No HiCache storage backend was attached.")
        if tier.get("dirty_dropped"):
            message += (f" {tier['dirty_dropped']} write-back pages it could not take in time "
                        "stay in L2 only.")
        return _json({"success": True, "message": message, **self._status(tier)})

    async def backend_status(self, request: web.Request) -> web.Response:
        return _json(self._status(await self._blocking(self.daemon.operations.backend_status)))

    async def clear(self, request: web.Request) -> web.Response:
        return await self._flush(request, "l3")

    async def flush(self, request: web.Request) -> web.Response:
        return await self._flush(request, request.query.get("tier", "l2"),
                                 request.query.get("namespace", ""))

    async def _flush(self, request: web.Request, tier: str, namespace: str = ""
                     ) -> web.Response:
        d = self.daemon
        if tier in ("l3", "all") and not (await self._blocking(d.operations.backend_status))["attached"]:
            if tier == "l3":
                raise BackendError("no L3 backend attached: nothing to clear")
            tier = "l2"
        log.info("admin: flush %s%s from %s", tier,
                 f" of namespace {namespace!r}" if namespace else "", request.remote)
        pages = await self._blocking(d.operations.flush, tier, namespace=namespace)
        what = {"l2": "L2", "l3": "L3", "all": "L2 and L3"}[tier]
        of = f" of namespace {namespace!r}" if namespace else ""
        # (the answer names the namespace: a client can tell a daemon that read it)
        return _json({"success": True, "tier": tier, "pages": pages,
                      **({"namespace": namespace} if namespace else {}),
                      "message": f"Cache flushed: {pages} page{'' if pages == 1 else 's'}{of} "
                                 f"dropped from {what}."})


def check_admin_port(host: str, port: int) -> None:
    """ConfigError when ``host:port`` cannot be listened on (another process has it): checked
    before the daemon reserves its arena and opens L3, so a second daemon fails at once."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the API's own bind
        probe.bind((host, port))
    except OSError as e:
        raise ConfigError(f"admin_port: cannot listen on {host}:{port}: "
                          f"{e.strerror or e}") from None
    finally:
        probe.close()


def start_admin(daemon) -> AdminServer | None:
    """Start the admin API when ``admin_port`` is configured (None when it is not)."""
    c = daemon.config
    if not c.admin_port:
        return None
    server = AdminServer(daemon, c.admin_host, c.admin_port, c.admin_api_key)
    server.start()
    return server
