"""A TQ partition's key log: which key is which sample, where each field lives, the keys' tags.

TQ partition ``p`` keeps its samples in dock partition ``"tq/p/g{n}"`` (`data_partition`), one
dock sample per key, one column per field (non-tensor fields as msgpack-encoded ``"nt/<field>"``
columns). The rest is an append-only log in dock partition ``"tq-meta/p"`` (`meta_partition`),
one msgpack-encoded entry per sample of column ``"entry"``; every process replays it into a
`_Partition` (`_Partition.apply`), so any process sees every other process's writes. The entries:

    put      keys get a sample (``indexes``; None: tags only), fields (written by warehouse ``wid``), tags
    clear    keys are gone
    rotate   the partition's data starts a new generation (the old one was freed)
    consume  a task took samples (its consumption status)
    share    a sampler's choice for the ranks of one batch_index
    reset    reset_consumption of a task (None: every task)
    retag    set_custom_meta: tags replaced

`_Partition.listing` is what ``kv_list`` answers, kept as the entries are applied: {key: its tags}.
Handed out as is (no copy per poll); once handed out it is never changed again (the next change
copies it first), and each key's tags are replaced, never changed in place: a caller may hold and
walk an answer while other threads put. Both are read-only (`ReadOnlyDict`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from dockd.trainer_plugins.verl.tq import FACADE

logger = logging.getLogger(FACADE)

NT = "nt/"
LOG_COLUMN = "entry"


def data_partition(pid: str, gen: int) -> str:
    """The dock partition holding generation `gen` of TQ partition `pid`'s samples."""
    return f"tq/{pid}/g{gen}"


def meta_partition(pid: str) -> str:
    """The dock partition holding TQ partition `pid`'s key log."""
    return f"tq-meta/{pid}"


class ReadOnlyDict(dict):
    """A dict that refuses changes (kv_list's answer and each key's tags, shared with callers);
    it pickles as a plain dict."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("this dict is kept and shared by dockd's transfer_queue (kv_list's answer, a key's tags) "
                        "and is read-only; copy it first (dict(...)) to change it")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


_NO_TAGS = ReadOnlyDict()


@dataclasses.dataclass(slots=True)
class _Key:
    index: int | None  # None: the key holds tags only, no sample was assigned to it yet
    gen: int
    fields: dict[str, tuple[int, bool]]  # field -> (warehouse id, is_tensor)
    tags: ReadOnlyDict  # replaced on a change, never changed in place (kv_list's answers hold it)


def sample_indexes(recs: Sequence[_Key]) -> list[int]:
    """Each key's sample index, for keys that all hold a sample (placed, or just given one)."""
    out = [r.index for r in recs if r.index is not None]
    assert len(out) == len(recs), "a key without a sample"
    return out


def field_kinds(recs: Iterable[_Key]) -> dict[str, bool]:
    """Every field the keys hold -> whether it is a tensor field (as its first writer wrote it)."""
    kinds: dict[str, bool] = {}
    for rec in recs:
        for f, (_, is_tensor) in rec.fields.items():
            kinds.setdefault(f, is_tensor)
    return kinds


