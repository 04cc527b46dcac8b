"""Config precedence (flags > env > file > defaults), sizes, and errors naming the key."""

import pytest

from hicached.errors import ConfigError
from hicached.daemon.config import DaemonConfig, load_config
from hicached.settings import parse_size


def test_parse_size():
    assert parse_size("4GiB") == 4 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1e9") == 10**9
    assert parse_size(4096) == 4096
    assert parse_size("1.5GiB") == 3 * 512 * 1024**2  # whole bytes
    for bad in ("lots", "-1", 0, True, "4 parsecs", "1e99", "1.5", "0.3KiB"):
        with pytest.raises(ConfigError):
            parse_size(bad, "l2_size")


def test_precedence(tmp_path):
    f = tmp_path / "h.toml"
    f.write_text('l2_size = "1GiB"\nlease_ttl_s = 5\nendpoint = "ipc:///tmp/from-file.sock"\n')
    cfg = load_config(str(f), {"HICACHED_L2_SIZE": "2GiB", "HICACHED_LEASE_TTL_S": "7"},
                      {"l2_size": "3GiB", "state_dir": str(tmp_path)})
    assert cfg.l2_size == 3 * 1024**3  # flag beats env and file
    assert cfg.lease_ttl_s == 7.0  # env beats file
    assert cfg.endpoint == "ipc:///tmp/from-file.sock"  # file beats default
    assert cfg.reservation_ttl_s == DaemonConfig.reservation_ttl_s
    assert cfg.l3_dir == str(tmp_path / "l3")


def test_hicached_section_and_unknown_key(tmp_path):
    f = tmp_path / "h.toml"
    f.write_text('[hicached]\nl2_sise = "1GiB"\n')
    with pytest.raises(ConfigError, match="l2_sise"):
        load_config(str(f), {}, {})


