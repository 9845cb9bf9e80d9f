"""What crosses hosts: every message type round-trips through the typed encoding; a frame that
is malformed, of an unknown type, with a field of the wrong type, or sent again is refused and
counted, never turned into anything else; over CurveZMQ a peer without an authorized key gets
nothing through (its handshake is refused and counted) while an authorized one talks."""

from __future__ import annotations

import dataclasses
import pickle
import time
from pathlib import Path

import pytest
import zmq

from safeserve import messages as m
from safeserve.wire import codec, keys

SAMPLES = [
    m.GenerateRequest("r1", [1, 2, 3], m.SamplingParams(max_tokens=4, seed=7, stop_token_ids=[2])),
    m.AbortRequest("r1"),
    m.Shutdown(),
    m.InjectFault("slow_rank", rank=1, delay_s=0.5),
    m.EplbCommand("status", "x"),
    m.StepOutputs(
        0,
        [m.RequestOutput("r1", [5], None, logprobs=[m.TokenLogprob(5, -0.1, [(5, -0.1)])])],
        m.EngineStats(step=3, tbo_steps={"split": 2}),
    ),
    m.GroupReady(0, 128, 64, 16, 300),
    m.GroupFatal(0, 1, "boom"),
    m.Heartbeat(0, 1, 42, 3, "idle", 1.0, 0.5, m.RankStats(balancedness={10: 0.9})),
    m.NodeHello("n1", "a1", "127.0.0.2", [0, 1], 99),
    m.NodeHello("n2", "a2", "10.0.0.12", [0], 7, "10.0.0.11:29500", 1, 2, "10.0.0.11:29500"),
    m.NodeBeat("n1", 1.0, [(0, 1)]),
    m.NodeLease(5.0, 12.5),
    m.SpawnRanks(0, 1, [0, 1], [-1, -1], None, {"tp_size": 2, "model": "tiny"}),
    m.RanksSpawned(0, 1, [0, 1], [10, 11], "tcp://127.0.0.2:1234"),
    m.StopRanks(0, 1, 5.0),
    m.RankExited(0, 1, 1, 11, -9),
]


def test_every_message_type_round_trips() -> None:
    assert {type(x).__name__ for x in SAMPLES} == set(codec.MESSAGE_TYPES)
    w, r = codec.Writer(), codec.Reader()
    for i, msg in enumerate(SAMPLES):
        env = r.read(w.frames(msg, group=i, incarnation=2 * i), b"peer")
        assert env == codec.Envelope(msg, i, 2 * i)
    assert not r.refused


def test_only_known_dataclasses_are_encoded() -> None:
    @dataclasses.dataclass
    class Other:
        x: int = 0

    with pytest.raises(TypeError):
        codec.Writer().frames(Other())


@pytest.mark.parametrize(
    "frames,reason",
    [
        ([b"Shutdown"], "malformed"),
        ([b"Shutdown", b"\x00" * 7, b"", b""], "malformed"),
        ([b"\xff\xfe", (1).to_bytes(8, "big"), b"\x92\xff\xff", b"\x80"], "malformed"),
        ([b"Popen", (1).to_bytes(8, "big"), b"\x92\xff\xff", b"\x80"], "unknown_type"),
        # a pickle where msgpack belongs: refused, never unpickled
        (
            [b"GenerateRequest", (1).to_bytes(8, "big"), b"\x92\xff\xff", pickle.dumps(object)],
            "malformed",
        ),
    ],
)
def test_bad_frames_are_refused_and_counted(frames: list[bytes], reason: str) -> None:
    r = codec.Reader()
    with pytest.raises(codec.BadFrame) as e:
        r.read(frames, b"peer")
    assert e.value.reason == reason
    assert r.refused == {reason: 1}


def test_a_field_of_the_wrong_type_is_refused() -> None:
    frames = codec.Writer().frames(m.AbortRequest("r1"))
    import msgspec

    frames[3] = msgspec.msgpack.encode({"rid": ["not", "a", "string"]})
    r = codec.Reader()
    with pytest.raises(codec.BadFrame, match="malformed"):
        r.read(frames)
    assert r.refused["malformed"] == 1


def test_a_frame_sent_again_is_refused_per_sender() -> None:
    w, r = codec.Writer(), codec.Reader()
    first = w.frames(m.AbortRequest("a"))
    second = w.frames(m.AbortRequest("b"))
    r.read(first, b"n1")
    r.read(second, b"n1")
    for again in (first, second):
        with pytest.raises(codec.BadFrame, match="replayed"):
            r.read(again, b"n1")
    assert r.refused == {"replayed": 2}
    r.read(first, b"n2")  # another sender numbers its own frames


def test_keys_refuse_a_directory_without_them(tmp_path: Path) -> None:
    with pytest.raises(keys.KeyError_, match="safeserve keys"):
        keys.load(tmp_path, keys.FRONTEND)
    keys.generate(tmp_path)
    assert oct((tmp_path / "node.key_secret").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "frontend.key").unlink()
    with pytest.raises(keys.KeyError_, match="frontend's public key"):
        keys.load(tmp_path, keys.NODE)


def _recv(sock: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    if sock.poll(int(timeout_s * 1000)):
        return sock.recv_multipart()
    return None


def test_only_an_authorized_node_gets_through(tmp_path: Path) -> None:
    good, other = tmp_path / "good", tmp_path / "other"
    keys.generate(good)
    keys.generate(other)  # a key pair the frontend never authorized
    front = keys.load(good, keys.FRONTEND)
    ctx = zmq.Context()
    auth = keys.start_authenticator(ctx, front)
    try:
        server = ctx.socket(zmq.ROUTER)
        keys.secure_server(server, front)
        counter = keys.HandshakeCounter(server)
        port = server.bind_to_random_port("tcp://127.0.0.1")

        def client(k: keys.CurveKeys | None) -> zmq.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if k is not None:
                keys.secure_client(s, k)
            s.connect(f"tcp://127.0.0.1:{port}")
            return s

        # right frontend key, wrong own key; and no CurveZMQ at all
        stranger = keys.load(other, keys.NODE)
        intruder = client(
            keys.CurveKeys(stranger.public, stranger.secret, server_public=front.public)
        )
        plain = client(None)
        w = codec.Writer()
        for s in (intruder, plain):
            s.send_multipart(w.frames(m.NodeHello("evil", "x", "127.0.0.9", [], 1)))
        assert _recv(server, 1.0) is None  # nothing of theirs is read
        deadline = time.monotonic() + 5
        while sum(counter.refused.values()) < 2 and time.monotonic() < deadline:
            counter.poll()
            time.sleep(0.05)
        assert sum(counter.refused.values()) >= 2, counter.refused

        node = client(keys.load(good, keys.NODE))
        node.send_multipart(codec.Writer().frames(m.NodeHello("n1", "a", "127.0.0.2", [0], 2)))
        got = _recv(server, 5.0)
        assert got is not None
        env = codec.Reader().read(got[1:], got[0])
        assert env.msg == m.NodeHello("n1", "a", "127.0.0.2", [0], 2)
        for s in (intruder, plain, node):
            s.close(linger=0)
        counter.close()
        server.close(linger=0)
    finally:
        auth.stop()
        ctx.term()
