"""``hicached arena list | free``: the arenas a stopped daemon left in shared memory for the next
one (a crash, a stop with ``on_stop = "keep"``), shown and freed with no daemon running.

A kept arena is up to three files, all named after the arena's path::

    <arena_path>            the page bytes (l2_size)          made by arena.py
    <arena_path>.presence   the presence table engines read   made by presence.py
    <arena_path>.meta       what adoption reads back          made by the daemon (warm restart)

Which arenas belong to a state dir: the one its config names (``arena_path``, by default
``/dev/shm/hicached-<digest of state_dir>``) and the one its lock file ``hicached.lock`` records
(the last daemon's, which may differ when the config changed since). ``free`` removes only files
hicached made: the recorded path, or a name that starts with ``hicached-`` (the rule ``arena.py``
replaces files by), never a symlink or anything but a plain file; and only with no daemon running:
it holds the state dir's lock while it frees (a daemon starting then refuses, as it would beside
another daemon), and a file whose own lock a process holds (a daemon of another state dir given
the same path) is refused too.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from hicached.errors import ConfigError, HicachedError

SUFFIXES = ("", ".presence", ".meta")  # the files of one arena, after its path
LOCK_FILE = "hicached.lock"  # in the state dir (``daemon/files.py``)
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2  # as the other subcommands (``adminctl.py``)


class ArenaInUse(HicachedError):
    """A daemon runs on the state dir, or holds the arena's files: nothing was freed."""


@dataclass(frozen=True)
class KeptArena:
    """One arena's files as found (``kept_arenas``)."""

    path: str  # the arena file's path (its siblings: + SUFFIXES)
    files: tuple[tuple[str, int], ...]  # (path, bytes of memory it holds) of those that exist
    recorded: bool  # the state dir's lock file records this path
    daemon_running: bool  # a daemon holds the state dir's lock
    made_by_hicached: bool  # ``free`` may remove it (recorded, or named hicached-*)

    @property
    def held_bytes(self) -> int:
        """Shared memory its files hold (allocated tmpfs pages, not their apparent size)."""
        return sum(n for _, n in self.files)

    @property
    def has_meta(self) -> bool:
        """Whether its ``.meta`` file is there (a daemon can adopt it only then)."""
        return any(p == self.path + ".meta" for p, _ in self.files)


def recorded_arena(state_dir: str) -> str:
    """The arena path the state dir's last daemon recorded in its lock file ("" when none)."""
    try:
        with open(os.path.join(state_dir, LOCK_FILE), "rb") as f:
            first = f.read(4096).decode(errors="replace").splitlines()
    except OSError:
        return ""
    return first[0].strip() if first else ""


