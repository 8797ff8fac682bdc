"""`deepwell bench --sweep`'s default grid, torch-free for the command line's --help.

Chosen so that the sweep of the embedded SmolLM2 finishes in a few minutes on a shared 2-core
machine (docs/benchmarks.md); larger machines pass their own.
"""

SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_PREFILL_BATCH_TOKENS = (32, 64, 128, 256, 512, 1024, 2048)
