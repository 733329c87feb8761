"""Benchmarks that run through kvblock's own engines (see perf/ for fio comparisons)."""
