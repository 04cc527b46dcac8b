"""What a stop of the systemd unit does with the arena (``hicached/ops/unitstop.py``).

systemd cannot run here: the decision is tested as the function it is, fed the environment
systemd gives an ``ExecStopPost=`` command in each case (systemd.exec(5): ``SERVICE_RESULT``,
``EXIT_CODE``, ``EXIT_STATUS``) and the type of the unit's job (systemctl(1) ``show``); the unit
that wires it is checked by ``systemd-analyze verify`` in test_service.py."""

import os
import shutil
import subprocess
import sys

import pytest

from hicached.errors import ConfigError
from hicached.ops.unitstop import after_stop, decide, unit_job_type

KILLED = {"SERVICE_RESULT": "signal", "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}
CLEAN = {"SERVICE_RESULT": "success", "EXIT_CODE": "exited", "EXIT_STATUS": "0"}


@pytest.mark.parametrize("case, env, job, keep", [
    ("systemctl restart", CLEAN, "restart", True),
    ("package upgrade: try-restart shows as restart", CLEAN, "restart", True),
    ("reload-or-restart of a daemon that has no reload", CLEAN, "reload-or-restart", True),
    ("systemctl stop", CLEAN, "stop", False),
    ("systemctl stop that timed out and was killed", {"SERVICE_RESULT": "timeout",
     "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}, "stop", False),
    ("exited 0 on its own (kill -TERM by hand)", CLEAN, "", False),
    ("SIGKILL / a crash", KILLED, "", True),
    ("segfault", {"SERVICE_RESULT": "core-dump", "EXIT_CODE": "dumped",
                  "EXIT_STATUS": "SEGV"}, "", True),
    ("watchdog", {"SERVICE_RESULT": "watchdog", "EXIT_CODE": "killed",
                  "EXIT_STATUS": "ABRT"}, "", True),
    ("exit status 1", {"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited",
                       "EXIT_STATUS": "1"}, "", True),
    ("oom killer", {"SERVICE_RESULT": "oom-kill", "EXIT_CODE": "killed",
                    "EXIT_STATUS": "KILL"}, "", True),
    ("systemctl could not be asked", CLEAN, None, True),
])
def test_each_way_of_stopping(case, env, job, keep):
    kept, why = decide(env, job)
    assert kept is keep, (case, why)
    assert f"SERVICE_RESULT={env['SERVICE_RESULT']}, EXIT_CODE={env['EXIT_CODE']}" in why


def test_the_reasons_say_what_follows():
    assert decide(CLEAN, "restart") == (
        True, "restarting (SERVICE_RESULT=success, EXIT_CODE=exited, EXIT_STATUS=0, job "
        "restart): the new daemon adopts it")
    assert decide(CLEAN, "stop") == (
        False, "stopped with no start after it (SERVICE_RESULT=success, EXIT_CODE=exited, "
        "EXIT_STATUS=0, job stop)")
    assert decide(KILLED, "") == (
        True, "failed (SERVICE_RESULT=signal, EXIT_CODE=killed, EXIT_STATUS=KILL): "
        "Restart=on-failure starts it again, warm")


def test_without_systemds_environment_it_refuses():
    with pytest.raises(ConfigError, match="SERVICE_RESULT is not set: --after-stop runs as the "
                       "unit's ExecStopPost="):
        decide({}, "stop")


def test_the_job_is_read_as_systemctl_prints_it():
    """``systemctl show --property=Job --value UNIT`` prints the job's id (nothing without a
    job); ``systemctl show --property=JobType --value ID`` its type."""
    answers = {("show", "--property=Job", "--value", "hicached.service"): "4711\n",
               ("show", "--property=JobType", "--value", "4711"): "restart\n"}
    assert unit_job_type("hicached.service", lambda argv: answers[tuple(argv)]) == "restart"
    assert unit_job_type("hicached.service", lambda argv: "\n") == ""


def test_systemctl_missing_keeps_the_arena_and_says_why():
    def missing(argv):  # a real failure: no such program
        return subprocess.run(["/nonexistent/systemctl", *argv], capture_output=True,
                              text=True, check=True).stdout

    keep, why = after_stop("hicached.service", CLEAN, missing)
    assert keep and why.endswith("whether a start follows could not be asked (systemctl: "
                                 "[Errno 2] No such file or directory: '/nonexistent/systemctl')")


@pytest.mark.skipif(shutil.which("systemctl") is None or os.path.isdir("/run/systemd/system"),
                    reason="needs systemctl on a host where systemd is not running")
def test_the_cli_after_stop_on_a_host_without_systemd(tmp_path):
    """``arena free --after-stop`` where systemctl cannot answer (no systemd running): the
    arena is kept, and the line says where, how much and why."""
    state = tmp_path / "s"
    state.mkdir()
    arena = f"/dev/shm/hicached-test-after-{os.getpid()}-{tmp_path.name}"
    (state / "hicached.lock").write_bytes(arena.encode() + b"\n")
    with open(arena, "wb") as f:
        f.write(b"\1" * 65536)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hicached", "arena", "free", "--state-dir", str(state),
             "--after-stop", "hicached.service"], capture_output=True, text=True, timeout=60,
            env={**os.environ, **CLEAN, "HICACHED_ARENA_PATH": arena})
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"kept {arena} (0.00 GiB: arena): stopped (SERVICE_RESULT="
                                     "success, EXIT_CODE=exited, EXIT_STATUS=0); whether a start "
                                     "follows could not be asked (systemctl: "), out.stdout
        assert out.stdout.endswith("; `hicached arena free` frees it\n")
        assert os.path.exists(arena)
        out = subprocess.run(
            [sys.executable, "-m", "hicached", "arena", "free", "--state-dir", str(state),
             "--after-stop", "hicached.service"], capture_output=True, text=True, timeout=60,
            env={**os.environ, **KILLED, "HICACHED_ARENA_PATH": arena})
        assert "kept" in out.stdout and "(SERVICE_RESULT=signal, EXIT_CODE=killed" in out.stdout
        assert os.path.exists(arena)
    finally:
        if os.path.exists(arena):
            os.unlink(arena)
