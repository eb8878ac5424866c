"""Framing helpers (`dockd.net.wire`) that need no connection: fields serialized apart that a reply's parse
merges in."""

from __future__ import annotations

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.net import wire

ACQUIRE_REPLY = pb.Frame.DESCRIPTOR.fields_by_name["acquire_reply"].number
LOCATIONS = pb.AcquireReply.DESCRIPTOR.fields_by_name["locations"].number
INLINE = pb.AcquireReply.DESCRIPTOR.fields_by_name["inline"].number


def test_fields_serialized_apart_parse_as_the_fields_set_in_the_frame():
    rng = np.random.default_rng(0)
    for n in (0, 1, 5, 127, 128, 300, 20_000):  # (lengths that take one, two and three bytes as varints)
        values = rng.integers(0, 128, n).astype(np.uint16)
        head = pb.Frame(id=9, reply=True, acquire_reply=pb.AcquireReply(lease=3, indexes=[1, 2]))
        cols = [pb.ColumnData(name=f"c{k}", runs=[pb.Run(count=n, nbytes=7 * n, lengths=[7] * n, segment=k)])
                for k in range(3)]
        parts = [wire.field(LOCATIONS, values.astype(np.uint8).tobytes())] + \
            [wire.field(INLINE, c.SerializeToString()) for c in cols]
        raw = head.SerializeToString() + wire.field(ACQUIRE_REPLY, b"".join(parts))
        want = pb.Frame()
        want.CopyFrom(head)
        want.acquire_reply.locations.extend(values.tolist())
        want.acquire_reply.inline.extend(cols)
        got = pb.Frame.FromString(raw)
        assert got == want and list(got.acquire_reply.locations) == values.tolist()
