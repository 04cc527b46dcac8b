"""The PD channels' messages: every Struct round-trips in its direction, a malformed frame or a
message of another direction raises ``PDProtocolError``; ``PDConfig`` and the CLI refuse bad
flag combinations with a message (status 2)."""

import pytest
import torch

from hicached.engine.pd import protocol as M
from hicached.engine.pd.server import PDConfig, build_parser, main

MESSAGES = [
    ("prefill", M.PrefillRequest("r1", [1, 2, 3], 16, 2.5)),
    ("prefill", M.AbortRequest("r1")),
    ("decode", M.Ready("r1", 7, b"\x00" * 8, 3, True)),
    ("decode", M.Failed("r1", "timeout", "prefill timed out")),
    ("engine", M.Generate("r2", [4, 5], 3)),
    ("engine", M.CheckIdle()),
    ("user", M.Generated("r2", [1, 2], b"", "", 0.5, 16, 16, 2, 1)),
    ("user", M.Generated("r3", [1], b"", "", 0.5, 32, 16, 2, 1, 2, 1)),
    ("user", M.Checked(False, "LeakDetected: ...")),
    ("engine", M.GetUsage()),
    ("user", M.Usage(8, 64, 10, 40, 4096, 24, 3, 12288)),
]


@pytest.mark.parametrize(("direction", "msg"), MESSAGES)
def test_every_message_round_trips(direction, msg):
    assert M.decode(M.encode(msg), direction) == msg
    other = "user" if direction != "user" else "prefill"
    with pytest.raises(M.PDProtocolError, match=f"malformed {other} frame"):
        M.decode(M.encode(msg), other)


def test_usage_counts_the_tokens_in_use():
    assert M.Usage(8, 64, 10, 40, 4096).used_tokens == (64 - 10) * 8


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x81\xa1t\xa5ready", b"\x93\x01\x02\x03"])
def test_malformed_frames_raise(frame):
    with pytest.raises(M.PDProtocolError, match="malformed decode frame"):
        M.decode(frame, "decode")


def test_logits_round_trip():
    rows = [torch.randn(256), torch.randn(256)]
    back = M.logits_rows(M.logits_bytes(rows), 256)
    assert all(torch.equal(a, b) for a, b in zip(rows, back, strict=True))
    assert M.logits_bytes([]) == b"" and M.logits_rows(b"", 256) == []


@pytest.mark.parametrize(("kw", "words"), [
    ({"mode": "both"}, "unknown disaggregation mode 'both'"),
    ({"mode": "prefill"}, "needs --disaggregation-bootstrap-endpoint"),
    ({"mode": "decode", "bootstrap_endpoint": "ipc:///x"}, "needs --serve-endpoint"),
    ({"serve_endpoint": "ipc:///y", "decode_radix": True}, "is for the decode mode"),
    ({"serve_endpoint": "ipc:///y", "timeout_s": 0}, "must be > 0"),
    ({"mode": "prefill", "bootstrap_endpoint": "ipc:///x", "transfer": "rdma"},
     "unknown --disaggregation-transfer 'rdma'; valid: \\['l2', 'l3'\\]"),
])
def test_bad_configs_raise(kw, words):
    with pytest.raises(ValueError, match=words):
        PDConfig(**kw)


def test_cli_refuses_a_bad_combination(capsys, tmp_path):
    assert main(["--disaggregation-mode", "decode", "--model-path", str(tmp_path)]) == 2
    assert "needs --disaggregation-bootstrap-endpoint" in capsys.readouterr().err
    assert build_parser().parse_args(["--model-path", "m", "--disaggregation-transfer",
                                      "l3"]).transfer == "l3"
