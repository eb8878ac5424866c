"""A same-host writer's staging buffers: which ones stay warm for the next put."""

from __future__ import annotations

from dockd.net.staging import Staging


def test_the_buffer_a_writer_uses_now_stays_warm_when_the_budget_is_full():
    st = Staging(max_bytes=64 << 20, max_buffers=8)
    small = st.take(1 << 20)   # 4 MiB (the smallest size)
    st.give(small)
    big = st.take(60 << 20)    # 64 MiB: with the small one idle, over the budget
    st.give(big)
    again = st.take(60 << 20)
    assert again is big, "the buffer of the size being written was dropped; the next put would fault in a fresh one"
    st.give(again)
    assert small.fd == -1 and small.view is None  # the one used longest ago went
    st.close()


def test_buffers_past_the_count_go_oldest_first_and_a_too_big_one_is_not_kept():
    st = Staging(max_bytes=1 << 30, max_buffers=2)
    bufs = [st.take(4 << 20) for _ in range(3)]
    for b in bufs:
        st.give(b)
    assert bufs[0].fd == -1 and bufs[1].fd >= 0 and bufs[2].fd >= 0
    huge = Staging(max_bytes=8 << 20)
    b = huge.take(16 << 20)
    huge.give(b)
    assert b.fd == -1
    st.close()
    huge.close()


def test_a_lent_buffer_is_free_only_once_a_put_sent_after_its_answer_is_answered():
    """The warehouse answers a put before it copies the payload out of a lent buffer, and copies it
    before it reads another request: a put sent before that answer (another thread's) frees nothing,
    one sent after it frees the buffer."""
    st = Staging()
    a = st.take(1 << 20)
    before = st.mark()  # another thread's put, sent before A's answer came
    st.lend(a)          # A's answer: lent
    b = st.take(1 << 20)
    assert b is not a, "a lent buffer was handed to the next put while the warehouse may still copy out of it"
    after = st.mark()   # this put is sent after A's answer came
    st.answered(before)
    assert st.take(1 << 20) is not a, "an answer to a put sent before the lend freed the lent buffer"
    st.answered(after)
    assert st.take(1 << 20) is a
    c = st.take(1 << 20)
    st.lend(c)
    st.close()
    assert c.fd == -1 and c.view is None, "a buffer still lent at close was kept open"
