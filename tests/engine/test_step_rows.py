import torch

from deepwell.engine import SamplingParams
from deepwell.engine.request import Request
from deepwell.engine.scheduler import ScheduledChunk
from deepwell.engine.step_rows import StepRows

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
