"""What a stop of the systemd unit does with the arena: kept when a start follows (the next daemon
adopts it), freed when none does, so that no memory is held without the operator knowing.

The unit (``configs/hicached.service``) runs ``hicached serve`` with ``on_stop = "keep"`` (a
clean exit leaves the arena's files) and, once the daemon is gone, whatever the way it went::

    ExecStopPost=-/usr/local/bin/hicached arena free --after-stop %n ...

which decides from what systemd gives it (systemd.exec(5), "Environment Variables in Spawned
Processes"; systemctl(1) ``show`` of a unit's job)::

    SERVICE_RESULT   how the service ended: success, exit-code, signal, core-dump, watchdog,
                     timeout, oom-kill, protocol, ... (ExecStop= and ExecStopPost= only)
    EXIT_CODE        exited, killed or dumped;  EXIT_STATUS: the status, or the signal's name
    the unit's job   ``systemctl show -P Job UNIT``, then that job's ``JobType``: while a
                     ``systemctl restart`` (also try-restart, reload-or-restart: a package
                     upgrade's restart) stops the unit its job is of type restart; a
                     ``systemctl stop`` (or a shutdown) is of type stop; an exit on its own has
                     no job

    job        SERVICE_RESULT   arena   why
    restart    any              kept    the restart's start follows: the new daemon adopts it
    stop       any              freed   a stop with no start after it (a stop job also
                                        disables Restart=, even after a failure)
    none       success          freed   exited cleanly on its own: Restart=on-failure will not
                                        start it again
    none       anything else    kept    a crash, a kill, the watchdog: Restart=on-failure
                                        starts it again (if the start limit stops that, the
                                        log line said where the arena is)
    unknown    (systemctl failed)  kept the safe side for the pages; the line says so

The unit's ``RuntimeDirectory`` is wiped at a restart: nothing of this needs it (the arena and
its files are in /dev/shm, the record in the state dir). The file-descriptor store
(``FileDescriptorStoreMax=``) tells a restart from a stop too (systemd keeps a service's stored
fds while a job is queued for it, and closes them once it is fully stopped), but closing the fd of
a file that has a name in /dev/shm frees nothing, and engines map the arena by its name: so the
stop asks for the job instead.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping

from hicached.errors import ConfigError

Runner = Callable[[list[str]], str]  # argv -> stdout; raises OSError / CalledProcessError


def decide(env: Mapping[str, str], job_type: str | None) -> tuple[bool, str]:
    """(keep, why) for a stop that systemd describes with ``env`` (its ExecStopPost=
    environment) while the unit's job is ``job_type`` ("" for none, None when it could not be
    asked: see the module docstring's table). ``ConfigError`` without ``SERVICE_RESULT``."""
    result = env.get("SERVICE_RESULT")
    if not result:
        raise ConfigError("--after-stop: SERVICE_RESULT is not set: --after-stop runs as the "
                          "unit's ExecStopPost= (systemd sets it); run `hicached arena free` "
                          "without --after-stop to free the arena now")
    how = f"SERVICE_RESULT={result}" + "".join(
        f", {k}={env[k]}" for k in ("EXIT_CODE", "EXIT_STATUS") if env.get(k))
    if job_type is None:
        return True, f"stopped ({how}); whether a start follows could not be asked"
    if job_type.endswith("restart"):
        return True, f"restarting ({how}, job {job_type}): the new daemon adopts it"
    if job_type == "stop":
        return False, f"stopped with no start after it ({how}, job stop)"
    if job_type:  # (a start or reload job while stopping: treated as a restart)
        return True, f"stopped ({how}) with a {job_type} job queued: the next daemon adopts it"
    if result == "success":
        return False, f"exited on its own ({how}): Restart=on-failure does not start it again"
    return True, f"failed ({how}): Restart=on-failure starts it again, warm"


def systemctl(argv: list[str]) -> str:
    """Run ``systemctl argv``; its stdout (raises ``OSError``, ``CalledProcessError``,
    ``TimeoutExpired``)."""
    return subprocess.run(["systemctl", *argv], capture_output=True, text=True, check=True,
                          timeout=10).stdout


def unit_job_type(unit: str, run: Runner = systemctl) -> str:
    """The type of the job the unit has now ("" for none): ``restart``, ``stop``, ...; raises
    when systemctl cannot be asked."""
    job = run(["show", "--property=Job", "--value", unit]).strip()
    if not job or job == "0":
        return ""
    try:
        return run(["show", "--property=JobType", "--value", job]).strip()
    except subprocess.CalledProcessError:
        return ""  # the job ended between the two questions: no job now


def after_stop(unit: str, env: Mapping[str, str], run: Runner = systemctl) -> tuple[bool, str]:
    """``decide`` for ``unit``, its job asked of systemd; systemctl failing keeps the arena, and
    the reason says why."""
    try:
        job: str | None = unit_job_type(unit, run)
        asked = ""
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", "") or str(e)
        job, asked = None, f" (systemctl: {err.strip().splitlines()[0] if err.strip() else e})"
    keep, why = decide(env, job)
    return keep, why + asked
