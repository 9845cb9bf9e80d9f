"""The frontend's side of a group's request socket: a request its leader cannot take now (none
connected, or its inbox full) is refused at once (GroupUnavailable, which the router turns into
"no group ready": another group or a 503), never left waiting on a message that was not sent;
`stop` then skips the grace an orderly shutdown would get."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
import zmq

from safeserve.config import ServerArgs
from safeserve.messages import GenerateRequest, SamplingParams
from safeserve.server.group_client import GroupClient, GroupUnavailable

PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def test_a_request_no_leader_can_take_is_refused_not_dropped() -> None:
    async def run() -> None:
        client = GroupClient(ServerArgs(), group=0)
        ctx = zmq.Context()
        leader = ctx.socket(zmq.PULL)
        leader.setsockopt(zmq.LINGER, 0)
        try:
            with pytest.raises(GroupUnavailable):
                client.submit("r1", [1, 2], PARAMS)
            assert "r1" not in client.queues
            leader.connect(client.addrs.requests)
            deadline = time.monotonic() + 10
            while True:  # the connection completes in the background
                try:
                    q = client.submit("r2", [3], PARAMS)
                    break
                except GroupUnavailable:
                    assert time.monotonic() < deadline, "the leader never connected"
                    await asyncio.sleep(0.01)
            assert client.queues == {"r2": q}
            assert leader.poll(5000)
            assert pickle.loads(leader.recv()) == GenerateRequest("r2", [3], PARAMS)
        finally:
            leader.close(linger=0)
            ctx.term()
            t0 = time.monotonic()
            await client.stop()  # nobody reads the Shutdown: no grace to wait out
            assert time.monotonic() - t0 < 2.0

    asyncio.run(run())


def test_a_stopped_client_refuses_requests() -> None:
    """After `stop` (its sockets closed) a request is refused like one no leader can take, and
    an abort or a second stop does nothing."""

    async def run() -> None:
        client = GroupClient(ServerArgs(), group=0)
        await client.stop()
        with pytest.raises(GroupUnavailable):
            client.submit("r1", [1, 2], PARAMS)
        assert client.queues == {}
        client.abort("r1")
        await client.stop()

    asyncio.run(run())
