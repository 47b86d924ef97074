"""Load testing: everything that sends requests and summarises them, by concern, bottom first
(each subpackage imports only from those before it; docs/ARCHITECTURE.md):

`data` (the result file's types, charts, arrival schedules), `judge` (SLOs, goodput, capacity),
`output` (summaries, tables, files, HTML, the progress line), `run` (the measuring client, the
load shapes and the one runner), `fleet` (several processes or hosts), and `commands` (`replay`,
`bench`, `report`, `demo`: they build requests and a shape, and show what came back).
"""
