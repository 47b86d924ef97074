"""Simulated MLX servers (`mlxproxy sim`): a pure engine model, per-server wire formats, a thin ASGI shell.

Modules: `engine` (discrete-event timing model, pure), `profiles` (the knobs and the named
profiles), `request` (request parsing, prompt-token rule, deterministic answers), `faults`
(`X-Sim-Fault` syntax), `wire`, `wire_servers` and `wire_vllm` (bytes per server style),
`styles` (every style by name), `render` (events to writes, pure), `app` (`create_app`, the
ASGI shell) and `cli` (the `sim` command).
This package module imports none of them, so importing the engine pulls in no I/O.
"""
