"""Internals of the transformers integration (payload layouts, filling a DynamicCache)."""
