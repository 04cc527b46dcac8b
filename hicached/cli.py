"""``hicached`` command line: ``hicached serve`` runs the daemon in the foreground."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from hicached.config import load_config
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
    p.add_argument("--get-wait-s", dest="get_wait_s", type=float,
                   help="longest a get waits for L3 loads of its keys")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_const", const=False,
                   help="do not pull L3-only pages into L2 after an exists")
    p.add_argument("--busy-poll-ms", dest="busy_poll_ms", type=float,
                   help="spin this long after a request before sleeping in poll (0: never)")
    p.add_argument("--log-level", dest="log_level")
    p.add_argument("--print-config", action="store_true", help="print the effective config")


OPTION_KEYS = ("endpoint", "l2_size", "state_dir", "slab_size", "l3_backend", "l3_dir",
               "l3_options", "write_policy", "write_through_threshold", "arena_path",
               "reservation_ttl_s", "lease_ttl_s", "get_wait_s", "prefetch", "busy_poll_ms",
               "log_level")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the reference engine's demo parses its own flags
        from hicached.engine.demo import main as demo_main

        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="hicached", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("demo", help="multi-turn demo of the reference engine through hicached "
                                "(hicached demo --help)")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            cfg = load_config(args.config, os.environ,
                              {k: getattr(args, k) for k in OPTION_KEYS})
            if args.print_config:
                for key, value in dataclasses.asdict(cfg).items():
                    print(f"{key} = {value!r}")
                return 0
            logging.basicConfig(level=cfg.log_level.upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            from hicached.server import run

            run(cfg)
            return 0
    except HicachedError as e:
        print(f"hicached: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
