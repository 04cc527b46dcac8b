"""The first hour of a new user, tried as they would: the daemon on its defaults, the CLI with no
flags from any directory, Ctrl-C at any moment, ``| head``, ``--version``, ``serve --help``,
a second daemon on a taken socket or port, the demo without its extra, and Client arguments
checked where they are given. Real processes throughout."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from conftest import wait_until
from pools import kv_pool, pages

from hicached import Client, InvalidArgument

pytestmark = pytest.mark.timeout(180)


def hicached(*args, env, cwd, timeout=60, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "hicached", *args], env=env, cwd=cwd,
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout)


@pytest.fixture
def home(tmp_path):
    """A user's environment with its own runtime and state directories (what the README's
    first command uses when given no paths), and a working directory elsewhere."""
    run, state, elsewhere = tmp_path / "run", tmp_path / "state", tmp_path / "elsewhere"
    for d in (run, state, elsewhere):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    env.update(XDG_RUNTIME_DIR=str(run), XDG_STATE_HOME=str(state))
    return env, elsewhere, state / "hicached"


@pytest.fixture
def default_daemon(home, tmp_path):
    """``hicached serve`` with no endpoint nor state dir (a small arena: the test's only flag)."""
    env, _, state = home
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB",
                             "--slab-size", "1MiB"], env=env, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    endpoint = f"ipc://{env['XDG_RUNTIME_DIR']}/hicached/hicached.sock"

    def up():
        assert proc.poll() is None, open(log.name).read()
        try:
            with Client(endpoint, "probe", timeout_s=0.5) as c:
                c.ping()
            return True
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    wait_until(up, 30)
    yield proc, endpoint, log
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    log.close()


def test_the_cli_finds_the_default_daemon_with_no_flags(home, default_daemon):
    env, elsewhere, state = home
    proc, endpoint, _ = default_daemon
    with Client(endpoint, "model-a") as c:
        c.register_mem_pool_host(kv_pool(seed=1))
        assert c.batch_set_v1(["k0"], pages(0, 1)) == [True]

    st = hicached("status", env=env, cwd=elsewhere)
    assert st.returncode == 0, st.stderr
    assert st.stdout.startswith(f"hicached at {endpoint}: ok, ready")
    assert "L2      1 page, " in st.stdout and "L3      file: write_through" in st.stdout
    assert "hits and misses are counted with admin_port set" in st.stdout

    fl = hicached("flush", env=env, cwd=elsewhere)
    assert (fl.returncode, fl.stdout) == (0, "Cache flushed: L2.\n"), fl.stderr
    with Client(endpoint, "model-a") as c:
        c.register_mem_pool_host(kv_pool())
        assert c.batch_exists(["k0"]) == 1  # L2 flushed: the page is found in L3

    de = hicached("detach", env=env, cwd=elsewhere)
    assert (de.returncode, de.stdout) == (0, "HiCache storage backend detached.\n"), de.stderr
    root = elsewhere.parent / "other-l3"
    at = hicached("attach", "file", "--config", f'{{"root": "{root}"}}', "--write-policy",
                  "write_back", env=env, cwd=elsewhere)
    assert at.returncode == 0, at.stderr
    assert at.stdout == ("HiCache storage backend attached. backend file, write policy "
                         "write_back\n")
    js = hicached("status", "--json", env=env, cwd=elsewhere)
    view = json.loads(js.stdout)
    assert view["endpoint"] == endpoint and view["ready"]["ready"] is True
    assert view["stats"]["tiers"]["l3"]["write_policy"] == "write_back"

    # the admin API's key rule is for remote scripts: the socket needs none, and its errors
    # are one line with the daemon's word
    bad = hicached("attach", "nosuch", env=env, cwd=elsewhere)
    assert bad.returncode == 1 and "nosuch" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_the_cli_over_a_socket_that_wants_a_client_token(home, tmp_path):
    env, elsewhere, _ = home
    env = {**env, "HICACHED_CLIENT_TOKEN": "s3cret"}
    endpoint = f"ipc://{tmp_path}/t.sock"
    d = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB",
                          "--slab-size", "1MiB", "--endpoint", endpoint, "--l3-backend", "none"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: os.path.exists(endpoint[len("ipc://"):]), 30)
        ok = hicached("status", "--endpoint", endpoint, env=env, cwd=elsewhere)
        assert ok.returncode == 0 and "ok, ready" in ok.stdout, ok.stderr
        # the session the CLI opened for its token is not a client of the daemon
        assert "clients 0 sessions" in ok.stdout and "hicached-admin" not in ok.stdout
        doc = json.loads(hicached("status", "--endpoint", endpoint, "--json", env=env,
                                  cwd=elsewhere).stdout)
        assert doc["stats"]["sessions"] == 0 and doc["stats"]["namespaces"] == []
        no = hicached("status", "--endpoint", endpoint, cwd=elsewhere,
                      env={k: v for k, v in env.items() if k != "HICACHED_CLIENT_TOKEN"})
        assert no.returncode == 1 and "HICACHED_CLIENT_TOKEN" in no.stderr
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(20)


