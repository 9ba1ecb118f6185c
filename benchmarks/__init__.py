"""Benchmarks of evollm (scripts; not part of the library)."""