def test_keys_outside_the_hicached_table_are_refused_not_ignored(tmp_path):
    f = tmp_path / "h.toml"
    f.write_text('l2_size = "1GiB"\n[hicached]\nlease_ttl_s = 5\n')  # a key above the table
    with pytest.raises(ConfigError, match=r"\['l2_size'\] outside the \[hicached\] table"):
        load_config(str(f), {}, {"state_dir": str(tmp_path)})
    f.write_text('[hicached]\nlease_ttl_s = 5\n[hicached_l3]\nnode = "a"\n')  # another table
    with pytest.raises(ConfigError, match="hicached_l3"):
        load_config(str(f), {}, {"state_dir": str(tmp_path)})
    f.write_text('[hicached]\nlease_ttl_s = 5\n[hicached.l3_options]\nnode = "a"\n')
    cfg = load_config(str(f), {}, {"state_dir": str(tmp_path)})  # a sub-table is a key
    assert cfg.lease_ttl_s == 5 and cfg.l3_options == {"node": "a"}


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        load_config(None, {}, {"lease_ttl_s": "soon", "state_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="l3_backend"):
        load_config(None, {}, {"l3_backend": "tape", "state_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="l2_size"):
        load_config(None, {}, {"l2_size": "1MiB", "state_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="endpoint"):
        load_config(None, {}, {"endpoint": "http://x", "state_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="set_ahead_bytes: must be >= 0"):
        load_config(None, {}, {"set_ahead_bytes": -1, "state_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="slab_size: must be > 0"):
        load_config(None, {}, {"slab_size": "0", "state_dir": str(tmp_path)})
    off = load_config(None, {}, {"set_ahead_bytes": "0", "state_dir": str(tmp_path)})
    assert off.set_ahead_bytes == 0  # 0 turns set-ahead off


def test_shipped_config_file_loads(tmp_path):
    cfg = load_config("configs/hicached.toml", {}, {"state_dir": str(tmp_path)})
    assert cfg.l2_size == DaemonConfig.l2_size


def test_store_environment_is_captured_at_the_edge(tmp_path):
    from hicached.daemon.operations import backend_options

    env = {"MOONCAKE_MASTER": "10.0.0.1:50051", "LOCAL_HOSTNAME": "node-7", "HOME": "/root"}
    cfg = load_config(None, env, {"state_dir": str(tmp_path)})
    assert cfg.store_env == {"MOONCAKE_MASTER": "10.0.0.1:50051", "LOCAL_HOSTNAME": "node-7"}
    opts = backend_options("mooncake", cfg, {"protocol": "tcp"})
    assert opts == {"protocol": "tcp", "env": dict(cfg.store_env)}
    assert "env" not in backend_options("file", cfg)
    with pytest.raises(ConfigError, match="store_env"):
        load_config(None, {}, {"state_dir": str(tmp_path), "store_env": {}})


def test_log_level_socket_mode_and_env_typos(tmp_path, caplog, monkeypatch):
    with pytest.raises(ConfigError, match="log_level: unknown 'loud'"):
        load_config(None, {}, {"log_level": "loud", "state_dir": str(tmp_path)})
    assert load_config(None, {}, {"log_level": "DEBUG", "state_dir": str(tmp_path)}).log_level
    # chmod's spelling in the environment, as 0o600 is TOML's
    cfg = load_config(None, {"HICACHED_SOCKET_MODE": "0660"}, {"state_dir": str(tmp_path)})
    assert cfg.socket_mode == 0o660
    with caplog.at_level("WARNING", logger="hicached.daemon.config"):
        cfg = load_config(None, {"HICACHED_L2SIZE": "1GiB", "HICACHED_CLIENT_TOKEN": "t"},
                          {"state_dir": str(tmp_path)})
    assert cfg.l2_size == DaemonConfig.l2_size
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "HICACHED_L2SIZE" in warned[0] and "HICACHED_L2_SIZE" in warned[0]
    # the default paths come from the environment given, never from os.environ
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "elsewhere"))
    for env in ({}, {"XDG_RUNTIME_DIR": ""}):  # set but empty: as if unset
        endpoint = load_config(None, env, {"state_dir": str(tmp_path)}).endpoint
        assert endpoint.startswith("ipc:///tmp/hicached-") and "/hicached/" not in endpoint
    endpoint = load_config(None, {"XDG_RUNTIME_DIR": str(tmp_path / "run")},
                           {"state_dir": str(tmp_path)}).endpoint
    assert endpoint == f"ipc://{tmp_path}/run/hicached/hicached.sock"
    state = load_config(None, {"XDG_STATE_HOME": str(tmp_path / "st")}).state_dir
    assert state == f"{tmp_path}/st/hicached"


def test_io_queue_depth_and_nan_times_are_refused(tmp_path):
    """io_queue_depth 0 (or less) made the L3 queues unbounded; a NaN time passed every check."""
    for depth in (0, -5, "0"):
        with pytest.raises(ConfigError, match="io_queue_depth: must be >= 1"):
            load_config(None, {}, {"io_queue_depth": depth, "state_dir": str(tmp_path)})
    for key in ("get_wait_s", "lease_ttl_s", "drain_timeout_s", "unchecked_idle_s"):
        with pytest.raises(ConfigError, match=f"{key}: expected float, got 'nan'"):
            load_config(None, {f"HICACHED_{key.upper()}": "nan"}, {"state_dir": str(tmp_path)})
    assert load_config(None, {}, {"io_queue_depth": 1, "state_dir": str(tmp_path)}).io_queue_depth == 1


def test_a_relative_ipc_path_is_made_absolute_when_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, {}, {"state_dir": str(tmp_path / "s"), "endpoint": "ipc://rel.sock",
                                 "kv_events_endpoint": "ipc://./ev/pub.sock",
                                 "kv_events_replay_endpoint": "ipc://@abstract"})
    assert cfg.endpoint == f"ipc://{tmp_path}/rel.sock"
    assert cfg.kv_events_endpoint == f"ipc://{tmp_path}/ev/pub.sock"
    assert cfg.kv_events_replay_endpoint == "ipc://@abstract"  # Linux's abstract namespace
    from hicached.daemon.config import absolute_ipc

    for kept in ("ipc:///abs/x.sock", "tcp://127.0.0.1:5555", "tcp://*:5557", "ipc://", ""):
        assert absolute_ipc(kept) == kept


def test_a_daemon_on_a_relative_ipc_path_says_and_serves_the_absolute_one(tmp_path):
    """``--endpoint ipc://rel.sock`` from the daemon's working directory: the line it prints
    names the absolute path, a client elsewhere connects there, and ``hicached status`` given
    the same relative path in that directory finds it."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import wait_until

    from hicached import Client

    (tmp_path / "work").mkdir()
    sock = tmp_path / "work" / "rel.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    out = open(tmp_path / "out", "w+")
    d = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--endpoint",
                          "ipc://rel.sock", "--l2-size", "16MiB", "--slab-size", "1MiB",
                          "--state-dir", str(tmp_path / "state"), "--l3-backend", "none"],
                         cwd=tmp_path / "work", env=env, stdout=out, stderr=subprocess.DEVNULL)
    try:
        printed = tmp_path / "out"
        assert wait_until(lambda: "listening on" in printed.read_text() or
                          d.poll() is not None, 60), printed.read_text()
        line = printed.read_text().splitlines()[0]
        assert line.startswith(f"hicached listening on ipc://{sock} (pid {d.pid})"), line
        with Client(f"ipc://{sock}", "model-a", timeout_s=5) as c:
            c.ping()
        st = subprocess.run([sys.executable, "-m", "hicached", "status", "--endpoint",
                             "ipc://rel.sock"], cwd=tmp_path / "work", env=env,
                            capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and st.stdout.startswith(
            f"hicached at ipc://{sock}: ok, ready"), st.stderr
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(30)
        out.close()
