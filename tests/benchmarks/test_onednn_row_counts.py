"""benchmarks/onednn_row_counts.py: which row counts change a row's bits."""

from onednn_row_counts import BIT_COUNTS, rows_that_change


def test_row_counts_whose_rows_change_are_named_with_their_differing_elements():
    # A stand-in whose rows come out one higher in calls of up to 128 rows.
    def call(x):
        return x[:, :3].float() + (x.shape[0] <= 128)

    changed = rows_that_change(call, fan_in=5)
    assert changed == [f"{count} ({count * 3})" for count in BIT_COUNTS if count <= 128]


def test_a_call_whose_rows_never_change_has_none():
    assert rows_that_change(lambda x: x[:, :3].float() * 2, fan_in=5) == []
