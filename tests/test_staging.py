"""Batch staging layout and CUDA-graph size selection (host logic, no GPU needed)."""

from __future__ import annotations

import torch
from fastqwen.engine.cuda_graph import DecodeGraphs, capture_sizes
from fastqwen.engine.staging import BatchStaging, Layout


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b > a for a, b in zip(sizes, sizes[1:]))
    assert all(s % 8 == 0 for s in sizes[3:]) and all(s % 16 == 0 for s in sizes if s > 64)


def test_padded_size_is_the_smallest_captured_size_that_fits():
    graphs = DecodeGraphs(None, None, None, 40)
    assert graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    assert [graphs.padded_size(n) for n in (1, 3, 5, 17, 40, 41)] == [1, 4, 8, 24, 40, None]


def test_views_share_one_buffer_with_their_dtypes():
    staging = BatchStaging(max_tokens=64, max_seqs=8, max_width=4, device=torch.device("cpu"))
    layout = Layout(num_tokens=10, num_seqs=3, num_samples=2, width=4)
    host = staging.host_views(layout)
    host["input_ids"][:] = range(10)
    host["positions"][:] = range(100, 110)
    host["out_slots"][:] = -1
    host["logits_indices"][:] = [4, 9]
    host["query_start"][:] = [0, 5, 9, 10]
    host["kv_lens"][:] = [5, 7, 12]
    host["page_table"][:] = [[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0]]
    staging.upload(layout)
    dev = staging.device_views(layout)
    assert dev["input_ids"].dtype == torch.int64 and dev["input_ids"].tolist() == list(range(10))
    assert dev["positions"].tolist() == list(range(100, 110)) and dev["out_slots"].tolist() == [-1] * 10
    assert dev["logits_indices"].tolist() == [4, 9]
    assert dev["query_start"].dtype == torch.int32 and dev["kv_lens"].tolist() == [5, 7, 12]
    assert dev["page_table"].shape == (3, 4) and dev["page_table"][2].tolist() == [4, 5, 6, 0]
    assert layout.size == 2 * (10 * 3 + 2) + 4 + 3 + 12
