"""hicached: a per-node tiered KV-cache storage daemon for LLM inference engines.

  hicached serve                     run the daemon in the foreground (serve --help: options)
  hicached status | flush | attach | detach
                                     talk to the running daemon: on this machine with no
                                     flags (over its control socket, at the endpoint serve
                                     uses by default, or --endpoint), remotely with --url
                                     (its admin HTTP API; admin_port set)
  hicached arena list | free         the arenas stopped daemons kept in shared memory (a crash,
                                     on_stop = "keep"): shown, or freed with no daemon running
  hicached demo                      the reference engine's multi-turn demo

python -m hicached works the same."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

# Only these before main() takes SIGINT: until then a Ctrl-C is Python's (a traceback), so the
# rest is imported where it is used (hicached and its errors are imported already)
from hicached import __version__
from hicached.errors import HicachedError
from hicached.ops import interrupts
from hicached.ops.phases import Phases

if TYPE_CHECKING:
    import argparse


def _serve_parser(sub, env: Mapping[str, str]) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground",
                       description="Run the daemon in the foreground (Ctrl-C or SIGTERM stops "
                       "it). Precedence: flags > HICACHED_* environment > --config file > "
                       "defaults; every key is documented in configs/hicached.toml.")
    p.add_argument("--config", help="TOML config file (see configs/hicached.toml)")
    p.add_argument("--endpoint", help="ipc:///path or tcp://host:port to listen on")
    p.add_argument("--l2-size", dest="l2_size", help="shared-memory arena size, e.g. 4GiB")
    p.add_argument("--state-dir", dest="state_dir", help="directory for the lock and the file L3")
    p.add_argument("--slab-size", dest="slab_size", help="arena slab size, e.g. 64MiB")
    p.add_argument("--l3-backend", dest="l3_backend",
                   help="L3 tier: file, none, mooncake, hf3fs or package.module:Class")
    p.add_argument("--l3-dir", dest="l3_dir", help="directory of the file L3")
    p.add_argument("--l3-options", dest="l3_options",
                   help="backend options as a JSON object or @file.json")
    p.add_argument("--write-policy", dest="write_policy",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when pages go to L3: at commit, after N hits, or when L2 evicts them")
    p.add_argument("--write-through-threshold", dest="write_through_threshold", type=int,
                   help="write_through_selective: hits before a page is written to L3")
    p.add_argument("--arena-path", dest="arena_path", help="shared-memory file of the arena")
    p.add_argument("--reservation-ttl-s", dest="reservation_ttl_s", type=float,
                   help="seconds a client may take between reserving slots and committing")
    p.add_argument("--lease-ttl-s", dest="lease_ttl_s", type=float,
                   help="seconds a client may hold pages it is reading")
    p.add_argument("--l3-load-chunk", dest="l3_load_chunk",
                   help="bytes one L3 load job moves at most, e.g. 64MiB")
    p.add_argument("--get-wait-s", dest="get_wait_s", type=float,
                   help="longest a get (exists) waits for L3 loads (lookups) of its keys")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_const", const=False,
                   help="do not pull L3-only pages into L2 after an exists")
    p.add_argument("--set-ahead-bytes", dest="set_ahead_bytes",
                   help="set-ahead slots one client may hold, e.g. 128MiB (0: none)")
    p.add_argument("--busy-poll-ms", dest="busy_poll_ms", type=float,
                   help="spin this long after a request before sleeping in poll (0: never)")
    p.add_argument("--no-shared-exists", dest="shared_exists", action="store_const", const=False,
                   help="publish no presence table: every exists (and every get, as with "
                   "--no-shared-gets) goes through the socket")
    p.add_argument("--no-shared-gets", dest="shared_gets", action="store_const", const=False,
                   help="publish no slot tags: every get leases its pages through the socket")
    p.add_argument("--presence-slots", dest="presence_slots", type=int,
                   help="slots of the shared presence table, a power of 2 (0: from l2_size)")
    p.add_argument("--log-level", dest="log_level",
                   help="debug, info, warning, error or critical")
    p.add_argument("--io-queue-depth", dest="io_queue_depth", type=int,
                   help="L3 jobs queued at most (past it: write-throughs skipped, loads and "
                   "lookups miss)")
    p.add_argument("--socket-mode", dest="socket_mode",
                   help="permission mode of the ipc socket and the arena, e.g. 0600")
    p.add_argument("--admin-host", dest="admin_host", help="admin HTTP API address")
    p.add_argument("--admin-port", dest="admin_port", type=int,
                   help="admin HTTP API port (0: no admin API)")
    p.add_argument("--admin-api-key", dest="admin_api_key",
                   help="Bearer key of the mutating admin endpoints (visible in ps: prefer "
                   "HICACHED_ADMIN_API_KEY or the config file)")
    p.add_argument("--status-sample-s", dest="status_sample_s", type=float,
                   help="the admin API's status page (GET /) samples the stats this often "
                   "and keeps the last 300 samples")
    p.add_argument("--l3-audit-s", dest="l3_audit_s", type=float,
                   help="every this many seconds ask L3 whether it still holds the pages L2 "
                   "evicts next, and write again those it evicted (0: never)")
    p.add_argument("--unchecked-idle-s", dest="unchecked_idle_s", type=float,
                   help="end the session of a client whose process cannot be checked after "
                   "this long without a request")
    p.add_argument("--drain-timeout-s", dest="drain_timeout_s", type=float,
                   help="SIGTERM: longest wait for work in flight")
    p.add_argument("--socket-group", dest="socket_group",
                   help="group of the socket and arena (mode 0660)")
    p.add_argument("--client-token", dest="client_token",
                   help="clients must present this token (prefer HICACHED_CLIENT_TOKEN)")
    p.add_argument("--allow-tcp", dest="allow_tcp", action="store_const", const=True,
                   help="accept a tcp:// endpoint (needs a client token)")
    p.add_argument("--namespace-quotas", dest="namespace_quotas",
                   help='per-namespace L2 quotas as JSON, e.g. \'{"tenant-a": "8GiB"}\'')
    p.add_argument("--eviction", dest="eviction",
                   help="which L2 pages go first: hybrid (chains leaf first, states and tokens "
                   "per byte weighed), prefix (chains leaf first, LRU), lru, demote (hybrid, "
                   "and new pages of classes seldom read again first) or package.module:Class")
    p.add_argument("--eviction-alpha", dest="eviction_alpha", type=float,
                   help="hybrid eviction: weight of a page's value against its recency")
    p.add_argument("--evict-ahead", dest="evict_ahead", type=float,
                   help="share of the arena each size class that had to evict keeps free, "
                   "evicting ahead while the daemon is idle (0: off)")
    p.add_argument("--kv-events-endpoint", dest="kv_events_endpoint",
                   help="publish KV events for routers on this ZeroMQ PUB endpoint, e.g. "
                   "tcp://*:5557; docs/kv-events.md")
    p.add_argument("--kv-events-replay-endpoint", dest="kv_events_replay_endpoint",
                   help="serve recent KV event batches to routers that missed some (ROUTER)")
    p.add_argument("--on-stop", dest="on_stop", choices=["free", "keep"],
                   help="what a clean exit does with the arena: free it, or keep it (and its "
                   "journal) for the next daemon to adopt (a crash always leaves it)")
    p.add_argument("--cold", dest="cold", action="store_const", const=True,
                   help="discard an arena a previous daemon kept instead of adopting it")
    p.add_argument("--print-config", action="store_true", help="print the effective config as "
                   "TOML (--config reads it back; secrets left out)")
    _help_with_defaults(p, env)


OPTION_KEYS = ("endpoint", "l2_size", "state_dir", "slab_size", "l3_backend", "l3_dir",
               "l3_options", "write_policy", "write_through_threshold", "arena_path",
               "reservation_ttl_s", "lease_ttl_s", "l3_load_chunk", "get_wait_s", "prefetch",
               "set_ahead_bytes", "busy_poll_ms", "shared_exists", "shared_gets", "presence_slots",
               "log_level", "admin_host", "admin_port", "admin_api_key", "drain_timeout_s",
               "socket_group", "client_token", "allow_tcp", "namespace_quotas",
               "io_queue_depth", "socket_mode", "unchecked_idle_s", "l3_audit_s",
               "eviction", "eviction_alpha", "evict_ahead", "status_sample_s", "kv_events_endpoint",
               "kv_events_replay_endpoint", "on_stop", "cold")


_SIZES = ("l2_size", "slab_size", "l3_load_chunk", "set_ahead_bytes")
_SECRETS = ("admin_api_key", "client_token")


def _show_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def serve_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The default of every ``serve`` option as ``--help`` shows it (paths as resolved here)."""
    import dataclasses

    from hicached.daemon.config import DaemonConfig
    from hicached.settings import default_endpoint, default_state_dir

    out = {}
    for f in dataclasses.fields(DaemonConfig):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name in _SIZES:
            value = _show_size(value)
        elif isinstance(value, bool):
            value = str(value).lower()
        elif f.name == "socket_mode":
            value = f"{value:04o}"
        elif f.name in _SECRETS or value == {} or value == "":
            value = "none"
        out[f.name] = str(value)
    state = default_state_dir(env)
    out.update(kv_events_endpoint="off")  # (not "none": no events are published)
    out.update(endpoint=default_endpoint(env), state_dir=state,
               l3_dir="<state_dir>/l3", arena_path="/dev/shm/hicached-<digest of state_dir>")
    return out


