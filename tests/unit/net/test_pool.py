"""How a pool sends a transport's `Request` (`dockd.net.pool.Pool.send`): the answer step makes what
the call returns, a failure goes to the failure step (which may give another request to send), a
one-way follow-up goes on the same connection, and the connection always goes back to the pool.
The pool's connections are stand-ins that record what they were asked to send (no daemon)."""

from __future__ import annotations

import numpy as np
import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockFull
from dockd.net.pool import Pool
from dockd.net.tcp import TcpTransport
from dockd.net.transport import Context, Endpoint, Request

NO_BODY = np.empty(0, np.uint8)


class Conn:
    """What a pooled connection is asked to do: each call answered in turn from `answers`."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[pb.Frame, list, float | None, object]] = []
        self.posted: list[pb.Frame] = []

    def call(self, frame, buffers, size, *, fds, timeout, stall, alive):
        self.sent.append((frame, list(fds), stall, alive))
        got = self.answers.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got, NO_BODY, []

    def post(self, frame) -> None:
        self.posted.append(frame)


@pytest.fixture
def pool(monkeypatch):
    pool = Pool(TcpTransport(Endpoint("192.0.2.1", 1, warehouse=0), Context()), connect_timeout=1.0)
    pool.lent, pool.back = [], []

    def get(timeout=None):
        conn = pool.lent.pop(0)
        if isinstance(conn, BaseException):
            raise conn
        return conn

    monkeypatch.setattr(pool, "get", get)
    monkeypatch.setattr(pool, "put", pool.back.append)
    return pool


def test_the_answer_step_makes_what_send_returns_and_the_follow_up_goes_on_the_same_connection(pool):
    conn = Conn(pb.Frame(fetch_reply=pb.FetchReply(mooncake_loan=7)))
    pool.lent.append(conn)
    seen = []
    r = Request(pb.Frame(fetch=pb.FetchRequest(partition="p")), timeout=5.0, stall=5.0,
                answer=lambda reply: seen.append("answer") or reply.frame.fetch_reply.mooncake_loan,
                then=lambda frame: seen.append("then") or pb.Frame(oneway=True, fetch=pb.FetchRequest(
                    mooncake_done=[frame.fetch_reply.mooncake_loan])))
    assert pool.send(r) == 7 and seen == ["answer", "then"]
    assert [f.fetch.mooncake_done for f in conn.posted] == [[7]] and pool.back == [conn]
    assert conn.sent[0][2] == 5.0  # (the request's stall, as Pool.call passes it)


def test_the_follow_up_is_sent_when_the_answer_step_raises_and_none_is_sent_when_it_says_so(pool):
    def broken(reply):
        raise DockConnectionError("the engine's read failed")

    conn = Conn(pb.Frame(), pb.Frame())
    pool.lent += [conn, conn]
    with pytest.raises(DockConnectionError, match="read failed"):
        pool.send(Request(pb.Frame(fetch=pb.FetchRequest()), answer=broken, then=lambda f: pb.Frame(oneway=True)))
    assert len(conn.posted) == 1
    pool.send(Request(pb.Frame(fetch=pb.FetchRequest()), then=lambda f: None))
    assert len(conn.posted) == 1 and pool.back == [conn, conn]


def test_a_failed_request_goes_to_the_failure_step_which_may_send_another_or_let_it_raise(pool):
    first, second = Conn(DockFull("no room")), Conn(pb.Frame(put_reply=pb.PutReply(indexes=[1])))
    pool.lent += [first, second]
    failures = []

    def failed(exc):
        failures.append(exc)
        return retry if len(failures) == 1 else None

    retry = Request(pb.Frame(put=pb.PutRequest(partition="again")), fds=[5], answer=lambda r: r.frame, failed=failed)
    r = Request(pb.Frame(put=pb.PutRequest(partition="p")), answer=lambda r: r.frame, failed=failed)
    assert list(pool.send(r).put_reply.indexes) == [1]
    assert [type(e) for e in failures] == [DockFull] and pool.back == [first, second]
    assert second.sent[0][0].put.partition == "again" and second.sent[0][1] == [5]
    pool.lent.append(Conn(DockFull("still no room")))
    with pytest.raises(DockFull, match="still no room"):
        pool.send(retry)
    assert len(failures) == 2


def test_no_connection_is_a_failure_too_and_a_request_without_a_failure_step_raises(pool):
    failures = []
    pool.lent += [DockConnectionError("nothing listens"), DockConnectionError("nothing listens")]
    with pytest.raises(DockConnectionError):
        pool.send(Request(pb.Frame(fetch=pb.FetchRequest()), failed=lambda e: failures.append(e)))
    assert len(failures) == 1 and pool.back == []  # (the step releases what the request held)
    with pytest.raises(DockConnectionError):
        pool.send(Request(pb.Frame(fetch=pb.FetchRequest())))


def test_a_put_is_watched_with_its_own_check_made_for_this_pool(pool):
    made = []

    def watch(daemon):
        made.append(daemon)
        return lambda: True

    conn = Conn(pb.Frame())
    pool.lent.append(conn)
    pool.send(Request(pb.Frame(put=pb.PutRequest()), timeout=1.0, watch=watch))
    assert made == [pool] and conn.sent[0][3]() is True
