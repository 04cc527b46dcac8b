"""Who may use the daemon: socket / arena modes and group, client tokens, tcp endpoints; and
per-namespace quotas end to end with their metrics."""

import grp
import os
import stat
import subprocess
import sys

import pytest
from admin_helpers import KEY, admin_daemon, free_port, http, sample, scrape
from conftest import DaemonProc, raw_socket
from pools import kv_pool, pages

from hicached import protocol as P
from hicached.client.api import Client
from hicached.errors import Unauthorized

TOKEN = "client-token-for-tests"


def _mode(path):
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def test_socket_and_arena_are_private_by_default(daemon):
    sock = daemon.endpoint[len("ipc://"):]
    assert _mode(sock) == (0o600, os.getgid())
    assert _mode(daemon.cfg.arena_path) == (0o600, os.getgid())
    assert _mode(daemon.cfg.arena_path + ".presence") == (0o600, os.getgid())


def _other_group():
    mine = os.getgid()
    for gid in os.getgroups() + ([g.gr_gid for g in grp.getgrall()] if os.geteuid() == 0
                                 else []):
        if gid != mine:
            return grp.getgrgid(gid).gr_name, gid
    return None


def test_socket_group_makes_socket_and_arena_0660(make_daemon):
    other = _other_group()
    if other is None:
        pytest.skip("this user is in no second group to hand the socket to")
    name, gid = other
    d = make_daemon(extra=["--socket-group", name])
    assert _mode(d.endpoint[len("ipc://"):]) == (0o660, gid)
    assert _mode(d.cfg.arena_path) == (0o660, gid)
    assert _mode(d.cfg.arena_path + ".presence") == (0o660, gid)
    with d.client() as c:  # still usable
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        assert c.batch_set_v1(["g0"], pages(0, 1)) == [True]


def test_unknown_socket_group_is_refused_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hicached", "serve", "--state-dir",
                          str(tmp_path), "--socket-group", "no-such-group-xyz"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "socket_group: no group 'no-such-group-xyz'" in out.stderr


def test_client_token_accepted_and_refused(make_daemon, tmp_path):
    env = {**os.environ, "HICACHED_CLIENT_TOKEN": TOKEN}
    d = make_daemon(env=env, token=TOKEN)
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=2), "kv")
        assert c.batch_set_v1(["t0", "t1"], pages(0, 2)) == [True, True]
        assert c.batch_exists(["t0", "t1"]) == 2
        session = c.session
    with pytest.raises(Unauthorized, match="no client token"):
        Client(d.endpoint, "model-a", token="")
    with pytest.raises(Unauthorized, match="wrong client token"):
        Client(d.endpoint, "model-a", token="guess")
    # a connection that never shook hands: session-less requests refused, sessions not usable
    with raw_socket(d.endpoint) as s:
        for msg, code in ((P.Ping(1), "unauthorized"), (P.GetStats(2), "unauthorized"),
                          (P.Flush(3, "all"), "unauthorized"),
                          (P.Detach(4), "unauthorized"),
                          (P.Exists(5, session, ["t0"]), "unknown_session")):
            s.send(P.encode(msg))
            ans = P.answer_decoder.decode(s.recv())
            assert isinstance(ans, P.Error) and ans.code == code, msg
    with d.client() as c:
        assert c.stats()["l2_pages"] == 2  # nothing was flushed
    assert TOKEN not in d.output()


def _serve(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "hicached", "serve", "--state-dir",
                           str(tmp_path / "tcp-state"), "--l2-size", "16MiB", "--slab-size",
                           "1MiB", *args], check=False, capture_output=True, text=True, timeout=60,
                          env=env)