def _help_with_defaults(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    import argparse

    defaults = serve_defaults(env)
    for action in parser._actions:
        if action.dest in defaults and action.help:
            if isinstance(action, argparse._StoreConstAction):
                action.help += f" (default: {action.dest} = {defaults[action.dest]})"
            else:
                action.help += f" (default: {defaults[action.dest]})"


def main(argv: list[str] | None = None) -> int:
    """``hicached``: one line on stderr, never a traceback, for Ctrl-C (at any moment; the
    process then ends by SIGINT: ``interrupts.py``) and for a reader that leaves (``hicached
    status | head``). As the process's entry point (``argv`` None) it keeps its SIGINT handler
    to the end, so a Ctrl-C while Python exits is the one line too; called with ``argv`` it
    puts back the handler it found when it returns."""
    interrupts.install()
    try:
        env = os.environ  # the one read of the environment: everything below gets it passed
        phases = Phases.from_env(env)
        phases.reach("start")
        status = _main(argv, env, phases)
        sys.stdout.flush()  # here, so a closed pipe is seen now and not at exit
        if interrupts.pressed():  # Ctrl-C stopped it in order (serve: "hicached stopped")
            interrupts.end(line=False)
        return status
    except HicachedError as e:  # (a HICACHED_TEST_PAUSE_AT that names no phase)
        print(f"hicached: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        interrupts.end()
    except BrokenPipeError:
        # the reader of our output is gone: point stdout at /dev/null, so the flush at exit
        # does not fail again, and end as a process killed by SIGPIPE would be seen by a shell
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception:
        if interrupts.pressed():  # an import cut short by Ctrl-C fails later in other words
            interrupts.end()
        raise
    finally:
        if argv is not None:
            interrupts.uninstall()


def _main(argv: list[str] | None, env: Mapping[str, str], phases: Phases) -> int:
    import argparse

    from hicached.ops import adminctl

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the reference engine's demo parses its own flags
        from hicached.engine.demo import main as demo_main

        interrupts.switch(interrupts.RAISE)  # an engine: its cleanup is in finally blocks
        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="hicached", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hicached {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub, env)
    adminctl.add_parsers(sub)
    from hicached.ops import arenas

    arenas.add_parser(sub)
    sub.add_parser("demo", help="multi-turn demo of the reference engine through hicached "
                                "(hicached demo --help)")
    args = parser.parse_args(argv)
    if args.command == "arena":
        return arenas.run(args, env)
    if args.command != "serve":
        return adminctl.run(args, env)
    try:
        if args.command == "serve":
            import logging

            from hicached.daemon.config import load_config

            overrides = {k: getattr(args, k) for k in OPTION_KEYS}
            cfg = load_config(args.config, env, overrides)
            if args.print_config:
                print(cfg.to_toml(), end="")
                return 0
            logging.basicConfig(level=cfg.log_level.upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            # Mooncake's C++ client logs every connection step at INFO: warnings and errors
            # only, unless the log level is debug or MC_LOG_LEVEL says otherwise
            os.environ.setdefault("MC_LOG_LEVEL", "INFO" if cfg.log_level == "debug" else
                                  "WARNING")
            phases.reach("config")
            from hicached.ops.sdnotify import SystemdNotifier
            from hicached.ops.serve import serve

            phases.reach("imported")
            if env.get("HICACHED_BENCH_NO_CHECKSUMS") == "1":  # tools/bench_l3.py only
                from hicached.backends.integrity import disable_for_benchmark

                disable_for_benchmark()

            serve(cfg, SystemdNotifier.from_env(env),
                  reload=lambda: load_config(args.config, env, overrides), phases=phases)
            return 0
    except HicachedError as e:
        print(f"hicached: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
