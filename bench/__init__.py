"""Benchmarks: scripts that print JSON and a table (not tests)."""
