"""Sending load from this process: the measuring client over its raw HTTP transport, the load shapes and the sweep driver."""
