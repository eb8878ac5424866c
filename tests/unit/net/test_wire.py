"""Framing helpers (`dockd.net.wire`) that need no connection: packed bytes a reply's parse merges in."""

from __future__ import annotations

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.net import wire

LOCATIONS = (pb.Frame.DESCRIPTOR.fields_by_name["acquire_reply"].number,
             pb.AcquireReply.DESCRIPTOR.fields_by_name["locations"].number)


def test_packed_bytes_parse_as_the_field_set_one_value_at_a_time():
    rng = np.random.default_rng(0)
    for n in (0, 1, 5, 127, 128, 300, 20_000):  # (lengths that take one, two and three bytes as varints)
        values = rng.integers(0, 128, n).astype(np.uint16)
        head = pb.Frame(id=9, reply=True, acquire_reply=pb.AcquireReply(lease=3, indexes=[1, 2]))
        raw = head.SerializeToString() + wire.packed_bytes(LOCATIONS, values.astype(np.uint8).tobytes())
        want = pb.Frame()
        want.CopyFrom(head)
        want.acquire_reply.locations.extend(values.tolist())
        got = pb.Frame.FromString(raw)
        assert got == want and list(got.acquire_reply.locations) == values.tolist()