def state_lock(state_dir: str, *, shared: bool) -> int | None:
    """The state dir's lock taken (an fd to close; None when there is no lock file, so no daemon
    ever ran there); ``ArenaInUse`` when a daemon holds it. ``shared``: only to look (a daemon
    starting meanwhile would refuse for that moment)."""
    try:
        fd = os.open(os.path.join(state_dir, LOCK_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"state_dir: cannot read {state_dir}/{LOCK_FILE}: {e}") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ArenaInUse(f"a hicached daemon is running on state dir {state_dir} (it holds "
                         f"{LOCK_FILE}); it frees or keeps its arena when it stops "
                         "(on_stop): stop it first") from None
    return fd


def _held_bytes(path: str) -> int | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_blocks * 512


def _made_by_hicached(path: str, recorded: str) -> bool:
    """The rule by which ``arena.py`` replaces a file: recorded by the state dir, or named
    hicached-*; a plain file, never a symlink."""
    if not (path == recorded or os.path.basename(path).startswith("hicached-")):
        return False
    return all(not os.path.islink(p) and (not os.path.lexists(p) or os.path.isfile(p))
               for p in (path + s for s in SUFFIXES))


def kept_arenas(state_dir: str, arena_path: str) -> list[KeptArena]:
    """The arenas of ``state_dir`` (its configured ``arena_path`` and its recorded one) whose
    files exist, with whether a daemon runs there. Takes the state lock shared for a moment."""
    try:
        fd = state_lock(state_dir, shared=True)
        running = False
    except ArenaInUse:
        fd, running = None, True
    try:
        return _found(state_dir, arena_path, running)
    finally:
        if fd is not None:
            os.close(fd)


def _found(state_dir: str, arena_path: str, running: bool) -> list[KeptArena]:
    recorded = recorded_arena(state_dir)
    found = []
    for path in dict.fromkeys(p for p in (arena_path, recorded) if p):
        files = tuple((p, n) for p in (path + s for s in SUFFIXES)
                      if (n := _held_bytes(p)) is not None)
        if files:
            found.append(KeptArena(path, files, path == recorded, running,
                                   _made_by_hicached(path, recorded)))
    return found


def free_arenas(state_dir: str, arena_path: str) -> list[KeptArena]:
    """Remove the files of the state dir's kept arenas (see the module docstring for which);
    returns what was freed. ``ArenaInUse``: a daemon runs there, or holds an arena's file;
    ``ConfigError``: a file there that hicached did not make (nothing removed)."""
    fd = state_lock(state_dir, shared=False)
    try:
        arenas = _found(state_dir, arena_path, False)
        for arena in arenas:
            if not arena.made_by_hicached:
                raise ConfigError(
                    f"arena_path: {arena.path} was not made by this state dir's daemon (it is "
                    "not recorded in its lock file, nor named hicached-*): remove it by hand if "
                    "it is a stale arena")
        for arena in arenas:
            for path, _ in arena.files:
                _check_unlocked(path)
        for arena in arenas:
            for path, _ in arena.files:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if fd is not None and arenas:
            with open(os.path.join(state_dir, LOCK_FILE), "r+b") as f:
                f.truncate(0)  # no record: a file made at that path later is nobody's arena
        return arenas
    finally:
        if fd is not None:
            os.close(fd)


def _check_unlocked(path: str) -> None:
    """``ArenaInUse`` when a process holds ``path``'s lock (a running daemon maps it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ArenaInUse(f"{path} is in use by a running hicached daemon (it holds the file's "
                         "lock): stop that daemon first") from None
    finally:
        os.close(fd)


def gib(n: int) -> str:
    """``n`` bytes in GiB, two decimals."""
    return f"{n / (1 << 30):.2f}"


def describe(arena: KeptArena) -> str:
    """One line: the path, GiB held, and which of its files exist."""
    names = [{"": "arena", ".presence": "presence", ".meta": "meta"}[p[len(arena.path):]]
             for p, _ in arena.files]
    return f"{arena.path} ({gib(arena.held_bytes)} GiB: {', '.join(names)})"


# ------------------------------------------------------------ the subcommand


def add_parser(sub) -> None:
    """Add ``hicached arena`` to ``hicached``'s subparsers."""
    p = sub.add_parser("arena", help="list or free the arenas stopped daemons kept in shared "
                       "memory", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)
    for verb, what in (("list", "show the state dir's kept arenas"),
                       ("free", "free them (no daemon may run on the state dir)")):
        v = verbs.add_parser(verb, help=what, description=what)
        where = v.add_mutually_exclusive_group()
        where.add_argument("--state-dir", dest="state_dir",
                           help="the daemon's state dir (default: as `hicached serve` resolves "
                           "it: HICACHED_STATE_DIR, else the XDG state dir)")
        where.add_argument("--config", help="the daemon's TOML config (its state_dir and "
                           "arena_path)")
        if verb == "free":
            v.add_argument("--after-stop", dest="after_stop", metavar="UNIT",
                           help="run as the systemd unit UNIT's ExecStopPost=: free only when "
                           "no start follows (docs/operating.md)")


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str]:
    """(state_dir, arena_path) as ``hicached serve`` with these flags would use them."""
    from hicached.daemon.config import load_config

    overrides = {"state_dir": args.state_dir} if args.state_dir else {}
    cfg = load_config(args.config, env, overrides)
    return cfg.state_dir, cfg.arena_path


def run(args: argparse.Namespace, env: Mapping[str, str], out=None) -> int:
    """``hicached arena VERB``; returns the exit status."""
    out = out or sys.stdout
    try:
        state_dir, arena_path = resolve(args, env)
        if args.verb == "list":
            arenas = kept_arenas(state_dir, arena_path)
            if not arenas:
                print(f"no kept arena for state dir {state_dir}", file=out)
            for a in arenas:
                print(f"{describe(a)}; daemon {'running' if a.daemon_running else 'stopped'}"
                      + ("" if a.has_meta else "; no meta file: a daemon starts cold beside it")
                      + ("" if a.made_by_hicached else
                         "; not made by this state dir's daemon (free leaves it)"), file=out)
            return EXIT_OK
        why = ""
        if getattr(args, "after_stop", None):
            from hicached.ops.unitstop import after_stop

            keep, why = after_stop(args.after_stop, env)
            if keep:
                kept = kept_arenas(state_dir, arena_path)
                for a in kept:
                    print(f"kept {describe(a)}: {why}; `hicached arena free` frees it",
                          file=out)
                if not kept:
                    print(f"no arena kept for state dir {state_dir} ({why})", file=out)
                return EXIT_OK
        freed = free_arenas(state_dir, arena_path)
        for a in freed:
            print(f"freed {describe(a)}" + (f": {why}" if why else ""), file=out)
        if not freed:
            print(f"nothing to free for state dir {state_dir}", file=out)
        return EXIT_OK
    except ConfigError as e:
        print(f"hicached: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except HicachedError as e:
        print(f"hicached arena {args.verb}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
