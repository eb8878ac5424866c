"""What a client says when confirms of gets that returned already come back too late."""

from __future__ import annotations

import logging

from dockd._proto import dockd_pb2 as pb
from dockd.client.confirm import _warn_late


def test_expired_and_refused_confirms_are_told_apart_and_the_get_in_hand_is_left_out(caplog):
    caplog.set_level(logging.WARNING, logger="dockd.client.confirm")
    _warn_late(pb.ConfirmReply(unknown=[1, 2], refused=[3, 9]), 5, but=9)
    expired, refused = (r.getMessage() for r in caplog.records)
    assert expired.startswith("[client] 2 of 5 leases expired") and "--lease-timeout" in expired
    assert refused.startswith("[client] 1 of 5 confirms were refused as another client's")
    assert "--lease-timeout" not in refused  # (a longer lease would not help: the advice must not say so)
    caplog.clear()
    _warn_late(pb.ConfirmReply(), 3)
    assert not caplog.records
