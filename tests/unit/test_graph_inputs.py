"""The host side of a decode-graph step (cuda_graphs.fill_host_inputs), on plain CPU buffers."""

from __future__ import annotations

import numpy as np

from hsserve.cuda_graphs import fill_host_inputs


def test_rows_sources_padding_and_tables():
    meta = np.full((5, 8), 99, dtype=np.int64)
    tables = np.full(8 * 6, 77, dtype=np.int32)
    width = fill_host_inputs(meta, tables, ids=[11, 0, 13], sources=[-1, 5, -1],
                             positions=[40, 5, 17], slots=[640, 85, 273], lens=[41, 6, 18],
                             tables=[[40, 41, 42], [5], [17, 18]], size=4)
    assert width == 3
    assert meta[:, :3].tolist() == [[11, 0, 13], [8, 5, 10], [40, 5, 17], [640, 85, 273],
                                    [41, 6, 18]], "a row reads its own id (8 + row) or a sample"
    assert meta[1, 3] == 0 and meta[3, 3] == -1 and meta[4, 3] == 0, \
        "a padding row reads a valid token, writes and reads nothing"
    assert (meta[:, 4:] == 99).all(), "beyond the graph's size nothing is touched"
    assert tables[:9].reshape(3, 3).tolist() == [[40, 41, 42], [5, 0, 0], [17, 18, 0]], \
        "packed [rows, width] at the start"
    assert (tables[9:] == 77).all()