def test_tcp_refused_without_allow_tcp_and_token(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    for extra in ([], ["--allow-tcp"], ["--client-token", TOKEN]):
        out = _serve(tmp_path, "--endpoint", endpoint, *extra)
        assert out.returncode == 2, extra
        assert "endpoint:" in out.stderr and "allow_tcp = true" in out.stderr
        assert "client_token" in out.stderr


def test_tcp_with_allow_tcp_and_token(tmp_path):
    d = DaemonProc(tmp_path, name="tcp", extra=["--allow-tcp", "--l3-backend", "none"],
                   env={**os.environ, "HICACHED_CLIENT_TOKEN": TOKEN}, token=TOKEN)
    d.endpoint = f"tcp://127.0.0.1:{free_port()}"
    d.args[d.args.index("--endpoint") + 1] = d.endpoint
    try:
        d.start()
        with d.client() as c:
            src, dst = kv_pool(seed=3), kv_pool()
            c.register_mem_host_pool_v2(src, "kv")
            assert c.batch_set_v1(["n0"], pages(0, 1)) == [True]
            c.register_mem_host_pool_v2(dst, "kv")
            assert c.batch_get_v1(["n0"], pages(1, 1)) == [True]
        with pytest.raises(Unauthorized):
            Client(d.endpoint, "model-a", timeout_s=2)
    finally:
        d.cleanup()


def test_namespace_quota_enforced_with_metrics(make_daemon):
    d, url = admin_daemon(make_daemon, extra=[
        "--l3-backend", "none", "--namespace-quotas", '{"tenant-a": "8KiB"}'])
    with d.client("tenant-a") as a, d.client("tenant-b") as b:
        a.register_mem_host_pool_v2(kv_pool(seed=4), "kv")  # 1 KiB pages: 8 fit the quota
        b.register_mem_host_pool_v2(kv_pool(seed=5), "kv")
        keys = [f"a{i}" for i in range(12)]
        assert a.batch_set_v1(keys[:8], pages(0, 8)) == [True] * 8
        assert all(b.batch_set_v1([f"b{i}" for i in range(20)], pages(0, 20)))  # no quota
        # evicts a chain's deep end, a7..a4 (a0..a3 still hit; LRU would leave a4..a7, which
        # no hit can reach, and evict a0..a3: ``--eviction lru``)
        assert a.batch_set_v1(keys[8:], pages(8, 4)) == [True] * 4
        assert a.batch_exists(keys[:8]) == 4 and a.batch_exists(keys[8:]) == 4
        assert b.batch_exists([f"b{i}" for i in range(20)]) == 20
        mine = keys[:4] + keys[8:]
        held = a._conn.call(lambda s, r: P.Lease(r, s, [P.PoolKeys("kv", mine)]))  # pin all
        assert a.batch_set_v1(["a12"], pages(0, 1)) == [False]  # quota full of pinned pages
        a._conn.send_only(P.Release(0, a.session, [held.lease_id]))
        m = scrape(url)
        assert sample(m, "hicached_namespace_l2_bytes", namespace="tenant-a") == 8 * 1024
        assert sample(m, "hicached_namespace_l2_quota_bytes", namespace="tenant-a") == 8 * 1024
        assert sample(m, "hicached_namespace_quota_evictions_total", namespace="tenant-a") == 4
        assert sample(m, "hicached_namespace_quota_rejections_total", namespace="tenant-a") == 1
        assert sample(m, "hicached_no_space_total") == 1
        st = http("GET", url + "/stats")[1]
        assert st["namespaces"] == [
            {"namespace": "tenant-a", "used_bytes": 8192, "sessions": 1, "quota_bytes": 8192,
             "evictions": 4, "rejections": 1},
            {"namespace": "tenant-b", "used_bytes": 20 * 1024, "sessions": 1,
             "quota_bytes": None, "evictions": 0, "rejections": 0}]  # no quota: listed too
        assert sample(m, "hicached_namespace_l2_bytes", namespace="tenant-b") == 20 * 1024
        assert sample(m, "hicached_namespace_sessions", namespace="tenant-b") == 1
        assert a.batch_set_v1(["a12"], pages(0, 1)) == [True]  # released: room again
    assert KEY not in d.output()


def test_operations_config_keys_and_errors(tmp_path):
    from hicached.errors import ConfigError
    from hicached.daemon.config import load_config

    base = {"state_dir": str(tmp_path)}
    cfg = load_config(None, {"HICACHED_NAMESPACE_QUOTAS": '{"tenant-a": "2GiB"}',
                             "HICACHED_ADMIN_PORT": "8470", "HICACHED_ALLOW_TCP": "yes"}, base)
    assert cfg.namespace_quotas == {"tenant-a": 2 * 1024**3} and cfg.admin_port == 8470
    assert cfg.allow_tcp is True and cfg.access_mode == 0o600
    assert KEY not in repr(load_config(None, {"HICACHED_ADMIN_API_KEY": KEY}, base))
    for overrides, key in (({"namespace_quotas": '{"tenant-a": "lots"}'}, "namespace_quotas"),
                           ({"namespace_quotas": '["tenant-a"]'}, "namespace_quotas"),
                           ({"admin_port": 70000}, "admin_port"),
                           ({"drain_timeout_s": -1}, "drain_timeout_s"),
                           ({"socket_mode": 0o7777}, "socket_mode"),
                           ({"allow_tcp": "perhaps"}, "allow_tcp")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, {}, {**base, **overrides})
    f = tmp_path / "h.toml"
    f.write_text('[hicached]\nadmin_port = 8470\nnamespace_quotas = { "a|b" = "1MiB" }\n'
                 'admin_api_kee = "x"\n')
    with pytest.raises(ConfigError, match="admin_api_kee"):
        load_config(str(f), {}, base)
