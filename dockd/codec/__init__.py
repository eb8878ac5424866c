"""Values <-> wire, by column run: tensors travel as raw bytes, everything else as msgpack.

A column is given as one tensor/array whose first dimension is the sample
axis, or as a sequence with one value per sample. On the wire a column is a
list of *runs*: consecutive values stored back to back in one buffer and
described once (`dockd.v1.Run`):

- a batched tensor is one run with one shape for every value;
- a ragged list of tensors of one dtype whose values differ only in their
  first dimension (token ids, log-probs, masks) is one run: the values are
  packed with one concatenation, and the run carries each value's first
  dimension (`lengths`);
- a jagged column (a jagged nested tensor, or a `Jagged` (values, offsets) pair) is one ragged
  run over its values buffer as it is, checked once for the column;
- Python values (str, numbers, lists, dicts, None, bytes) are msgpack, one
  run per stretch of them, with each value's byte length.

So a put of 64 samples x 8 columns is about 8 run descriptions and 8
buffers, not 512 of each; the warehouse stores each run as one batch, and a
get turns back into one view per run. Nothing is ever pickled, and a value
that would not come back as itself (a tuple, a set) is refused.

The package: `dtypes` (ITEMSIZE, DTYPES), `body` (a body's layout), `encode` (values -> runs),
`decode` (runs -> values). What it exports here is what the rest of dockd uses.
"""

from dockd.codec.body import ALIGN, Body, Joined, cat_into
from dockd.codec.decode import Runs, buffer_key, decode_column, decode_reply, decode_run, spans
from dockd.codec.dtypes import DTYPES, ITEMSIZE
from dockd.codec.encode import Jagged, batched, device_column, encode_columns, jagged, split_column

__all__ = [
    "ALIGN", "DTYPES", "ITEMSIZE", "Body", "Jagged", "Joined", "Runs", "batched", "buffer_key", "cat_into", "decode_column",
    "decode_reply", "decode_run", "device_column", "encode_columns", "jagged", "spans", "split_column",
]
