"""Ctrl-C at every phase of ``hicached serve``'s start (``ops/interrupts.py``, ``ops/phases.py``):
the start pauses at a named phase and says so (``HICACHED_TEST_PAUSE_AT``), the test sends SIGINT
exactly there, and the process writes one line and ends by SIGINT, leaving nothing behind. Then
after ready, and a shell script around it. Real processes throughout."""

import os
import shlex
import signal
import subprocess
import sys

import pytest

from hicached.ops import interrupts
from hicached.ops.cli import main
from hicached.ops.phases import NAMED

pytestmark = pytest.mark.timeout(180)

# phases where the handler ends the process at once (nothing made yet)
AT_ONCE = ["start", "config", "imported"]
# torch's import, where a raised KeyboardInterrupt once aborted the process with C++ on the stack
# (torch.cuda is imported from torch's _C._initExtension, _c10d_init is torch.distributed's C++
# init): the daemon's start no longer imports torch at all (the arena is mapped with numpy), so
# no Ctrl-C can land there; a pause asked for there is never reached before ready
TORCH = ["import:torch", "import:torch.cuda", "inside:_c10d_init"]
# phases where the start has made things: it records the signal and undoes them
UNDONE = ["lock", "arena", "l3", "socket", "admin"]


class Start:
    """``hicached serve`` (a small arena, the file L3, everything in ``tmp``) paused at
    ``phase``: ``self.before`` is its stderr up to the pause."""

    def __init__(self, tmp, phase: str | None, shell_tail: str | None = None):
        self.tmp = tmp
        self.arena = f"/dev/shm/hicached-test-int-{os.getpid()}-{tmp.name}"
        self.sock = f"{tmp}/s.sock"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
        if phase:
            env["HICACHED_TEST_PAUSE_AT"] = phase
        cmd = [sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB", "--slab-size",
               "1MiB", "--endpoint", f"ipc://{self.sock}", "--state-dir", f"{tmp}/state",
               "--arena-path", self.arena]
        if shell_tail is not None:  # a script: the command, then the next one
            cmd = ["bash", "-c", shlex.join(cmd) + shell_tail]
        self.proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.before = ""
        if phase:
            marker = f"hicached: test pause at {phase}\n"
            while not self.before.endswith(marker):
                line = self.proc.stderr.readline()
                assert line, f"ended before {phase}: {self.before}"
                self.before += line
        else:
            line = self.proc.stdout.readline()
            assert "listening on" in line, line

    def signal(self, sig: int, group: bool = False) -> tuple[str, str]:
        """Send ``sig`` (to the whole process group, as a terminal's Ctrl-C, when ``group``);
        (stdout, stderr after the pause) once it ended."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        return self.proc.communicate(timeout=90)

    def left_behind(self) -> list[str]:
        return [p for p in (self.arena, self.arena + ".presence", self.sock)
                if os.path.exists(p)]


@pytest.mark.parametrize("phase", AT_ONCE + UNDONE)
def test_ctrl_c_at_each_phase_of_the_start_is_one_line_and_ends_by_sigint(tmp_path, phase):
    s = Start(tmp_path, phase)
    out, err = s.signal(signal.SIGINT)
    assert s.proc.returncode == -signal.SIGINT, (s.before, err)
    assert err == "\nhicached: interrupted\n" and out == ""  # no traceback, no abort
    assert s.left_behind() == []


@pytest.mark.parametrize("phase", TORCH)
def test_the_start_never_reaches_torchs_native_import(tmp_path, phase):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    env["HICACHED_TEST_PAUSE_AT"] = phase
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB", "--slab-size", "1MiB",
         "--endpoint", f"ipc://{tmp_path}/s.sock", "--state-dir", f"{tmp_path}/state",
         "--arena-path", f"/dev/shm/hicached-test-int-{os.getpid()}-{tmp_path.name}"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        line = proc.stdout.readline()  # ready, with no pause on the way
        assert "listening on" in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert f"test pause at {phase}" not in err and "Traceback" not in err


def test_the_phases_tested_are_every_named_one():
    assert sorted(p for p in AT_ONCE + UNDONE if ":" not in p) == sorted(NAMED)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, -signal.SIGINT),
                                              (signal.SIGTERM, 0)])
def test_after_ready_the_daemon_stops_in_order(tmp_path, sig, status):
    """Ctrl-C after ready stops the daemon as SIGTERM does ("hicached stopped"), and then the
    process ends by SIGINT, with no more words."""
    s = Start(tmp_path, None)
    out, err = s.signal(sig)
    assert s.proc.returncode == status, err
    assert out.endswith("hicached stopped\n")
    assert "Traceback" not in err and "interrupted" not in err
    assert s.left_behind() == []


@pytest.mark.parametrize("phase", ["imported", "arena", None])
def test_a_script_running_serve_stops_at_ctrl_c(tmp_path, phase):
    """A terminal's Ctrl-C goes to the whole group: bash running ``hicached serve; echo`` stops
    the script only because hicached ended by SIGINT (an exit with 130 would let it go on)."""
    s = Start(tmp_path, phase, shell_tail="; echo went on")
    out, err = s.signal(signal.SIGINT, group=True)
    assert s.proc.returncode == -signal.SIGINT, (out, err)
    assert "went on" not in out and "Traceback" not in err
    assert s.left_behind() == []


def test_a_pause_at_no_phase_is_refused_by_name(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    env["HICACHED_TEST_PAUSE_AT"] = "arnea"
    r = subprocess.run([sys.executable, "-m", "hicached", "serve", "--print-config"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("hicached: error: HICACHED_TEST_PAUSE_AT='arnea': not a phase")


def test_main_called_as_a_function_puts_back_the_sigint_handler():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert signal.getsignal(signal.SIGINT) is before


def test_interrupt_modes_are_checked_by_name():
    with pytest.raises(ValueError, match="'end', 'record', 'raise', got 'later'"):
        interrupts.switch("later")
