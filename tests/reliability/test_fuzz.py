"""A bounded frame fuzzer: well-formed and mangled frames of every request kind, sent on
authenticated connections to a real daemon. Whatever arrives, the daemon does not crash,
stays within its memory and descriptor bounds, and other clients keep working."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import dockd
from dockd._proto import dockd_pb2 as pb
from dockd.local import spawn_node
from dockd.net import wire

# A hang must fail the run, not stall it: the signal method's failure is an exception Hypothesis catches
# as the example's, and it then replays examples with no timeout armed, so one example that hangs held
# CI until its own limit. The thread method dumps every stack and ends the run.
pytestmark = pytest.mark.timeout(600, method="thread")

names = st.text(min_size=0, max_size=300)
ints = st.one_of(st.integers(0, 16), st.integers(0, 1 << 20), st.integers(0, (1 << 63) - 1))
u32 = st.one_of(st.integers(0, 16), st.integers(0, 1 << 20), st.integers(0, (1 << 32) - 1))
small_lists = st.lists(ints, max_size=40)


def _run():
    return st.builds(lambda kind, count, dtype, shape, lengths, off, n: pb.Run(
        kind=kind, count=count, dtype=dtype, shape=shape, lengths=lengths, offset=off, nbytes=n),
        st.integers(0, 3), u32, st.sampled_from(["float32", "int64", "bfloat16", "nonsense", ""]),
        st.lists(st.integers(-2, 1 << 40), max_size=4), st.lists(ints, max_size=8), ints, ints)


def _columns():
    return st.lists(st.builds(lambda n, rs: pb.ColumnData(name=n, runs=rs), names, st.lists(_run(), max_size=4)),
                    max_size=6)


requests = st.one_of(
    st.builds(lambda p, c, n, g, cols, t: pb.Frame(put=pb.PutRequest(partition=p, new_count=n, group_size=g,
                                                                     columns=cols, timeout=t, indexes=[])),
              names, names, u32, u32, _columns(), st.floats(-1, 0.5)),
    st.builds(lambda p, c, cols, n, g, t: pb.Frame(acquire=pb.AcquireRequest(partition=p, consumer=c, columns=cols,
                                                                             count=n, groups=g, timeout=t,
                                                                             allow_partial=True)),
              names, names, st.lists(names, max_size=70), u32, st.booleans(), st.floats(0, 0.2)),
    st.builds(lambda p, c, i: pb.Frame(fetch=pb.FetchRequest(partition=p, columns=[pb.FetchColumn(name=c, indexes=i)])),
              names, names, small_lists),
    st.builds(lambda p, i, c: pb.Frame(locate=pb.LocateRequest(partition=p, indexes=i, columns=c)), names, small_lists,
              st.lists(names, max_size=70)),
    st.builds(lambda ls: pb.Frame(confirm=pb.ConfirmRequest(leases=ls)), small_lists),
    st.builds(lambda lease, tok: pb.Frame(release=pb.ReleaseRequest(lease=lease, token=tok)), ints, ints),
    st.builds(lambda lease, s: pb.Frame(extend=pb.ExtendRequest(lease=lease, seconds=s)), ints,
              st.floats(allow_nan=True, allow_infinity=True)),
    st.builds(lambda p: pb.Frame(clear=pb.ClearRequest(partition=p)), names),
    st.just(pb.Frame(stats=pb.StatsRequest())),
    st.builds(lambda c: pb.Frame(hello=pb.Hello(client=c, protocol=wire.PROTOCOL_VERSION)), names),
    st.builds(lambda p, n: pb.Frame(commit=pb.CommitRequest(partition=p, new_count=n, columns=["x"])), names, u32),
    st.builds(lambda h, port: pb.Frame(register=pb.RegisterWarehouse(host=h, port=port)), names, st.integers(0, 65535)),
    st.builds(lambda p: pb.Frame(free=pb.FreeRequest(partition=p)), names),
)


@st.composite
def wire_bytes(draw):
    """One frame: well formed, with a wrong body size, or with its header mangled."""
    frame = draw(requests)
    frame.id = draw(st.integers(0, 1 << 40))
    frame.reply = draw(st.booleans()) and draw(st.booleans())
    frame.oneway = draw(st.booleans()) and draw(st.booleans())
    raw = frame.SerializeToString()
    how = draw(st.sampled_from(["ok", "ok", "body", "flip", "cut", "prefix"]))
    body = b"\0" * draw(st.integers(0, 64 << 10)) if how in ("ok", "body") and frame.HasField("put") else b""
    if how == "flip" and raw:
        k = draw(st.integers(0, len(raw) - 1))
        raw = raw[:k] + bytes([raw[k] ^ draw(st.integers(1, 255))]) + raw[k + 1 :]
    if how == "cut" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    hlen, blen = len(raw), len(body)
    if how == "body":
        blen = draw(st.sampled_from([0, 1, len(body) + 1, 1 << 33, (1 << 64) - 1]))
    if how == "prefix":
        hlen = draw(st.sampled_from([0, 1, wire.MAX_HEADER, wire.MAX_HEADER + 1, (1 << 32) - 1]))
    return wire.PREFIX.pack(wire.MAGIC, hlen, blen) + raw + body


@pytest.fixture(scope="module")
def target():
    proc, ready = spawn_node(["--controller", "--port", "0", "--capacity", "16MiB", "--stall-timeout", "1"])
    try:
        yield proc, f"127.0.0.1:{ready['port']}"
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


@pytest.mark.slow  # (CI runs it: make test-slow)
# (no shrinking: a failing example is reported as drawn, in bounded time)
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(frames=st.lists(wire_bytes(), min_size=1, max_size=4))
def test_the_daemon_survives_whatever_it_is_sent(target, frames, raw, proc_stats):
    proc, address = target
    if not hasattr(test_the_daemon_survives_whatever_it_is_sent, "base"):
        test_the_daemon_survives_whatever_it_is_sent.base = proc_stats(proc.pid)
    base = test_the_daemon_survives_whatever_it_is_sent.base
    c = raw(address)
    c.sock.settimeout(0.3)
    try:
        for data in frames:
            c.sock.sendall(data)
        while c.sock.recv(65536):
            pass
    except OSError:  # a timeout (it waits for the rest) or a reset (it hung up): both fine
        pass
    c.close()
    assert proc.poll() is None, "the daemon died"
    now = proc_stats(proc.pid)
    assert now["rss"] - base["rss"] < 256 << 20 and now["fds"] - base["fds"] < 64, (base, now)
    with dockd.connect(address, connect_timeout=30) as d:  # others are served (a daemon that hangs: a DockTimeout)
        idx = d.put({"ok": torch.arange(2)}, partition="fuzz-check", timeout=30)
        assert d.read("fuzz-check", idx, ["ok"])["ok"][1].item() == 1
