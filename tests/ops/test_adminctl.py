"""``hicached status | flush | attach | detach`` and ``python -m hicached.flush_cache`` in
subprocesses against a running daemon: human and --json output, exit codes and messages."""

import io
import json
import os
import re
import subprocess
import sys
import time

from admin_helpers import KEY, admin_daemon, free_port
from conftest import sigstop, wait_until
from pools import kv_pool, pages

from hicached import PoolTransfer
from hicached.ops.adminctl import Progress


def cli(*args, key=KEY, env_extra=None, module="hicached"):
    """Run the CLI; returns (exit status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    if key:
        env["HICACHED_ADMIN_API_KEY"] = key
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", module, *args], check=False, capture_output=True,
                       text=True, env=env, timeout=60)
    return p.returncode, p.stdout, p.stderr


def test_status_human_and_json(make_daemon):
    d, url = admin_daemon(make_daemon)
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        assert c.batch_set_v1(["a", "b", "c"], pages(0, 3)) == [True] * 3
        assert wait_until(lambda: c.stats()["l3_writes"] == 3)
        rc, out, err = cli("status", "--url", url)
        assert rc == 0, err
        assert out.startswith(f"hicached at {url}: ok, ready")
        assert "L2      3 pages, 3.0 KiB used of 16.0 MiB" in out
        assert "L3      file: write_through, prefetch on; 3 pages stored" in out
        assert "pool    kv: 3 pages (3.0 KiB)" in out
        assert "clients 1 session, 0 leases, 0 reservations" in out  # "1 session", not "1 sessions"
        assert "in set-ahead slots" in out
        assert "ns      model-a: 3.0 KiB, 1 session" in out  # every namespace, quota or not
        rc, out, err = cli("status", "--url", url, "--json", key="")  # status needs no key
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["health"] == {"status": "ok"} and doc["ready"]["ready"] is True
        assert doc["stats"]["tiers"]["l2"]["pages"] == 3
        assert doc["stats"]["tiers"]["l3"]["backend_stats"]["pages"] == 3
        assert doc["stats"]["tiers"]["l2"]["parked_exists"] == 0
        assert doc["stats"]["tiers"]["l2"]["flush"] is None  # no flush under way
        assert "requests waiting" not in cli("status", "--url", url)[1]  # none is waiting


def test_status_shows_requests_waiting_for_l3():
    from hicached.ops.adminctl import format_status

    tiers = {"l2": {"pages": 0, "used_bytes": 0, "capacity_bytes": 1 << 20, "free_slabs": 1,
                    "hits": 0, "misses": 0, "evictions": 0, "no_space": 0, "leases": 0,
                    "reservations": 0, "parked_gets": 2, "parked_exists": 1},
             "l3": {"attached": True, "backend": "file", "write_policy": "write_through",
                    "prefetch": True, "degraded": False, "hits": 0}}
    out = format_status("u", {"status": "ok"}, {"ready": True},
                        {"tiers": tiers, "pools": {}, "sessions": 1, "requests": 9,
                         "namespaces": []})
    assert "errors 0; 3 requests waiting for it" in out
    assert "flushing" not in out
    tiers["l2"]["flush"] = {"slab": 40, "slabs": 512, "dropped": 9000, "waiting": 1,
                            "seconds": 0.25}
    out = format_status("u", {"status": "ok"}, {"ready": True},
                        {"tiers": tiers, "pools": {}, "sessions": 1, "requests": 9,
                         "namespaces": []})
    assert "flushing: slab 40 of 512, 9000 pages dropped in 0.2 s" in out
    assert "presence table" not in out
    tiers["l2"]["presence_table"] = {"slots": 16384, "keys": 9830, "full": True, "sessions": 3}
    out = format_status("u", {"status": "ok"}, {"ready": True},
                        {"tiers": tiers, "pools": {}, "sessions": 1, "requests": 9,
                         "namespaces": []})
    assert "presence table full (16384 slots)" in out
    assert "dirty" not in out
    tiers["l3"].update(write_policy="write_back", dirty_pages=42)  # what a detach writes first
    out = format_status("u", {"status": "ok"}, {"ready": True},
                        {"tiers": tiers, "pools": {}, "sessions": 1, "requests": 9,
                         "namespaces": []})
    assert "42 dirty pages (in L2 only, not yet written to L3)" in out


def test_flush_attach_detach_commands(make_daemon, tmp_path):
    d, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    l3 = tmp_path / "cli-l3"
    opts = tmp_path / "opts.json"
    opts.write_text(json.dumps({"root": str(l3)}))
    rc, out, err = cli("attach", "file", "--l3-options", f"@{opts}", "--url", url,
                       "--write-policy", "write_through", "--prefetch-policy", "timeout")
    assert rc == 0, err
    assert out.strip() == ("HiCache storage backend attached. backend file, write policy "
                           "write_through, prefetch policy timeout")
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=2), "kv")
        assert c.batch_set_v1(["p0", "p1"], pages(0, 2)) == [True, True]
        assert wait_until(lambda: c.stats()["l3_writes"] == 2)
        rc, out, err = cli("flush", "--url", url)
        assert (rc, out.strip()) == (0, "Cache flushed: 2 pages dropped from L2."), err
        rc, out, err = cli("flush", "--tier", "l3", "--url", url, "--json")
        assert rc == 0 and json.loads(out)["pages"] == 2 and json.loads(out)["tier"] == "l3"
        assert c.batch_exists(["p0"]) == 0
    rc, out, err = cli("attach", "none", "--url", url)
    assert rc == 1 and "backend_conflict" not in err and "detach it" in err
    assert err.startswith("hicached attach: error:") and "(HTTP 409)" in err
    rc, out, err = cli("detach", "--url", url)
    assert (rc, out.strip()) == (0, "HiCache storage backend detached."), err
    rc, out, err = cli("detach", "--url", url, "--json")
    assert rc == 0 and json.loads(out)["hicache_storage_backend"] is None


def test_failures_exit_non_zero_with_a_clear_message(make_daemon, tmp_path):
    _d, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    rc, out, err = cli("flush", "--url", url, key="")
    assert rc == 1 and "unauthorized (HTTP 401)" in err and "HICACHED_ADMIN_API_KEY" in err
    rc, out, err = cli("flush", "--url", url, key="wrong")
    assert rc == 1 and "unauthorized" in err
    rc, out, err = cli("attach", "tape", "--url", url)
    assert rc == 1 and "unknown L3 backend 'tape'" in err and "(HTTP 400)" in err
    rc, out, err = cli("attach", "file", "--config", "{bad", "--url", url)
    assert rc == 2 and "--config: not valid JSON" in err
    dead = f"http://127.0.0.1:{free_port()}"
    rc, out, err = cli("status", "--url", dead)
    assert rc == 1 and f"cannot reach the hicached admin API at {dead}" in err
    assert out == ""  # failures say so on stderr only
    # no --url and no config with an admin_port: the socket where `hicached serve` listens by
    # default (none in this runtime dir)
    rc, _out, err = cli("status", env_extra={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert rc == 1 and f"no hicached daemon listens on ipc://{tmp_path}/hicached/" in err
    rc, _out, err = cli("flush", "--tier", "l9", "--url", url)
    assert rc == 2 and "invalid choice" in err  # argparse
    for timeout in ("0", "-1", "nan"):  # were a non-blocking socket's EINPROGRESS, a traceback
        rc, out, err = cli("status", "--url", url, "--timeout", timeout)
        assert (rc, out) == (2, "") and "--timeout: must be > 0 seconds" in err, err
        assert "Traceback" not in err


def test_address_and_key_from_the_daemon_config(make_daemon, tmp_path):
    _d, url = admin_daemon(make_daemon)
    port = url.rsplit(":", 1)[1]
    conf = tmp_path / "daemon.toml"
    conf.write_text(f'[hicached]\nadmin_port = {port}\nadmin_api_key = "{KEY}"\n')
    rc, out, err = cli("flush", "--daemon-config", str(conf), key="")
    assert rc == 0 and "Cache flushed" in out, err
    # the environment beats the file, the flag beats the environment
    rc, out, err = cli("flush", "--daemon-config", str(conf), key="wrong")
    assert rc == 1 and "unauthorized" in err
    rc, out, err = cli("flush", "--daemon-config", str(conf), "--admin-api-key", KEY,
                       key="wrong")
    assert rc == 0, err


def test_python_m_flush_cache(make_daemon):
    d, url = admin_daemon(make_daemon)
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=3), "kv")
        assert c.batch_set_v1(["q0"], pages(0, 1)) == [True]
        c.ping()  # the commit is fire-and-forget: land it before the HTTP flush
        rc, out, err = cli("--url", url, module="hicached.flush_cache")
        assert (rc, out.strip()) == (0, "Cache flushed: 1 page dropped from L2."), err
        assert c.stats()["l2_pages"] == 0
    rc, out, err = cli("--url", url, module="hicached.flush_cache", key="")
    assert rc == 1 and "unauthorized" in err
    # on the daemon's machine, its socket: no key
    rc, out, err = cli("--endpoint", d.endpoint, module="hicached.flush_cache", key="")
    assert (rc, out) == (0, "Cache flushed: L2.\n"), err


def test_flush_of_one_namespace_over_http_and_over_the_socket(make_daemon):
    d, url = admin_daemon(make_daemon)
    with d.client("model-a") as a, d.client("model-b") as b:
        for c in (a, b):
            c.register_mem_host_pool_v2(kv_pool(seed=4), "kv")
            assert c.batch_set_v1(["r0", "r1"], pages(0, 2)) == [True, True]
            c.wait_stored([PoolTransfer("kv", keys=["r0", "r1"])])
        rc, out, err = cli("flush", "--namespace", "model-a", "--url", url)
        assert (rc, out) == (0, "Cache flushed: 2 pages of namespace 'model-a' dropped from "
                                "L2.\n"), err
        assert a.stats()["l2_pages"] == 2  # B's
        rc, out, err = cli("flush", "--namespace", "model-b", "--tier", "all", "--endpoint",
                           d.endpoint, "--json", key="")
        assert rc == 0, err
        assert json.loads(out) == {"success": True, "tier": "all", "namespace": "model-b",
                                   "message": "Cache flushed: L2 and L3 of namespace "
                                              "'model-b'."}
        assert a.stats()["l2_pages"] == 0
        assert b.batch_exists(["r0", "r1"]) == 0  # gone from L3 too
        assert a.batch_exists(["r0", "r1"]) == 2  # A's L3 copies stay: loaded back


def test_progress_shows_elapsed_time_and_detail():
    stream = io.StringIO()
    probes = []

    def probe():
        probes.append(1)
        return f"{100 - 10 * len(probes)} pages in L3"

    with Progress("flushing l3", probe, stream=stream, delay_s=0.05, line_every_s=0.1):
        time.sleep(0.5)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2
    assert lines[0] == "flushing l3: 0 s, 90 pages in L3"
    assert all(line.startswith("flushing l3: ") for line in lines)
    quiet = io.StringIO()
    with Progress("fast", stream=quiet, delay_s=5.0):
        pass
    assert quiet.getvalue() == ""


def test_a_slow_detach_waits_with_progress_and_a_silent_daemon_is_not_called_unreachable(
        make_daemon, tmp_path):
    """detach under write_back writes the dirty pages first (up to drain_timeout_s): the CLI
    waits for it with progress, as attach does, instead of giving up after --timeout and
    calling a working daemon unreachable. A daemon that takes the request but does not answer
    in time is reported as such."""
    import socket

    d, url = admin_daemon(make_daemon, extra=[
        "--l3-backend", "l3_doubles:SlowFileBackend", "--write-policy", "write_back",
        "--l3-options", json.dumps({"root": str(tmp_path / "l3"), "put_delay_s": 3.0})])
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=4), "kv")
        assert c.batch_set_v1(["w0", "w1"], pages(0, 2)) == [True, True]
        c.ping()  # the commit has landed: both pages are dirty
    rc, out, err = cli("detach", "--url", url, "--timeout", "1")
    assert (rc, out.strip()) == (0, "HiCache storage backend detached."), err
    assert "detaching: " in err
    written = [p for p in (tmp_path / "l3").rglob("*") if p.is_file()]
    assert len(written) == 2  # the dirty pages were written first
    with socket.socket() as silent:  # accepts (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        mute = f"http://127.0.0.1:{silent.getsockname()[1]}"
        rc, out, err = cli("status", "--url", mute, "--timeout", "0.5")
    assert rc == 1 and out == ""
    assert f"no answer from the hicached admin API at {mute} within 0.5 s" in err
    assert "cannot reach" not in err


def test_status_tells_nothing_there_from_a_slow_or_stopped_daemon(make_daemon):
    """Before the call, a short probe (the ZeroMQ handshake, answered by the daemon's I/O
    thread, not its loop): nothing listening is said within a second, not after --timeout; a
    peer that takes the call but does not answer in time is a daemon still at work; one that
    accepts connections but never completes the handshake (a stopped daemon) is said too."""
    import signal

    import zmq

    port = free_port()  # bound, then closed: nobody listens there
    start = time.monotonic()
    rc, out, err = cli("status", "--endpoint", f"tcp://127.0.0.1:{port}")
    assert time.monotonic() - start < 5  # the CLI's own start included (was 30 s)
    assert (rc, out) == (1, "")
    assert err.startswith(f"hicached status: error: nothing listens on tcp://127.0.0.1:{port} "
                          "(connection refused)"), err
    assert err.count("\n") == 1

    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # a daemon whose loop is busy: handshakes, never answers
    mute.setsockopt(zmq.LINGER, 0)
    try:
        port = mute.bind_to_random_port("tcp://127.0.0.1")
        rc, out, err = cli("status", "--endpoint", f"tcp://127.0.0.1:{port}", "--timeout", "0.5")
        assert (rc, out) == (1, "")
        assert (f"no answer from the hicached daemon on tcp://127.0.0.1:{port} within 0.5 s: it "
                "may still be working on status") in err, err
        assert mute.poll(0) and len(mute.recv_multipart()) == 2  # the call itself was sent
    finally:
        mute.close()
        ctx.term()

    d = make_daemon()
    sigstop(d.proc.pid)
    try:
        start = time.monotonic()
        rc, out, err = cli("status", "--endpoint", d.endpoint)
        assert time.monotonic() - start < 10
        assert (rc, out) == (1, "")
        assert (f"something accepts connections on {d.endpoint} but does not complete a "
                "ZeroMQ handshake within 1 s: a stopped daemon") in err, err
    finally:
        d.proc.send_signal(signal.SIGCONT)
    rc, out, err = cli("status", "--endpoint", d.endpoint)
    assert rc == 0 and "ok, ready" in out, err


def test_attach_usage_is_exit_status_2_before_any_daemon_is_looked_for(make_daemon, tmp_path):
    """attach's backend options are --l3-options (serve's name; --config, its old name, still
    works); bad usage exits 2 before looking for a daemon, and so does --prefetch-policy over
    the socket, where there is nothing to record it in."""
    nowhere = f"ipc://{tmp_path}/none.sock"
    rc, out, err = cli("attach", "file", "--l3-options", "{bad", "--endpoint", nowhere)
    assert (rc, out) == (2, "") and "--l3-options: not valid JSON" in err, err
    rc, out, err = cli("attach", "file", "--l3-options", "{}", "--config", "{}", "--endpoint",
                       nowhere)
    assert rc == 2 and "--l3-options and --config: give one" in err, err
    d = make_daemon(extra=["--l3-backend", "none"])
    rc, out, err = cli("attach", "file", "--prefetch-policy", "best_effort", "--endpoint",
                       d.endpoint, "--l3-options", json.dumps({"root": str(tmp_path / "l3")}))
    assert (rc, out) == (2, "") and err.count("\n") == 1, err
    assert "--prefetch-policy is an engine-side setting" in err and "--url" in err
    rc, out, err = cli("attach", "file", "--endpoint", d.endpoint, "--config",
                       json.dumps({"root": str(tmp_path / "l3")}))  # the old name
    assert (rc, out) == (0, "HiCache storage backend attached. backend file, write policy "
                            "write_through\n"), err
    assert (tmp_path / "l3").is_dir()


def help_blocks(text: str) -> dict[str, str]:
    """Each option's help text in an argparse help (its lines joined, the option's own name and
    metavar left out), by the option's first name."""
    blocks: dict[str, str] = {}
    name = None
    for line in text.split("options:")[1].split("\n\n")[0].splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            # "  --opt METAVAR    help starts here" (or the help on the next line)
            blocks[name] = "".join(re.split(r"\s{2,}", line.strip(), maxsplit=1)[1:])
        elif line.strip() and name:
            blocks[name] = (blocks[name] + " " + line.strip()).strip()
    return blocks


def test_every_option_of_every_command_says_what_it_does_and_its_default_once():
    for cmd in ("status", "flush", "attach", "detach", "serve"):
        rc, out, err = cli(cmd, "--help")
        assert rc == 0, err
        blocks = help_blocks(out)
        assert len(blocks) >= 6
        for name, block in blocks.items():
            assert block, f"{cmd} {name} has no help text"
            assert block.count("(default") <= 1, f"{cmd} {name}: {block!r}"
    rc, out, _ = cli("serve", "--help")
    kv = help_blocks(out)["--kv-events-endpoint"]
    assert kv.endswith("(default: off)") and kv.count("default") == 1, kv
    rc, out, _ = cli("flush", "--help")
    assert "(default: l2)" in help_blocks(out)["--tier"]
    rc, out, _ = cli("attach", "--help")
    blocks = help_blocks(out)
    assert "--config" not in blocks and "serve's --l3-options" in blocks["--l3-options"]
    assert "write_through_threshold" in blocks["--write-policy"]
    assert "--url only" in blocks["--prefetch-policy"]
