"""The server edge, shared by the proxy and the simulator: `runner` starts servers (the socket,
the stack, uvicorn) and `limits` bounds what a client controls before an app sees a request
(uvicorn's HTTP protocols, subclassed). It imports nothing from the proxy, the simulator or load
testing."""
