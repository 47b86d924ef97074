"""Showing and writing results: summaries, console tables, CSV, Markdown, HTML, charts and the progress line."""
