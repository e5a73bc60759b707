"""Benchmarks for acp-proxy: run them with scripts/bench."""