class _Partition:
    """One TQ partition's replayed view of the metadata log."""

    def __init__(self) -> None:
        self.keys: dict[str, _Key] = {}
        self.gen = 0
        self.consumed: dict[str, set[int]] = {}  # task -> indexes (current generation) it took
        self.resets: dict[str | None, int] = {}  # task (None: every task) -> reset_consumption count
        # sampler choices (current generation): task -> (dp_rank, batch_index) -> indexes; kept across
        # reset_consumption, as TransferQueue's sampler cache is
        self.shares: dict[str, dict[tuple[Any, Any], list[int]]] = {}
        # task -> indexes chosen for another rank that it has not taken yet (no other choice takes them)
        self.aside: dict[str, set[int]] = {}
        self._listing = ReadOnlyDict()  # key -> its tags (`listing`)
        self._shared = False  # _listing was handed out: copy it before the next change

    def listing(self) -> ReadOnlyDict:
        """{key: tags} of every key, read-only, without a copy; never changed once returned."""
        self._shared = True
        return self._listing

    def _list(self) -> dict[str, ReadOnlyDict]:
        """_listing to change (a copy of it once it was handed out), through dict's own methods."""
        if self._shared:
            self._listing, self._shared = ReadOnlyDict(self._listing), False
        return self._listing

    def consumer(self, task: str) -> str:
        """The dock consumer name of `task`: a new one after each reset_consumption, so that the
        dock hands the task every sample again."""
        every, own = self.resets.get(None, 0), self.resets.get(task, 0)
        return task if every == own == 0 else f"{task}#reset{every}.{own}"

    def placed(self) -> list[tuple[str, _Key]]:
        """The keys holding a sample of the current generation, by index."""
        out = [(k, r) for k, r in self.keys.items() if r.index is not None and r.gen == self.gen]
        out.sort(key=lambda kr: kr[1].index)  # type: ignore[arg-type, return-value]
        return out

    # -- replaying the log ----------------------------------------------------------------
    def apply(self, e: dict[str, Any]) -> None:
        """Apply one log entry."""
        handler = _HANDLERS.get(e["op"])
        if handler is None:  # pragma: no cover - written by a newer dockd
            logger.warning("[tq] unknown log entry op=%s ignored", e["op"])
            return
        handler(self, e)

    def _put(self, e: dict[str, Any]) -> None:
        for i, key in enumerate(e["keys"]):
            rec = self.keys.get(key)
            index = e["indexes"][i] if e["indexes"] is not None else None
            if rec is None:  # a new key; without an index it holds tags only (no sample yet)
                rec = self.keys[key] = _Key(index=index, gen=e["gen"], fields={}, tags=_NO_TAGS)
                dict.__setitem__(self._list(), key, rec.tags)
            elif index is not None and rec.index is None:  # a tag-only key gets its sample
                rec.index, rec.gen = index, e["gen"]
            elif index is not None and (rec.index != index or rec.gen != e["gen"]):
                # another sample for the same key (two first puts raced): the later one wins
                rec = self.keys[key] = _Key(index=index, gen=e["gen"], fields={}, tags=rec.tags)
            for f, kind in e["fields"].items():
                rec.fields[f] = (e["wid"], kind)
            if e["tags"] is not None and e["tags"][i] is not None:
                rec.tags = ReadOnlyDict({**rec.tags, **e["tags"][i]})
                dict.__setitem__(self._list(), key, rec.tags)

    def _clear(self, e: dict[str, Any]) -> None:
        listing = self._list()
        for key in e["keys"]:
            self.keys.pop(key, None)
            dict.pop(listing, key, None)

    def _rotate(self, e: dict[str, Any]) -> None:
        if e["gen"] > self.gen:
            self.gen = e["gen"]
            self.consumed.clear()
            self.shares.clear()
            self.aside.clear()

    def _consume(self, e: dict[str, Any]) -> None:
        if e["gen"] == self.gen:
            self.consumed.setdefault(e["task"], set()).update(e["indexes"])
            self.aside.get(e["task"], set()).difference_update(e["indexes"])

    def _share(self, e: dict[str, Any]) -> None:
        """A sampler's choice for ranks of one batch_index (written under the sampler lock)."""
        if e["gen"] == self.gen:
            task = e["task"]
            mine = self.shares.setdefault(task, {})
            taken = self.consumed.get(task, set())
            for rank, indexes in e["shares"]:
                mine.setdefault((rank, e["batch_index"]), list(indexes))
                if rank != e["rank"]:
                    self.aside.setdefault(task, set()).update(i for i in indexes if i not in taken)

    def _reset(self, e: dict[str, Any]) -> None:
        task = e["task"]
        self.resets[task] = self.resets.get(task, 0) + 1
        if task is None:
            self.consumed.clear()
            self.aside.clear()
        else:
            self.consumed.pop(task, None)
            self.aside.pop(task, None)

    def _retag(self, e: dict[str, Any]) -> None:
        """set_custom_meta: the tags are replaced, not merged."""
        listing = self._list()
        for key, tags in zip(e["keys"], e["tags"]):
            if key in self.keys:
                self.keys[key].tags = ReadOnlyDict(tags)
                dict.__setitem__(listing, key, self.keys[key].tags)


_HANDLERS = {
    "put": _Partition._put,
    "clear": _Partition._clear,
    "rotate": _Partition._rotate,
    "consume": _Partition._consume,
    "share": _Partition._share,
    "reset": _Partition._reset,
    "retag": _Partition._retag,
}
