"""``hicached serve``: the daemon as a service (systemd unit: ``configs/hicached.service``).

    0. RLIMIT_NOFILE       soft limit raised to the hard one (``raise_open_files_limit``)
    1. Daemon(config)      the arena is mapped (pre-faulted) and the L3 backend opened
    2. admin API           listening, when ``admin_port`` is set (``admin.py``)
    3. READY=1             only now: units ordered after hicached start against a working daemon
    4. control loop        WATCHDOG=1 every half ``WATCHDOG_USEC`` (``Daemon._tick``); a stuck
                           loop stops feeding it and systemd restarts the daemon
    SIGHUP                 RELOADING=1, the config is resolved again (file, env and the same
                           flags) and its policy keys applied (``reload_policies``), READY=1
    SIGTERM / SIGINT       STOPPING=1, drain (``Daemon._drain_for_shutdown``: work in flight
                           finishes within ``drain_timeout_s``, new requests get ShuttingDown),
                           admin API closed, "hicached stopped"; then exit 0 (SIGTERM), or the
                           CLI ends the process by SIGINT (a SIGINT came: ``interrupts.py``)

Signal handlers only set a flag or start a thread: they interrupt the control loop anywhere,
so they never touch daemon state themselves. A SIGINT during steps 0-2 is recorded and acted on
at the start's next phase (``phases.py``): the start undoes what it made and the exception goes
on to the CLI, which says so in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import signal
import threading
from collections.abc import Callable

from hicached.daemon.config import DaemonConfig
from hicached.daemon.notifier import NullNotifier
from hicached.daemon.server import Daemon
from hicached.errors import HicachedError
from hicached.ops import interrupts
from hicached.ops.phases import Phases

log = logging.getLogger(__name__)

RELOADABLE = ("write_policy", "write_through_threshold", "prefetch", "get_wait_s", "log_level",
              "namespace_quotas", "set_ahead_bytes", "eviction_alpha", "evict_ahead")  # applied by SIGHUP; others need a restart


def reload_policies(daemon: Daemon, new: DaemonConfig) -> dict[str, object]:
    """Apply the ``RELOADABLE`` keys of ``new`` on the daemon's control loop (thread-safe).
    Returns the keys that changed; other changed keys are logged as needing a restart."""
    old = daemon.config
    changed = {k: getattr(new, k) for k in RELOADABLE if getattr(new, k) != getattr(old, k)}
    ignored = [f.name for f in dataclasses.fields(DaemonConfig)
               if f.name not in RELOADABLE and getattr(new, f.name) != getattr(old, f.name)]

    def apply() -> None:
        daemon.tier.set_policies(new.write_policy, new.write_through_threshold, new.prefetch)
        daemon.controller.reload(new.get_wait_s, new.namespace_quotas, new.set_ahead_bytes)
        logging.getLogger().setLevel(new.log_level.upper())
        daemon.reload(new, RELOADABLE)  # the eviction's, and the daemon's config

    daemon.call(apply)
    log.info("reloaded: %s", ", ".join(f"{k}={v!r}" for k, v in changed.items())
             or "nothing changed")
    if ignored:
        log.warning("reload: %s changed; restart hicached to apply", ", ".join(ignored))
    return changed


def _reload(daemon: Daemon, notifier: NullNotifier,
            load: Callable[[], DaemonConfig]) -> None:
    notifier.reloading()
    try:
        reload_policies(daemon, load())
    except HicachedError as e:
        log.error("reload failed; the running config stays: %s", e)
    except Exception:
        log.exception("reload failed; the running config stays")
    finally:
        notifier.ready(status="serving")


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit and return (old, new) soft
    limits. The soft limit is often 1,024 (systemd's default), low for a daemon holding every
    client's sockets and, with 3FS, segment files (the backend keeps half the limit open at
    most); the hard limit is what the operator allows (``LimitNOFILE``). A failure leaves the
    limit as it was (logged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if hard == resource.RLIM_INFINITY:  # the kernel caps fds at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                want = int(f.read())
        except (OSError, ValueError):
            want = 1 << 20
    if soft != resource.RLIM_INFINITY and soft >= want:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError) as e:
        log.warning("cannot raise the open files limit from %d to %d: %s", soft, want, e)
        return soft, soft
    log.info("open files limit raised from %d to %d", soft, want)
    return soft, want


def serve(config: DaemonConfig, notifier: NullNotifier | None = None,
          reload: Callable[[], DaemonConfig] | None = None,
          ready: Callable[[Daemon], None] | None = None, phases: Phases | None = None) -> None:
    """Run a daemon in the foreground until SIGTERM / SIGINT (see the module docstring).
    ``reload`` resolves the config again for SIGHUP (None: SIGHUP only logs). ``phases``: where
    the start acts on a Ctrl-C (and a test's pause); KeyboardInterrupt when one came before the
    daemon was ready, after everything made was undone."""
    notifier = notifier or NullNotifier()
    phases = phases or Phases()
    raise_open_files_limit()  # before the L3 backend sizes its fd table from it
    admin_api = None
    if config.admin_port:  # (aiohttp's import is half a daemon's start: only when it is used)
        from hicached.ops import admin as admin_api

        admin_api.check_admin_port(config.admin_host, config.admin_port)  # before arena and L3
    interrupts.switch(interrupts.RECORD)  # from here the start makes things it must undo
    daemon = Daemon(config, on_phase=phases.reach, notifier=notifier, crash_at=phases.crash_at)
    admin = None
    reloads: list[threading.Thread] = []
    try:  # (a Ctrl-C before the handlers below are in place still closes the daemon)
        admin = admin_api.start_admin(daemon) if admin_api is not None else None
        phases.reach("admin")

        def on_hup(*_) -> None:
            if reload is None:
                log.warning("SIGHUP: no config to reload")
                return
            t = threading.Thread(target=_reload, args=(daemon, notifier, reload),
                                 name="hicached-reload", daemon=True)
            reloads.append(t)
            t.start()

        def on_int(*_) -> None:
            interrupts.record()  # the CLI ends the process by SIGINT once the daemon stopped
            daemon.stop_on_signal()

        signal.signal(signal.SIGTERM, lambda *_: daemon.stop_on_signal())
        signal.signal(signal.SIGINT, on_int)
        signal.signal(signal.SIGHUP, on_hup)
        interrupts.check()  # one recorded before on_int took over
    except BaseException:
        if admin is not None:
            admin.close()
        daemon.close()
        raise
    where = daemon.operations.describe() + (f"; admin API {admin.url}" if admin else "")
    print(where, flush=True)
    notifier.ready(status="serving")
    if ready is not None:
        ready(daemon)
    try:
        daemon.serve_forever()
    finally:
        if admin is not None:
            admin.close()
        for t in reloads:
            t.join(5.0)
        notifier.close()
    print("hicached stopped", flush=True)
