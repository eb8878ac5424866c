"""The device-link transport's reader end (`dockd.net.device_transport.ReaderLinks`): a fetch on a
link holds the link's lock from its request until its answer is in, whichever way it ends, and a
link the warehouse does not know or that failed is dropped. No daemon: the request's answer and
failure steps are driven directly, as `Pool.send` drives them; the link is a gloo one that never
joins (nothing is transferred)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockFull
from dockd.net.device_link import Link
from dockd.net.device_transport import ReaderLinks, _Mine
from dockd.net.transport import Reply

CPU = torch.device("cpu")


@pytest.fixture
def links():
    links = ReaderLinks()
    links._links[3] = _Mine(Link("gloo", CPU))  # (an offered link: what _get makes on a first device fetch)
    yield links
    links.close()


def fetch(links: ReaderLinks):
    mine = links._links[3]
    r = links.request(3, "127.0.0.1", CPU, pb.FetchRequest(partition="p"), 2.0)
    assert mine.lock.locked()
    assert r.frame.fetch.link.id == mine.id and r.frame.fetch.link.backend == "gloo"
    assert r.timeout == r.stall == 2.0
    return r, mine


def reply(**fields) -> Reply:
    return Reply(pb.Frame(fetch_reply=pb.FetchReply(**fields)), np.empty(0, np.uint8), [])


def test_an_answer_without_device_data_releases_the_link_and_keeps_it(links):
    r, mine = fetch(links)
    got = r.answer(reply())
    assert got.received is None and not mine.lock.locked() and links._links[3] is mine


def test_a_link_the_warehouse_does_not_know_is_dropped_and_released(links):
    r, mine = fetch(links)
    assert r.answer(reply(link_unknown=True)).received is None
    assert not mine.lock.locked() and 3 not in links._links and mine.link.closed


def test_a_refused_link_is_not_offered_to_that_warehouse_again(links):
    r, mine = fetch(links)
    r.answer(reply(link_refused="no such device"))
    assert not mine.lock.locked() and links._off == {3: "no such device"}
    plain = links.request(3, "127.0.0.1", CPU, pb.FetchRequest(partition="p"), 2.0)
    assert not plain.frame.fetch.HasField("link") and plain.failed is None


def test_a_fetch_that_failed_releases_the_link_and_drops_an_unjoined_one_only_when_unanswered(links):
    r, mine = fetch(links)
    assert r.failed(DockFull("no room")) is None  # an answer: the warehouse did not start joining
    assert not mine.lock.locked() and links._links[3] is mine
    r, mine = fetch(links)
    assert r.failed(DockConnectionError("gone")) is None  # it may have started joining: never offered again
    assert not mine.lock.locked() and 3 not in links._links and mine.link.closed
