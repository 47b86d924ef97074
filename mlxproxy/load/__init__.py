"""Load testing: everything that sends requests and summarises them.

`client` (the measuring client, over `rawhttp`), `schedules` (arrival schedules, SLOs, sweeps),
`replay` and `bench` (what they send and how they group it), `results` (the result file's types),
`report`, `plot` and `htmlreport` (how results are shown), `common` (what the parts share), and
the commands `replay_cli` (`replay`, `report`) and `bench_cli` (`bench`, `demo`).
"""
