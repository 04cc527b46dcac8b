"""``Client(namespace=...)`` with no endpoint: the endpoint ``hicached serve`` listens on by
default for the same user (``settings.default_endpoint`` of the process environment), tried
against a real daemon started with no endpoint, both sides with ``XDG_RUNTIME_DIR`` in a temp
dir."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import wait_until
from pools import kv_pool, pages

from hicached import Client, DaemonUnavailable, InvalidArgument
from hicached.settings import UNIT_ENDPOINT, default_endpoint
from hicached.sockpath import refusal

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A user's runtime and state directories, in this process's environment (what the Client
    reads) and in the environment it returns (the daemon's)."""
    run, state = tmp_path / "run", tmp_path / "state"
    run.mkdir()
    state.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    env.update(XDG_RUNTIME_DIR=str(run), XDG_STATE_HOME=str(state))
    return env, run


@pytest.fixture
def default_daemon(runtime, tmp_path):
    """``hicached serve`` with no endpoint (a small arena: its only flags)."""
    env, run = runtime
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB",
                             "--slab-size", "1MiB"], env=env, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    sock = run / "hicached" / "hicached.sock"
    try:
        assert wait_until(lambda: proc.poll() is not None or refusal(str(sock)) is None, 60), \
            "the daemon did not listen within 60 s"
        assert proc.poll() is None, open(log.name).read()
        yield f"ipc://{sock}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        log.close()


def test_a_client_with_no_endpoint_reaches_the_daemon_on_its_default(default_daemon):
    with Client(namespace="demo|tp0of1") as c:
        assert c.endpoint == default_daemon
        c.register_mem_pool_host(kv_pool(seed=3))
        assert c.batch_set_v1(["k0", "k1"], pages(0, 2)) == [True, True]
    # the positional form names the same daemon: the pages are there
    with Client(default_daemon, "demo|tp0of1") as c:
        c.register_mem_pool_host(kv_pool())
        assert c.batch_exists(["k0", "k1", "k2"]) == 2


def test_no_daemon_on_the_default_says_where_it_looked_and_how_to_name_another(runtime):
    _, run = runtime
    with pytest.raises(DaemonUnavailable) as e:
        Client(namespace="demo|tp0of1")
    message = str(e.value)
    assert f"no daemon socket at ipc://{run}/hicached/hicached.sock" in message
    assert "the default endpoint of `hicached serve`" in message
    assert UNIT_ENDPOINT in message and "Client(endpoint, namespace)" in message
    with pytest.raises(DaemonUnavailable) as e:  # a named endpoint: no word about the default
        Client(f"ipc://{run}/other.sock", "demo|tp0of1")
    assert str(e.value) == \
        f"no daemon socket at ipc://{run}/other.sock (no such file or directory)"


def test_the_default_endpoint_follows_the_user():
    assert default_endpoint({"XDG_RUNTIME_DIR": "/run/user/1000"}) == \
        "ipc:///run/user/1000/hicached/hicached.sock"
    fallback = f"ipc:///tmp/hicached-{os.getuid()}/hicached.sock"
    assert default_endpoint({}) == fallback
    assert default_endpoint({"XDG_RUNTIME_DIR": ""}) == fallback  # set but empty: as if unset


@pytest.mark.parametrize("args, kw, named", [
    ((), {}, "namespace"),                        # no namespace at all
    ((), {"namespace": ""}, "namespace"),
    (("",), {"namespace": "demo"}, "endpoint"),   # "" is not "no endpoint"
    (("/tmp/x.sock", "demo"), {}, "endpoint"),
])
def test_bad_arguments_name_themselves(args, kw, named):
    with pytest.raises(InvalidArgument, match=f"^{named} must"):
        Client(*args, **kw)
