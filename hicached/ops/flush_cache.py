"""``python -m hicached.flush_cache --url URL``: flush the daemon's cache as SGLang users type it
(``python -m sglang.srt.mem_cache.flush_cache --url ...``).

Sends ``POST /flush_cache`` (``--tier l2`` by default: the host tier, as SGLang's flush leaves
L3 alone) with the admin key from ``--admin-api-key``, ``HICACHED_ADMIN_API_KEY`` or the
daemon's config, prints the daemon's answer and exits non-zero if it did not succeed.
"""

from __future__ import annotations

import argparse
import os
import sys

from hicached.ops import adminctl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicached.flush_cache",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="admin API address, e.g. http://127.0.0.1:8470")
    parser.add_argument("--endpoint", help="the daemon's control socket instead (default, with "
                        "no --url nor admin_port: on this machine, where `hicached serve` "
                        "listens by default)")
    parser.add_argument("--tier", choices=["l2", "l3", "all"], default="l2")
    parser.add_argument("--admin-api-key", dest="admin_api_key")
    parser.add_argument("--daemon-config", dest="daemon_config")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    args.command, args.json = "flush", False
    return adminctl.run(args, os.environ)  # this entry point is the edge that reads it


if __name__ == "__main__":
    sys.exit(main())