def test_no_daemon_is_one_line_naming_where_it_looked(home):
    env, elsewhere, _ = home
    out = hicached("status", env=env, cwd=elsewhere)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "hicached serve" in out.stderr
    assert f"{env['XDG_RUNTIME_DIR']}/hicached/hicached.sock" in out.stderr
    both = hicached("status", "--url", "http://127.0.0.1:1", "--endpoint", "ipc:///x", env=env,
                    cwd=elsewhere)
    assert both.returncode == 2 and "give one" in both.stderr
    bad = hicached("status", "--endpoint", "tcp://no-port", env=env, cwd=elsewhere)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and "tcp://no-port" in bad.stderr


def test_a_reader_that_leaves_is_no_traceback(home, default_daemon):
    env, elsewhere, _ = home
    r, w = os.pipe()
    os.close(r)  # `hicached status --json | head -0`: the reader is gone before we write
    try:
        out = hicached("status", "--json", env=env, cwd=elsewhere, stdout=w)
    finally:
        os.close(w)
    assert out.returncode == 141 and out.stderr == ""


def test_ctrl_c_while_the_arena_is_reserved_is_one_line(home, tmp_path):
    env, elsewhere, _ = home
    arena = f"/dev/shm/hicached-test-ctrlc-{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--l2-size", "2GiB",
                          "--endpoint", f"ipc://{tmp_path}/c.sock", "--arena-path", arena,
                          "--l3-backend", "none"], env=env, cwd=elsewhere,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline()  # said before the long step: what it does and how long
    assert "reserving the arena: 2.0 GiB of shared memory" in first and "per GiB" in first
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGINT, err  # as shells expect (ops/interrupts.py)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "hicached: interrupted"
    assert not os.path.exists(arena) and not os.path.exists(arena + ".presence")


def test_version_module_entry_and_every_serve_default_in_help(home):
    env, elsewhere, _ = home
    from hicached import __version__

    exe = shutil.which("hicached") or os.path.join(os.path.dirname(sys.executable), "hicached")
    for cmd in ([exe], [sys.executable, "-m", "hicached"]):
        out = subprocess.run([*cmd, "--version"], env=env, cwd=elsewhere, capture_output=True,
                             text=True)
        assert (out.returncode, out.stdout) == (0, f"hicached {__version__}\n"), out.stderr
    for cmd in ("status", "flush", "attach", "detach"):  # each says how it finds the daemon
        assert "How the daemon is found" in hicached(cmd, "--help", env=env, cwd=elsewhere).stdout
    text = hicached("serve", "--help", env=env, cwd=elsewhere).stdout
    blocks: dict[str, str] = {}  # each option's lines in the help, as a reader sees them
    for line in text.split("options:")[1].splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        elif line.strip():
            blocks[name] += " " + line.strip()
    assert len(blocks) > 30
    for name, block in blocks.items():
        if name not in ("-h", "--config", "--print-config"):
            assert "(default: " in block, block
    # the default endpoint shown is the one serve listens on (and the CLI looks for)
    shown = blocks["--endpoint"].split("(default: ")[1].split(")")[0].replace(" ", "")
    assert shown == f"ipc://{env['XDG_RUNTIME_DIR']}/hicached/hicached.sock"
    config = hicached("serve", "--print-config", env=env, cwd=elsewhere).stdout
    assert f'endpoint = "{shown}"' in config


