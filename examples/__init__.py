"""Runnable examples; a package so that benchmarks import them (and their spawned workers find them) by name."""
