"""Judging a run: SLOs, goodput, `--fail-on`, and a sweep's capacity and its verdict."""
