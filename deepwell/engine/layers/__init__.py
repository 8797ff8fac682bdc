"""Compute building blocks shared by models: attention backends, rotary, norm."""
