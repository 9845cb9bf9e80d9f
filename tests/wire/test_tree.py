"""The control plane's encoding across hosts (`wire/tree.py`): every plan and result a group's
ranks exchange round-trips exactly; anything else (another class, a field a class does not have,
bytes that are not msgpack, a pickle) is refused, never built or run."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from safeserve.engine.model_runner import CONTROL_CLASSES
from safeserve.engine.outcome import RankResult, StepFailed
from safeserve.engine.plan import EplbCollect, EplbMove, Faults, SeqPlan, StepPlan
from safeserve.messages import SamplingParams, TokenLogprob
from safeserve.wire.tree import BadTree, TreeCodec

CODEC = TreeCodec(CONTROL_CLASSES)

SAMPLES = [
    StepPlan(
        7,
        [[SeqPlan([1, 2, 3], 4, [0, 5], SamplingParams(seed=3), 1, table_id=2, fault="raise")], []],
        faults=Faults(route_skew_expert=1, delay_s={1: 0.5}, corrupt_ranks=(1,)),
        retired_tables=[4],
        split=[2, 0],
    ),
    StepPlan(8, eplb=EplbMove((0, 2), ((1, 0, 3, 2), (0, 1, 2, 3)))),
    StepPlan(9, eplb=EplbCollect(reset=False)),
    StepPlan(10, idle=True),
    RankResult([5, "row failed: nan"], [TokenLogprob(5, -0.25, [(5, -0.25)]), None], {0: []}),
    StepFailed(1, "RuntimeError: boom"),
    17,
    None,
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_round_trip(obj: object) -> None:
    assert CODEC.decode(CODEC.encode(obj)) == obj


def test_other_classes_are_not_encoded() -> None:
    from safeserve.messages import Shutdown

    with pytest.raises(TypeError):
        CODEC.encode(Shutdown())
    with pytest.raises(TypeError):
        CODEC.encode({1, 2})


@pytest.mark.parametrize(
    "data,match",
    [
        (msgspec.msgpack.encode({"__t": "Popen", "args": ["sh"]}), "unknown type"),
        (msgspec.msgpack.encode({"__t": "StepFailed", "rank": 0, "cmd": "x"}), "no field"),
        (msgspec.msgpack.encode({"__t": "StepFailed"}), "StepFailed"),
        (b"\xc1\xc1", "not msgpack"),
        (pickle.dumps(StepFailed(0, "x")), "not msgpack|unknown type"),
    ],
)
def test_anything_else_is_refused(data: bytes, match: str) -> None:
    with pytest.raises(BadTree, match=match):
        CODEC.decode(data)
