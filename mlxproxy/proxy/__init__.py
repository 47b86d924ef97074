"""The proxy shell: a pure ASGI app, its upstream clients, metrics and observers."""
