"""Sending one test's load from several processes or hosts (`--workers`, `--cluster`)."""
