"""Benchmarks: each prints a baseline measured in the same run next to the project's figure; installed as tinyhet.bench."""
