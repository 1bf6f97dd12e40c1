"""Benchmarks that write JSON rows and PNG plots under bench/results."""
