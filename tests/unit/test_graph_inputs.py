"""A decode-graph step's host inputs (cuda_graphs.fill_host_inputs) are right, on CPU buffers.

Rows, their sources and padding, and block tables, which are copied only when they changed."""

from __future__ import annotations

import numpy as np

from hsserve.engine.cuda_graphs import fill_host_inputs, pack_tables


def test_rows_sources_padding_and_tables():
    meta = np.full((5, 8), 99, dtype=np.int64)
    tables = np.full(8 * 6, 77, dtype=np.int32)
    fill_host_inputs(meta, ids=[11, 0, 13], sources=[-1, 5, -1], positions=[40, 5, 17],
                     slots=[640, 85, 273], lens=[41, 6, 18], size=4)
    width = pack_tables(tables, [[40, 41, 42], [5], [17, 18]])
    assert width == 3
    assert meta[:, :3].tolist() == [[11, 0, 13], [8, 5, 10], [40, 5, 17], [640, 85, 273],
                                    [41, 6, 18]], "a row reads its own id (8 + row) or a sample"
    assert meta[1, 3] == 0 and meta[3, 3] == -1 and meta[4, 3] == 0, \
        "a padding row reads a valid token, writes and reads nothing"
    assert (meta[:, 4:] == 99).all(), "beyond the graph's size nothing is touched"
    assert tables[:9].reshape(3, 3).tolist() == [[40, 41, 42], [5, 0, 0], [17, 18, 0]], \
        "packed [rows, width] at the start"
    assert (tables[9:] == 77).all()


def test_block_tables_are_copied_only_when_they_changed():
    from hsserve.engine.cuda_graphs import DeviceTables

    held = DeviceTables()
    a, b = [1, 2], [7]
    assert held.changed([a, b]), "nothing on the device yet"
    assert not held.changed([a, b]), "the same lists, the same lengths"
    a.append(3)
    assert held.changed([a, b]), "a sequence grew into a new block"
    assert not held.changed([a, b])
    assert held.changed([b, a]), "another order"
    assert held.changed([a]), "fewer rows"
    assert held.changed([a, b])
    assert held.changed([a, list(b)]), "an equal but new list (readmitted after preemption)"
    assert held.changed([a, [8]]), "a new list of the same length"
