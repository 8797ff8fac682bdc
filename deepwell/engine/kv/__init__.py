"""Paged KV cache: block pool, per-model layouts, per-request allocation."""
