"""Which allocator a warehouse's private memory comes from (dockd.warehouse.memory)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dockd.warehouse import memory


@pytest.fixture
def pools(monkeypatch):
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    try:
        jemalloc = pa.jemalloc_memory_pool()
    except NotImplementedError:
        pytest.skip("this pyarrow has no jemalloc")
    yield jemalloc
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "default")
    memory.choose()  # (back to one pool, as in a process that never chose)


def test_values_of_64_kib_and_more_come_from_jemalloc_and_smaller_ones_from_the_default_pool(pools):
    default = pa.default_memory_pool()
    assert memory.choose() == f"{default.backend_name}<64KiB,jemalloc"
    je0, d0 = pools.bytes_allocated(), default.bytes_allocated()
    big = memory.allocate(memory.LARGE)
    assert pools.bytes_allocated() - je0 >= memory.LARGE and default.bytes_allocated() == d0
    small = memory.allocate(memory.LARGE - 1)
    assert default.bytes_allocated() - d0 >= memory.LARGE - 1 and pools.bytes_allocated() - je0 < 2 * memory.LARGE
    assert big.size == memory.LARGE and small.size == memory.LARGE - 1
    del big, small
    assert pools.bytes_allocated() == je0 and default.bytes_allocated() == d0


def test_a_pool_named_for_the_daemon_serves_every_size(pools, monkeypatch):
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "system")
    memory.choose()
    je0 = pools.bytes_allocated()
    big = memory.allocate(4 * memory.LARGE)
    assert pools.bytes_allocated() == je0 and big.size == 4 * memory.LARGE
