"""The typed encoding of messages that cross hosts.

A message is four ZeroMQ frames: its type's name, a sequence number (8 bytes, big-endian), its
route (the group and incarnation it is for or from; msgpack `[group, incarnation]`, `[-1, -1]`
for none) and its body (msgpack of the dataclass's fields). Decoding accepts only the types of
`MESSAGE_TYPES` and checks every field's type (msgspec), so a frame can only ever become one of
those dataclasses; nothing is unpickled or executed. A sender numbers its frames from 1 up, and
the reader refuses a frame whose number is not above the last one it took from that sender: a
frame captured and sent again is refused. Every refused frame is counted by its reason.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import msgspec

from safeserve import messages

# The messages that may cross hosts: the group protocol and the node agents' protocol.
MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        messages.GenerateRequest,
        messages.AbortRequest,
        messages.Shutdown,
        messages.InjectFault,
        messages.EplbCommand,
        messages.StepOutputs,
        messages.GroupReady,
        messages.GroupFatal,
        messages.Heartbeat,
        messages.NodeHello,
        messages.NodeBeat,
        messages.NodeLease,
        messages.SpawnRanks,
        messages.RanksSpawned,
        messages.StopRanks,
        messages.RankExited,
    )
}
_DECODERS = {name: msgspec.msgpack.Decoder(type=cls) for name, cls in MESSAGE_TYPES.items()}
_ROUTE = msgspec.msgpack.Decoder(type=tuple[int, int])
_ENCODER = msgspec.msgpack.Encoder()

# Why a frame was refused (the label of safeserve:wire_frames_refused_total).
REFUSALS = ("malformed", "unknown_type", "replayed")


class BadFrame(ValueError):
    """A frame that is not a message of `MESSAGE_TYPES` in order; `reason` is in REFUSALS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Envelope:
    """A decoded message and its route (-1: not a group's)."""

    msg: object
    group: int = -1
    incarnation: int = -1


class Writer:
    """One sender's numbering: `frames` encodes its next message."""

    def __init__(self) -> None:
        self._seq = 0

    def frames(self, msg: object, group: int = -1, incarnation: int = -1) -> list[bytes]:
        name = type(msg).__name__
        if MESSAGE_TYPES.get(name) is not type(msg) or not dataclasses.is_dataclass(msg):
            raise TypeError(f"{name} is not a message that may cross hosts")
        self._seq += 1
        return [
            name.encode(),
            self._seq.to_bytes(8, "big"),
            _ENCODER.encode((group, incarnation)),
            _ENCODER.encode(msg),
        ]


class Reader:
    """Decodes frames from any number of senders (each named by the caller: its ZeroMQ
    routing id, or one name for a socket with one peer), refusing and counting what is not a
    message in order."""

    def __init__(self) -> None:
        self._last: dict[bytes, int] = {}
        self.refused: Counter[str] = Counter()

    def forget(self, sender: bytes) -> None:
        """A sender that is gone for good (its numbering is not needed any more)."""
        self._last.pop(sender, None)

    def read(self, frames: list[bytes], sender: bytes = b"") -> Envelope:
        try:
            return self._read(frames, sender)
        except BadFrame as e:
            self.refused[e.reason] += 1
            raise

    def _read(self, frames: list[bytes], sender: bytes) -> Envelope:
        if len(frames) != 4 or len(frames[1]) != 8:
            raise BadFrame("malformed", f"{len(frames)} frames")
        try:
            name = frames[0].decode("ascii")
        except UnicodeDecodeError:
            raise BadFrame("malformed", "type name") from None
        decoder = _DECODERS.get(name)
        if decoder is None:
            raise BadFrame("unknown_type", repr(name[:40]))
        seq = int.from_bytes(frames[1], "big")
        try:
            group, incarnation = _ROUTE.decode(frames[2])
            msg = decoder.decode(frames[3])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadFrame("malformed", f"{name}: {e}") from None
        if seq <= self._last.get(sender, 0):
            raise BadFrame("replayed", f"{name} #{seq} after #{self._last[sender]}")
        self._last[sender] = seq
        return Envelope(msg, group, incarnation)