def test_a_second_daemon_on_a_taken_socket_or_port_fails_before_l3(home, default_daemon,
                                                                   tmp_path):
    env, elsewhere, _ = home
    out = hicached("serve", "--l2-size", "16MiB", "--slab-size", "1MiB", "--state-dir",
                   str(tmp_path / "second"), env=env, cwd=elsewhere, timeout=60)
    assert out.returncode == 2 and "is in use by a running process" in out.stderr
    assert "L3 backend" not in out.stderr and "reserving the arena" not in out.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = hicached("serve", "--l2-size", "16MiB", "--slab-size", "1MiB", "--state-dir",
                       str(tmp_path / "third"), "--endpoint", f"ipc://{tmp_path}/third.sock",
                       "--admin-port", str(port), env=env, cwd=elsewhere, timeout=60)
    assert out.returncode == 2 and f"admin_port: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "L3 backend" not in out.stderr and "reserving the arena" not in out.stderr


def test_demo_without_its_extra_says_what_to_install(home):
    env, elsewhere, _ = home
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from hicached.ops.cli import main; sys.exit(main(['demo']))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=elsewhere,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "transformers" in line and "pip install -e '" in line and "[engine]'" in line


@pytest.mark.parametrize("kwargs, named", [
    ({"endpoint": "/tmp/hicached.sock"}, "endpoint"),
    ({"endpoint": "ipc://"}, "endpoint"),
    ({"endpoint": 7}, "endpoint"),  # (None: the default endpoint, tests/client)
    ({"namespace": 123}, "namespace"),
    ({"namespace": ""}, "namespace"),
    ({"namespace": "x" * 5000}, "namespace"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"timeout_s": "5"}, "timeout_s"),
    ({"timeout_s": 10**400}, "timeout_s"),  # (too large for a float)
    ({"spin_s": -1}, "spin_s"),
    ({"release_delay_s": float("inf")}, "release_delay_s"),
    ({"client_name": None}, "client_name"),
    ({"token": 7}, "token"),
    ({"remember_pages": -1}, "remember_pages"),
    ({"set_ahead_bytes": 1.5}, "set_ahead_bytes"),
    ({"shared_exists": "yes"}, "shared_exists"),
    ({"shared_gets": 1}, "shared_gets"),
])
def test_client_arguments_are_checked_by_name(tmp_path, kwargs, named):
    args = {"endpoint": f"ipc://{tmp_path}/none.sock", "namespace": "m", **kwargs}
    endpoint, namespace = args.pop("endpoint"), args.pop("namespace")
    with pytest.raises(InvalidArgument, match=rf"^{named} must") as e:
        Client(endpoint, namespace, **args)
    assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)


def test_ctrl_c_pressed_again_and_again_while_serving_stops_it(home, tmp_path):
    """Signals that land while the stop of an earlier one is under way (Ctrl-C pressed twice, a
    wrapper that forwards it, systemd's SIGTERM beside another) never hang the daemon."""
    env, elsewhere, _ = home
    endpoint = f"ipc://{tmp_path}/s.sock"
    p = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB",
                          "--slab-size", "1MiB", "--endpoint", endpoint, "--l3-backend",
                          "none"], env=env, cwd=elsewhere, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert "listening on" in p.stdout.readline()
    for i in range(50):
        p.send_signal(signal.SIGINT if i % 2 else signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    # stopped in order; a Ctrl-C among the signals: it then ends by SIGINT (ops/interrupts.py)
    assert p.returncode == -signal.SIGINT and "hicached stopped" in out, err
    assert "Traceback" not in err
