"""Which client processes the daemon calls dead (liveness.py): by the kernel's word on who is on
the socket and when that process started, never by a pid the client merely states."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import raw_socket, wait_until
from test_daemon import HOLD_RESERVATION

from hicached import liveness as L
from hicached import protocol as P


def test_start_ticks_of_this_process_and_of_none():
    mine = L.start_ticks(os.getpid())
    assert isinstance(mine, int) and mine > 0
    assert L.own_start_ticks() == mine
    assert L.start_ticks(os.getpid()) == mine  # stable
    assert L.start_ticks(2**22 + 12345) is None  # above pid_max's default: no such process


def test_start_ticks_reads_past_a_command_name_with_spaces_and_parens(tmp_path):
    script = tmp_path / "we ird) (name"
    shutil.copy(sys.executable, script)
    p = subprocess.Popen([str(script), "-c", "import time; time.sleep(30)"])
    try:
        ticks = L.start_ticks(p.pid)
        with open(f"/proc/{p.pid}/stat", "rb") as f:
            assert b"we ird) (" in f.read()  # the kernel keeps the name's first 15 bytes
        assert isinstance(ticks, int) and ticks >= L.own_start_ticks()
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("address, pid", [
    ("localhost:0:0:6294", 6294),
    ("somehost:1000:1000:17", 17),
    ("localhost:0:0:0", 0),  # peer outside the daemon's pid namespace
    ("127.0.0.1", 0),  # tcp
    ("::1", 0),
    ("fe80::1:2:3", 0),
    ("", 0),
    (None, 0),
    ("localhost:0:0:x1", 0),
])
def test_peer_pid_parses_libzmq_ipc_credentials_only(address, pid):
    assert L.peer_pid(address) == pid


def test_identify_prefers_the_kernel_then_a_checkable_claim():
    me, ns, start = os.getpid(), L.own_pid_ns(), L.own_start_ticks()
    assert ns > 0
    # the socket's credentials win over whatever the Hello states
    assert L.identify(me, 1, 0, 0, ns) == L.ProcessRef(me, start, "peer")
    # no credentials (tcp): the stated pid, only in the same pid namespace and same process
    assert L.identify(0, me, start, ns, ns) == L.ProcessRef(me, start, "claimed")
    assert L.identify(0, me, start, ns + 1, ns).how == "none"  # another pid namespace
    assert L.identify(0, me, start + 1, ns, ns).how == "none"  # another process with that pid
    assert L.identify(0, me, 0, ns, ns).how == "none"  # an old client states no start time
    gone = L.identify(2**22 + 12345, 7, 0, 0, ns)
    assert gone.how == "peer" and not L.alive(gone)


def test_alive_follows_the_process_and_sees_a_reused_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ref = L.identify(p.pid, 0, 0, 0, L.own_pid_ns())
    assert ref.how == "peer" and L.alive(ref)
    p.kill()
    p.wait()
    assert not L.alive(ref)
    # the same pid, but a process that started at another time: not the client
    me = L.identify(os.getpid(), 0, 0, 0, 0)
    assert L.alive(me)
    assert not L.alive(me._replace(start=me.start + 1))
    assert L.alive(L.ProcessRef(2**22 + 12345, 0, "none"))  # can't tell: never called dead


def _hello(sock, pid, start=0, pid_ns=0, req_id=1):
    sock.send(P.encode(P.Hello(req_id, P.PROTOCOL_VERSION, "model-a", pid, "raw", "",
                               start, pid_ns)))
    ans = P.answer_decoder.decode(sock.recv())
    assert isinstance(ans, P.Welcome), ans
    return ans.session


def test_a_stated_pid_that_is_not_the_client_never_drops_its_session(daemon):
    """An engine in a container states the pid it sees (1, or one that names another process or
    none on the daemon's side): its live session must stay."""
    with raw_socket(daemon.endpoint) as s:
        sessions = [_hello(s, pid, req_id=i) for i, pid in enumerate((2**22 + 12345, 1), 1)]
        with daemon.client() as c:
            time.sleep(1.5)  # three sweeps
            assert c.stats()["sessions"] == 3
        for i, sid in enumerate(sessions, 10):
            s.send(P.encode(P.RegisterPool(i, sid, "kv", 4096)))
            assert isinstance(P.answer_decoder.decode(s.recv()), P.Registered)


def _child_pid(pid: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = f.read().split()
        except OSError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no child")


def _unshare_works() -> bool:
    try:
        out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                              "echo $$"], check=False, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "1"


@pytest.mark.skipif(not _unshare_works(), reason="no unshare --pid here (needs CAP_SYS_ADMIN)")
def test_client_in_its_own_pid_namespace_is_kept_alive_and_reaped_once_killed(daemon):
    """The client is pid 1 of its own pid namespace, as in a container: while it runs, its
    reservation stays; SIGKILL it and the daemon lets the reservation go at the next sweep (a
    daemon that believed the stated pid would keep it until the TTL: pid 1 is always alive)."""
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                          sys.executable, "-c", HOLD_RESERVATION, daemon.endpoint],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        client = _child_pid(p.pid)
        with daemon.client() as c:
            assert c.stats()["reservations"] == 1
            time.sleep(1.5)  # three sweeps: alive, kept
            st = c.stats()
            assert st["reservations"] == 1 and st["sessions"] == 2
            os.kill(client, signal.SIGKILL)
            assert wait_until(lambda: c.stats()["reservations"] == 0, 5)
            assert c.stats()["sessions"] == 1
            assert c.stats()["expired_reservations"] == 0  # reaped, not timed out
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()
    assert f"pid {client} in this daemon's pid namespace" in daemon.output()


