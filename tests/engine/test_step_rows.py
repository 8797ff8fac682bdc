import torch

from deepwell.engine import SamplingParams
from deepwell.engine.request import Request
from deepwell.engine.scheduler import ScheduledChunk
from deepwell.engine.step_rows import PagedRows, StepRows

BLOCK_SIZE = 4


def running(request_id: str, num_tokens: int, block_ids: list[int], slot=None) -> Request:
    request = Request(
        request_id, list(range(num_tokens)), SamplingParams(), frozenset(), torch.Generator()
    )
    request.block_ids = block_ids
    request.slot = slot
    return request


def test_sequence_spans_hold_each_chunks_own_block_table():
    # A decode at position 9 (3 blocks of 4), a prefill chunk of positions 4..7 (2 blocks)
    # of a request holding 4 blocks, and a decode in its first block: tables of different
    # lengths, cut from one tensor, each must be its own request's.
    decode = running("a", 10, [7, 3, 11], slot=2)
    prefill = running("b", 12, [5, 6, 8, 9])
    short = running("c", 1, [4])
    rows = StepRows(BLOCK_SIZE, 0)
    for chunk in (
        ScheduledChunk(decode, 9, 1, True),
        ScheduledChunk(prefill, 4, 4, False),
        ScheduledChunk(short, 0, 1, True),
    ):
        rows.add(chunk)
    spans = rows.sequences()
    assert [s.block_table.tolist() for s in spans] == [[7, 3, 11], [5, 6], [4]]
    assert [(s.row, s.num_rows, s.start, s.slot) for s in spans] == [
        (0, 1, 9, 2),
        (1, 4, 4, -1),
        (5, 1, 0, -1),
    ]
    assert all(s.block_table.dtype == torch.long for s in spans)
    assert rows.positions == [9, 4, 5, 6, 7, 0]


def test_paged_rows_derive_what_each_backend_reads_of_the_decode_rows():
    # Two sequences decode at positions 9 and 4 (3 and 2 blocks of 4); the third is a
    # draft's two verify rows at positions 5 and 6 over the same blocks as each other.
    first = running("a", 10, [7, 3, 11], slot=2)
    second = running("b", 5, [5, 6])
    verify = running("c", 7, [8, 9])
    chunks = [
        ScheduledChunk(first, 9, 1, True),
        ScheduledChunk(second, 4, 1, True),
        ScheduledChunk(verify, 5, 2, True),
    ]
    rows = StepRows(BLOCK_SIZE, 0)
    for chunk in chunks:
        rows.add(chunk)
    paged = PagedRows(BLOCK_SIZE, batch_invariant=False)
    for chunk, span in zip(chunks, rows.sequences(), strict=True):
        paged.add(chunk, span, decode=True)
    meta = paged.metadata()
    assert meta.decode_context_lens == [10, 5, 6, 7]
    assert meta.decode_block_ids.tolist() == [7, 3, 11, 5, 6, 8, 9, 8, 9]
    assert meta.decode_block_starts.tolist() == [0, 3, 5, 7, 9]
    assert meta.decode_block_rows.tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3]
    # Keys past each row's context in its last block: 10 = 4 + 4 + 2, 5 = 4 + 1, ...
    valid = (~meta.decode_block_padding[:, 0, 0]).sum(dim=1).tolist()
    assert valid == [4, 4, 2, 4, 1, 4, 2, 4, 3]
    ranks, depth, span = meta.decode_block_stacking
    assert (ranks.tolist(), depth, span) == ([0, 0, 0, 0, 0, 0, 0, 1, 1], 2, 12)
    assert meta.decode_sequence_starts.tolist() == [0, 1, 2, 4]
    assert meta.slot_blocks.tolist() == [11, 6, 9, 9]
    assert meta.slot_offsets.tolist() == [1, 0, 1, 2]
    assert meta.seq_slots == [2, -1, -1, -1]
