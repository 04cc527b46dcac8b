"""``hicached`` command line: ``hicached serve`` runs the daemon in the foreground;
``hicached status | flush | attach | detach`` talk to a running daemon's admin API."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hicached.ops import adminctl
from hicached.ops.config import load_config
from hicached.errors import HicachedError


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    p.add_argument("--config", help="TOML config file (see configs/hicached.toml)")
    p.add_argument("--endpoint", help="ipc:///path or tcp://host:port to listen on")
    p.add_argument("--l2-size", dest="l2_size", help="shared-memory arena size, e.g. 4GiB")
    p.add_argument("--state-dir", dest="state_dir", help="directory for the lock and the file L3")
    p.add_argument("--slab-size", dest="slab_size", help="arena slab size, e.g. 64MiB")
    p.add_argument("--l3-backend", dest="l3_backend",
                   help="L3 tier: file (default), none, mooncake, hf3fs")
    p.add_argument("--l3-dir", dest="l3_dir", help="directory of the file L3")
    p.add_argument("--l3-options", dest="l3_options",
                   help="backend options as a JSON object or @file.json")
    p.add_argument("--write-policy", dest="write_policy",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--write-through-threshold", dest="write_through_threshold", type=int,
                   help="write_through_selective: hits before a page is written to L3")
    p.add_argument("--arena-path", dest="arena_path", help="shared-memory file of the arena")
    p.add_argument("--reservation-ttl-s", dest="reservation_ttl_s", type=float)
    p.add_argument("--lease-ttl-s", dest="lease_ttl_s", type=float)
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
                   help="debug, info (default), warning, error or critical")
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
    p.add_argument("--print-config", action="store_true", help="print the effective config as TOML (--config reads it back; secrets left out)")


OPTION_KEYS = ("endpoint", "l2_size", "state_dir", "slab_size", "l3_backend", "l3_dir",
               "l3_options", "write_policy", "write_through_threshold", "arena_path",
               "reservation_ttl_s", "lease_ttl_s", "l3_load_chunk", "get_wait_s", "prefetch",
               "set_ahead_bytes", "busy_poll_ms", "shared_exists", "shared_gets", "presence_slots",
               "log_level", "admin_host", "admin_port", "admin_api_key", "drain_timeout_s",
               "socket_group", "client_token", "allow_tcp", "namespace_quotas",
               "io_queue_depth", "socket_mode", "unchecked_idle_s", "l3_audit_s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the reference engine's demo parses its own flags
        from hicached.engine.demo import main as demo_main

        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="hicached", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    adminctl.add_parsers(sub)
    sub.add_parser("demo", help="multi-turn demo of the reference engine through hicached "
                                "(hicached demo --help)")
    args = parser.parse_args(argv)
    env = os.environ  # the one read of the environment: everything below gets it passed
    if args.command != "serve":
        return adminctl.run(args, env)
    try:
        if args.command == "serve":
            overrides = {k: getattr(args, k) for k in OPTION_KEYS}
            cfg = load_config(args.config, env, overrides)
            if args.print_config:
                print(cfg.to_toml(), end="")
                return 0
            logging.basicConfig(level=cfg.log_level.upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            from hicached.ops.sdnotify import SystemdNotifier
            from hicached.ops.serve import serve

            serve(cfg, SystemdNotifier.from_env(env),
                  reload=lambda: load_config(args.config, env, overrides))
            return 0
    except HicachedError as e:
        print(f"hicached: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