def test_a_new_handshake_of_a_live_client_ends_its_old_session(daemon):
    """A client that handshakes again (a fresh socket after a timeout, a token daemon that did
    not know the socket) names the session it held: the daemon ends it at once instead of
    keeping it until the process exits; leases of the old one run to their TTL."""
    from pools import kv_pool, pages
    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=2), "kv")
        assert c.batch_set_v1(["k0"], pages(0, 1)) == [True]
        c._conn.call(lambda s, r: P.Lease(r, s, [P.PoolKeys("kv", ["k0"])]))
        old = c.session
        with c._conn.lock:
            c._conn.handshake()
        assert c.session != old
        st = c.stats()
        assert st["sessions"] == 1 and st["leases"] == 1  # a thread may still be reading
        assert c.batch_get_v1(["k0"], pages(1, 1)) == [True]  # pools registered again
        with raw_socket(daemon.endpoint) as s:
            s.send(P.encode(P.Exists(5, old, ["k0"])))
            assert P.answer_decoder.decode(s.recv()).code == "unknown_session"
            # another namespace cannot end it
            s.send(P.encode(P.Hello(6, P.PROTOCOL_VERSION, "model-b", os.getpid(),
                                    replaces=c.session)))
            assert isinstance(P.answer_decoder.decode(s.recv()), P.Welcome)
            assert c.stats()["sessions"] == 2
    assert f"replaces session {old}" in daemon.output()


def test_unchecked_clients_sessions_end_when_idle_and_they_join_again(tmp_path):
    """Over tcp from another pid namespace the daemon cannot tell a dead client: such a session
    ends after ``unchecked_idle_s`` without a request (not while it sends them), and the client
    joins again at its next call. Clients it can check are never ended for being idle."""
    from admin_helpers import free_port
    from conftest import DaemonProc
    from pools import kv_pool, pages

    token = "t0ken"
    d = DaemonProc(tmp_path, name="tcp", token=token,
                   extra=["--allow-tcp", "--l3-backend", "none", "--unchecked-idle-s", "1.5"],
                   env={**os.environ, "HICACHED_CLIENT_TOKEN": token})
    d.endpoint = f"tcp://127.0.0.1:{free_port()}"
    d.args[d.args.index("--endpoint") + 1] = d.endpoint
    try:
        d.start()
        with raw_socket(d.endpoint) as raw:
            raw.send(P.encode(P.Hello(1, P.PROTOCOL_VERSION, "model-a", 7, "raw", token,
                                      0, L.own_pid_ns() + 1)))  # another pid namespace
            sid = P.answer_decoder.decode(raw.recv()).session
            with d.client() as c:  # same pid namespace: checked by its stated pid and start time
                src = kv_pool(seed=4)
                c.register_mem_host_pool_v2(src, "kv")
                end, req = time.monotonic() + 3, 10
                while time.monotonic() < end:  # requests keep the unchecked session
                    raw.send(P.encode(P.RegisterPool(req, sid, "kv", 1024)))
                    assert isinstance(P.answer_decoder.decode(raw.recv()), P.Registered)
                    req += 1
                    time.sleep(0.3)
                assert c.stats()["sessions"] == 2
                assert wait_until(lambda: c.stats()["sessions"] == 1, 5)  # idle: ended
                raw.send(P.encode(P.RegisterPool(req, sid, "kv", 1024)))
                ans = P.answer_decoder.decode(raw.recv())
                assert isinstance(ans, P.Error) and ans.code == "unknown_session"
                time.sleep(2.5)  # the checked client idled too, and stays
                assert c.batch_set_v1(["idle0"], pages(0, 1)) == [True]
                assert c.stats()["sessions"] == 1
    finally:
        d.cleanup()
