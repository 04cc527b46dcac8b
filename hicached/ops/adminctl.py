"""``hicached status | flush | attach | detach``: talk to a running daemon.

    hicached status                          health, readiness, tiers, pools, namespaces
    hicached flush [--tier l2|l3|all]        drop pages (default l2)
                   [--namespace NAME]        ... of that namespace only (default: every page)
    hicached attach BACKEND [--l3-options JSON|@file] [--write-policy P] [--prefetch-policy P]
    hicached detach

How the daemon is found (first that applies):
    --url URL        its admin HTTP API (remote scripts): key from --admin-api-key,
                     HICACHED_ADMIN_API_KEY or admin_api_key of the daemon's config
    --endpoint EP    its control socket
    admin_port set   in the daemon's config (--daemon-config FILE, default
                     /etc/hicached/hicached.toml when readable, with HICACHED_* overrides):
                     its admin HTTP API at admin_host:admin_port
    otherwise        its control socket on this machine: the config's endpoint
                     (HICACHED_ENDPOINT), else the default endpoint of ``hicached serve``
                     (ipc://$XDG_RUNTIME_DIR/hicached/hicached.sock, or /tmp/hicached-$UID/...),
                     else the systemd unit's ipc:///run/hicached/hicached.sock

The socket needs no admin key: whoever may connect to it is trusted like an operator already
(docs/operating.md, Access); a daemon with a ``client_token`` needs it (HICACHED_CLIENT_TOKEN, or the
config's). Human output by default, ``--json`` for scripts. Exit status: 0 done (status:
ready), 1 the daemon answered an error or could not be reached (the message says which), 2 bad
usage or config, 3 (status only) reachable but not ready. Long calls (flushing a large L3,
attaching a store, a detach writing back dirty pages) show progress on stderr. The HTTP path
uses only the standard library; the socket path the daemon's own protocol (zmq, msgspec).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, Self

from hicached.errors import ConfigError, HicachedError
from hicached.daemon.config import absolute_ipc, parse_options, read_config_table
from hicached.settings import UNIT_ENDPOINT, default_endpoint
from hicached.sockpath import refusal

DEFAULT_DAEMON_CONFIG = "/etc/hicached/hicached.toml"
UNIT_SOCKET = UNIT_ENDPOINT  # configs/hicached.service
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_READY = 0, 1, 2, 3


class AdminError(HicachedError):
    """The admin API answered an error, or could not be reached."""

    def __init__(self, message: str, status: int = 0, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class AdminClient:
    """Blocking calls to one daemon's admin API (urllib)."""

    def __init__(self, url: str, api_key: str = "", timeout_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url: expected http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self._key = api_key  # never printed
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: Any = None, query: dict | None = None,
                timeout_s: float | None = None, ok_statuses: tuple[int, ...] = (200,)) -> Any:
        """JSON (or text) answer of ``method path``; ``AdminError`` on other statuses."""
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._key:
            req.add_header("Authorization", f"Bearer {self._key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return _decode(resp.read())
        except urllib.error.HTTPError as e:
            payload = _decode(e.read())
            e.close()
            if e.code in ok_statuses:
                return payload
            raise AdminError(_explain(e.code, payload), e.code, payload) from None
        except TimeoutError:  # sent, but no answer in time: the daemon may still be at it
            raise AdminError(f"no answer from the hicached admin API at {self.url} within "
                             f"{timeout_s or self.timeout_s:g} s: the daemon may still be "
                             f"working on {method} {path} (see its log; raise --timeout)"
                             ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise AdminError(f"cannot reach the hicached admin API at {self.url}: {reason} "
                             "(is the daemon running, with admin_port set?)") from None


    # ------------------------------------------------------------ the commands
    # (``socketadmin.SocketAdmin`` has the same ones, answering the same shapes)

    @property
    def where(self) -> str:
        return self.url

    def close(self) -> None:
        pass

    def status(self) -> tuple[dict, dict, dict | None]:
        health = self.request("GET", "/health", ok_statuses=(200, 503))
        ready = self.request("GET", "/ready", ok_statuses=(200, 503))
        stats = self.request("GET", "/stats") if health.get("status") == "ok" else None
        return health, ready, stats

    def flush(self, tier: str, timeout_s: float, namespace: str = "") -> dict:
        query = {"tier": tier, **({"namespace": namespace} if namespace else {})}
        res = self.request("POST", "/flush_cache", query=query, timeout_s=timeout_s)
        if namespace and res.get("namespace") != namespace:  # a daemon older than the option
            raise AdminError(f"the daemon at {self.url} is older than --namespace: it ignored "
                             f"it and flushed {tier} of the whole node ({res.get('message')})")
        return res

    def attach(self, backend: str, options: dict, write_policy: str | None,
               prefetch_policy: str | None, timeout_s: float) -> dict:
        body = {"hicache_storage_backend": backend,
                "hicache_storage_backend_extra_config_json": json.dumps(options)}
        if write_policy:
            body["hicache_write_policy"] = write_policy
        if prefetch_policy:
            body["hicache_storage_prefetch_policy"] = prefetch_policy
        return self.request("PUT", "/hicache/storage-backend", body, timeout_s=timeout_s)

    def detach(self, timeout_s: float) -> dict:
        return self.request("DELETE", "/hicache/storage-backend", timeout_s=timeout_s)

    def l3_pages_left(self) -> str:
        pages = self.request("GET", "/stats", timeout_s=5)["tiers"]["l3"]["backend_stats"].get(
            "pages")
        return f"{_count(pages, 'page')} in L3" if pages is not None else ""


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _explain(status: int, payload: Any) -> str:
    message = payload.get("error", payload) if isinstance(payload, dict) else payload
    if status == 401:
        return ("unauthorized (HTTP 401): wrong or missing admin API key; pass --admin-api-key, "
                "set HICACHED_ADMIN_API_KEY, or admin_api_key in the daemon's config")
    return f"{message} (HTTP {status})"


class Progress:
    """While a long call runs, show how long it has taken (and ``probe()``'s detail, e.g. the
    L3 pages left) on ``stream``: a line rewritten in place on a terminal, else one line every
    ``line_every_s``. Silent when the call ends within ``delay_s``."""

    def __init__(self, what: str, probe=None, stream=None, delay_s: float = 1.0,
                 line_every_s: float = 5.0):
        self.what, self.probe = what, probe
        self.stream = stream or sys.stderr
        self.delay_s = delay_s
        self.tty = self.stream.isatty() if hasattr(self.stream, "isatty") else False
        self.every_s = 0.5 if self.tty else line_every_s
        self._done = threading.Event()
        self._shown = False
        self._thread = threading.Thread(target=self._run, name="hicached-progress", daemon=True)

    def __enter__(self) -> Self:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        if self._shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _run(self) -> None:
        if self._done.wait(self.delay_s):
            return
        while True:
            detail = ""
            if self.probe is not None:
                try:
                    detail = self.probe() or ""
                except Exception:  # noqa: BLE001 - progress is best effort
                    detail = ""
            line = f"{self.what}: {time.monotonic() - self._start:.0f} s" + (
                f", {detail}" if detail else "")
            self.stream.write(("\r" + line) if self.tty else line + "\n")
            self.stream.flush()
            self._shown = True
            if self._done.wait(self.every_s):
                return


# ---------------------------------------------------------------- formatting


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_status(url: str, health: dict, ready: dict, stats: dict | None) -> str:
    state = "ready" if ready.get("ready") else "NOT READY (" + ", ".join(
        ready.get("reasons") or [ready.get("reason", "unknown")]) + ")"
    lines = [f"hicached at {url}: {health.get('status', '?')}, {state}"]
    if not stats:
        return "\n".join(lines)
    from hicached.ops.status import adoption_line

    l2, l3 = stats["tiers"]["l2"], stats["tiers"]["l3"]
    cap = l2["capacity_bytes"] or 1
    lines.append(f"  start   {adoption_line(stats.get('adoption'))}")
    lines.append(f"  L2      {_count(l2['pages'], 'page')}, {human_bytes(l2['used_bytes'])} "
                 f"used of {human_bytes(cap)} ({100 * l2['used_bytes'] / cap:.1f}%), "
                 f"{_count(l2['free_slabs'], 'free slab')}")
    counted = stats.get("counted", True)  # False: a daemon without admin_port counts no hits
    lines.append("          " + (f"hits {l2['hits']}, misses {l2['misses']}, " if counted else "")
                 + f"evictions {l2['evictions']}, no space {l2['no_space']}"
                 + ("" if counted else " (hits and misses are counted with admin_port set)"))
    flush = l2.get("flush")
    if flush:
        lines.append(f"          flushing: slab {flush['slab']} of {flush['slabs']}, "
                     f"{_count(flush['dropped'], 'page')} dropped in {flush['seconds']:.1f} s")
    table = l2.get("presence_table")
    if table and table["full"]:
        lines.append(f"          presence table full ({table['slots']} slots): engines ask the "
                     "daemon for every exists (raise presence_slots)")
    if l3["attached"]:
        stored = l3.get("backend_stats", {}).get("pages")
        lines.append(
            f"  L3      {l3['backend']}: {l3['write_policy']}, prefetch "
            f"{'on' if l3['prefetch'] else 'off'}"
            + (f"; {_count(stored, 'page')} stored" if stored is not None else "")
            + (" [DEGRADED: failing, answered as misses]" if l3["degraded"] else ""))
        waiting = (l2.get("parked_gets", 0) + l2.get("parked_exists", 0)
                   + l2.get("parked_store_waits", 0))
        if l3.get("dirty_pages"):  # write_back: only in L2 until evicted, flushed or detached
            lines.append(f"          {_count(l3['dirty_pages'], 'dirty page')} (in L2 only, "
                         "not yet written to L3)")
        lines.append("          " + (f"hits {l3['hits']}, " if counted else "")
                     + f"loads {l3.get('l3_loads', 0)}, writes "
                     f"{l3.get('l3_writes', 0)} (failed {l3.get('l3_write_failures', 0)}, "
                     f"dropped {l3.get('l3_writes_dropped', 0)}), load failures "
                     f"{l3.get('l3_load_failures', 0)}, errors {l3.get('l3_errors', 0)}"
                     + (f"; {_count(waiting, 'request')} waiting for it" if waiting else ""))
    else:
        lines.append("  L3      none attached")
    for pool, p in stats["pools"].items():
        lines.append(f"  pool    {pool}: {_count(p['l2_pages'], 'page')} "
                     f"({human_bytes(p['l2_bytes'])})"
                     + (f", hits L2 {p['l2_hits']} / L3 {p['l3_hits']}, misses "
                        f"{p['l2_misses']}" if counted else ""))
    lines.append(f"  clients {_count(stats['sessions'], 'session')}, "
                 f"{_count(l2['leases'], 'lease')}, {_count(l2['reservations'], 'reservation')}, "
                 f"{human_bytes(l2.get('set_ahead_bytes', 0))} in set-ahead slots; "
                 f"{_count(stats['requests'], 'request')}")
    for n in stats["namespaces"]:
        quota = (f" of a {human_bytes(n['quota_bytes'])} quota (own evictions "
                 f"{n['evictions']}, rejections {n['rejections']})"
                 if n.get("quota_bytes") is not None else "")
        lines.append(f"  ns      {n['namespace']}: {human_bytes(n['used_bytes'])}{quota}, "
                     f"{_count(n.get('sessions', 0), 'session')}")
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 page", "0 pages", "2 free slabs"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# ---------------------------------------------------------------- commands


FINDING = __doc__[__doc__.index("How the daemon is found"):__doc__.index("The socket needs")].rstrip()


def add_parsers(sub) -> None:
    """Add the admin subcommands to ``hicached``'s subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="admin API address, e.g. http://127.0.0.1:8470 "
                        "(default: admin_host/admin_port of --daemon-config when set)")
    common.add_argument("--endpoint", help="the daemon's control socket, e.g. ipc:///path "
                        "(default: on this machine, the endpoint `hicached serve` uses)")
    common.add_argument("--admin-api-key", dest="admin_api_key",
                        help="Bearer key (default: HICACHED_ADMIN_API_KEY, then the config)")
    common.add_argument("--daemon-config", dest="daemon_config",
                        help=f"the daemon's TOML config (default {DEFAULT_DAEMON_CONFIG} "
                        "when readable)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--timeout", type=float, default=30.0,
                        help="seconds per request (default: 30)")
    how = {"epilog": FINDING, "formatter_class": argparse.RawDescriptionHelpFormatter}
    sub.add_parser("status", parents=[common], help="health, readiness and counters", **how)
    p = sub.add_parser("flush", parents=[common], help="drop cached pages", **how)
    p.add_argument("--tier", choices=["l2", "l3", "all"], default="l2",
                   help="which pages: l2 (the shared-memory arena), l3 (the attached backend's "
                   "store) or all (default: l2)")
    p.add_argument("--namespace", default="", help="only the pages of this namespace (as "
                   "engines name it; `hicached status` lists them); default: every page of "
                   "the node")
    p = sub.add_parser("attach", parents=[common], help="attach an L3 backend at runtime",
                       **how)
    p.add_argument("backend", help="backend name: file, mooncake, hf3fs, ...")
    p.add_argument("--l3-options", dest="l3_options",
                   help="backend options as a JSON object or @file.json, as serve's "
                   "--l3-options (default: the backend's defaults)")
    p.add_argument("--config", dest="backend_config", help=argparse.SUPPRESS)  # the old name
    p.add_argument("--write-policy", dest="write_policy",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when pages go to the new L3: at commit, after write_through_threshold "
                   "hits, or when L2 evicts them (default: the daemon's write_policy)")
    p.add_argument("--prefetch-policy", dest="prefetch_policy",
                   choices=["best_effort", "wait_complete", "timeout"],
                   help="SGLang's prefetch policy, recorded by the admin HTTP API for SGLang's "
                   "tools (--url only; the daemon does not use it)")
    sub.add_parser("detach", parents=[common], help="detach the L3 backend", **how)


def admin_settings(path: str | None, env) -> dict:
    """What the CLI needs of the daemon's config: admin_host / admin_port / admin_api_key,
    endpoint and client_token, from the TOML file, then its ``HICACHED_*`` environment
    overrides (the daemon's precedence). Only these keys are read, so this stays fast (no
    torch) and works with a config this node's daemon rejects."""
    values = {"admin_host": "127.0.0.1", "admin_port": 0, "admin_api_key": "", "endpoint": "",
              "client_token": ""}
    if path:
        data = read_config_table(path)
        values.update({k: data[k] for k in values if k in data})
    values.update({k: env[f"HICACHED_{k.upper()}"] for k in values
                   if f"HICACHED_{k.upper()}" in env})
    try:
        values["admin_port"] = int(values["admin_port"])
    except (TypeError, ValueError):
        raise ConfigError(f"admin_port: expected a port, got {values['admin_port']!r}") from None
    return values


def local_endpoint(configured: str, env: Mapping[str, str]) -> str:
    """The control socket of this machine's daemon: ``configured`` (the config's endpoint), else
    the default endpoint of ``hicached serve`` for this user, else the systemd unit's socket
    when only that one exists."""
    if configured:
        return configured
    mine = default_endpoint(env)
    unit = UNIT_SOCKET[len("ipc://"):]
    if refusal(mine[len("ipc://"):]) is not None and os.path.exists(unit) and \
            refusal(unit) is None:  # (a dead daemon's leftover socket file is nobody)
        return UNIT_SOCKET
    return mine


def connect(args: argparse.Namespace, env: Mapping[str, str]):
    """The admin API (``AdminClient``) or the control socket (``SocketAdmin``) of the daemon the
    arguments name (see the module docstring for the order)."""
    if not args.timeout > 0:  # 0 made the socket non-blocking, < 0 a traceback, NaN both
        raise ConfigError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    if args.url and args.endpoint:
        raise ConfigError("--url and --endpoint: give one (the admin API, or the socket)")
    path = args.daemon_config
    if path is None and os.access(DEFAULT_DAEMON_CONFIG, os.R_OK):
        path = DEFAULT_DAEMON_CONFIG
    cfg = admin_settings(path, env)
    if args.endpoint or not (args.url or cfg["admin_port"]):
        endpoint = absolute_ipc(args.endpoint or local_endpoint(cfg["endpoint"], env))
        if not endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"--endpoint: expected ipc://PATH or tcp://HOST:PORT, got "
                              f"{endpoint!r}")
        from hicached.ops.socketadmin import SocketAdmin

        return SocketAdmin(endpoint, env.get("HICACHED_CLIENT_TOKEN") or cfg["client_token"],
                           args.timeout)
    url = args.url
    if not url:
        host = cfg["admin_host"]
        url = f"http://[{host}]:{cfg['admin_port']}" if ":" in host else \
            f"http://{host}:{cfg['admin_port']}"
    key = args.admin_api_key or cfg["admin_api_key"]
    return AdminClient(url, key, args.timeout)


def attach_options(args: argparse.Namespace) -> dict:
    """The backend options of ``attach`` from ``--l3-options`` (or ``--config``, its old name,
    still read); ConfigError naming the flag for bad JSON or both flags given."""
    if args.l3_options is not None and args.backend_config is not None:
        raise ConfigError("--l3-options and --config: give one (--config is the old name of "
                          "--l3-options)")
    if args.backend_config is not None:
        return parse_options(args.backend_config or "{}", "--config")
    return parse_options(args.l3_options or "{}", "--l3-options")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """Run one admin subcommand (``env``: the process environment, read by the entry point);
    returns the exit status."""
    client = None
    try:
        if args.command == "attach":  # bad usage is said before looking for a daemon
            args.options = attach_options(args)
        client = connect(args, env)
        return _command(client, args, sys.stdout)
    except ConfigError as e:
        print(f"hicached: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except AdminError as e:
        print(f"hicached {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if client is not None:
            client.close()


def _command(client, args: argparse.Namespace, out) -> int:
    """``args.command`` through ``client`` (the HTTP API or the socket); prints its answer."""
    if args.command == "status":
        health, ready, stats = client.status()
        if args.json:
            where = "url" if isinstance(client, AdminClient) else "endpoint"
            print(json.dumps({where: client.where, "health": health, "ready": ready,
                              "stats": stats}, indent=2), file=out)
        else:
            print(format_status(client.where, health, ready, stats), file=out)
        return EXIT_OK if ready.get("ready") else EXIT_NOT_READY
    if args.command == "flush":
        probe = client.l3_pages_left if args.tier != "l2" else None
        with Progress(f"flushing {args.tier}", probe):
            res = client.flush(args.tier, max(args.timeout, 3600.0),
                               getattr(args, "namespace", "") or "")
    elif args.command == "attach":
        with Progress(f"attaching {args.backend}"):
            res = client.attach(args.backend, args.options, args.write_policy,
                                args.prefetch_policy, max(args.timeout, 600.0))
    elif args.command == "detach":  # write_back: dirty pages first (drain_timeout_s)
        with Progress("detaching"):
            res = client.detach(max(args.timeout, 600.0))
    else:
        raise AssertionError(args.command)
    if args.json:
        print(json.dumps(res, indent=2), file=out)
    elif args.command == "attach":
        prefetch = res.get("hicache_storage_prefetch_policy")
        print(f"{res['message']} backend {res['backend']}, write policy {res['write_policy']}"
              + (f", prefetch policy {prefetch}" if prefetch else ""), file=out)
    else:
        print(res["message"], file=out)
    return EXIT_OK
