"""Run ASGI apps on real sockets: the one place where a server is started.

`ServerThread` serves an app with uvicorn on a background thread (used by tests, the
demo and benchmarks that need several servers in one process); `serve_forever` runs one
app in the foreground (used by the CLI). Port 0 asks the OS for a free port; the bound
port is read back from the socket, so nothing races for it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvicorn

from mlxproxy.edge._compat_uvicorn import protocol_class, serve
from mlxproxy.edge.limits import HeadLimits

T = TypeVar("T")
STACKS = ("plain", "fast")
STACK_ENV = "MLXPROXY_STACK"

#: the open-files limit asked for when the hard limit is unlimited (macOS: kern.maxfilesperproc
#: is usually 10240 or more; its default soft limit is 256)
OPEN_FILES_WANTED = 10240


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit on open files to its hard limit (at most
    `OPEN_FILES_WANTED` where the hard limit is unlimited), as load generators and servers do:
    every stream in flight holds one or two sockets, and macOS starts processes at 256, so a
    run of a few hundred concurrent streams would fail in the client, not at the server.
    Returns (before, after), or None where the platform has no such limit or refuses."""
    try:
        import resource
    except ImportError:  # (Windows)
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return None


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def stack_settings(stack: str | None = None) -> tuple[str, str]:
    """The (loop, http) pair uvicorn runs on: `plain` is asyncio + h11 (what a platform
    without their wheels gets), `fast` is uvloop + httptools (installed by default). None
    reads the environment variable MLXPROXY_STACK; unset or empty picks the fastest
    installed. Raises ValueError for another name, or `fast` without its packages."""
    if stack is None:
        stack = os.environ.get(STACK_ENV, "").strip().lower() or None
    if stack is None:
        return ("uvloop" if _importable("uvloop") else "asyncio", "httptools" if _importable("httptools") else "h11")
    if stack == "plain":
        return "asyncio", "h11"
    if stack == "fast":
        if not (_importable("uvloop") and _importable("httptools")):
            raise ValueError(f"{STACK_ENV}=fast needs uvloop and httptools: pip install uvloop httptools")
        return "uvloop", "httptools"
    raise ValueError(f"{STACK_ENV} must be one of {', '.join(STACKS)} (or unset), got {stack!r}")


def new_event_loop(stack: str | None = None) -> asyncio.AbstractEventLoop:
    """An event loop of the chosen stack (see `stack_settings`)."""
    if stack_settings(stack)[0] == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


#: set by the command line (`quiet_after_interrupt`): once Ctrl-C has stopped a run, further
#: Ctrl-Cs are ignored while the command prints and writes what it measured, then exits
_QUIET_AFTER_INTERRUPT = False


def quiet_after_interrupt() -> None:
    """Make a Ctrl-C that stops `run_async` the last one this process heeds (the command line's
    choice: it is about to print what was measured and exit; SIGQUIT, Ctrl-\\, still stops it)."""
    global _QUIET_AFTER_INTERRUPT
    _QUIET_AFTER_INTERRUPT = True


def run_async(coro: Coroutine[Any, Any, T], stack: str | None = None) -> T:
    """Run `coro` to completion on the chosen stack's event loop (see `stack_settings`), as
    `asyncio.run` does: `replay` and `bench` run their client on the same stack as the proxy
    (uvloop where installed, asyncio with MLXPROXY_STACK=plain).

    Ctrl-C cancels `coro`, which finishes what it measured so far, and then raises
    KeyboardInterrupt here. Unlike `asyncio.run`, a second Ctrl-C never raises KeyboardInterrupt
    inside the loop (where it lands in whatever task runs, whose "exception was never retrieved"
    then prints a traceback, and cuts the first one's clean-up short): it is ignored, so the run
    ends with the first one's result; a third cancels `coro` again, in case its clean-up hangs."""
    loop = new_event_loop(stack)
    main_task: asyncio.Task[T] | None = None
    interrupts = 0

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts != 2 and main_task is not None and not main_task.done():
            loop.call_soon_threadsafe(main_task.cancel)

    handle = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if handle:
        signal.signal(signal.SIGINT, on_sigint)
    try:
        asyncio.set_event_loop(loop)
        main_task = loop.create_task(coro)
        try:
            return loop.run_until_complete(main_task)
        except asyncio.CancelledError:
            if interrupts:
                raise KeyboardInterrupt() from None
            raise
    finally:
        try:
            _cancel_all_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
            if handle:
                quiet = interrupts and _QUIET_AFTER_INTERRUPT
                signal.signal(signal.SIGINT, signal.SIG_IGN if quiet else signal.default_int_handler)


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """What `asyncio.run` does with the tasks left when its main task ends: cancel them and
    wait for them, reporting any that failed other than by being cancelled."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during run_async() shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )


def make_uvicorn_config(
    app: Any, host: str, port: int, *, stack: str | None = None, limits: HeadLimits | None = None, **kwargs: Any
) -> uvicorn.Config:
    """A uvicorn config for `stack` (see `stack_settings`) with no access log. Its HTTP
    protocol bounds request heads (`mlxproxy.edge.limits`, hooked into uvicorn by `_compat_uvicorn`): `limits`, else the app's own
    `head_limits` attribute, else the defaults."""
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("access_log", False)
    kwargs.setdefault("lifespan", "on")
    kwargs.setdefault("timeout_keep_alive", 30)
    # uvicorn's X-Forwarded-* middleware rewrites scope["client"] and ["scheme"], which no
    # app here reads; it would be one more coroutine layer that every resumption of every
    # request passes through (the headers themselves are still forwarded unchanged)
    kwargs.setdefault("proxy_headers", False)
    loop, http = stack_settings(stack)
    limits = limits or getattr(app, "head_limits", None) or HeadLimits()
    return uvicorn.Config(app, host=host, port=port, loop=loop, http=protocol_class(http, limits), **kwargs)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind a listening TCP socket; port 0 picks a free port (read it with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio's transports switch Nagle's algorithm off (TCP_NODELAY) only
    # for sockets whose `proto` is IPPROTO_TCP, and accepted sockets inherit the listener's
    # proto. With proto 0 every small write (an SSE event, a response head) waited for the
    # client's delayed ACK, ~40 ms on Linux, on the standard loop; uvloop sets TCP_NODELAY
    # whatever the proto, which is why only the plain stack showed it.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # and on the listener too, for loops that do not set it per connection (Linux and macOS
    # copy it to each accepted socket)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Serve `app` on host:port (0 = any free port) in a daemon thread.

    Use as a context manager; `url` is `http://host:port` once started. `stop()` asks
    uvicorn to shut down gracefully and waits for the thread.
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, *, stack: str | None = None, **uvicorn_kwargs: Any
    ) -> None:
        self.app = app
        self.host = host
        self.stack = stack
        self.sock = bind_socket(host, port)
        self.port: int = self.sock.getsockname()[1]
        self.config = make_uvicorn_config(app, host, self.port, stack=stack, **uvicorn_kwargs)
        self.server = uvicorn.Server(self.config)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        loop = new_event_loop(self.stack)
        asyncio.set_event_loop(loop)
        self.loop = loop
        try:
            loop.run_until_complete(serve(self.server, self.sock))
        except BaseException as exc:  # reported by start()/stop()
            self.error = exc
        finally:
            loop.close()

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)  # readiness poll, not a measurement
        if not self.server.started:
            raise RuntimeError(f"server on port {self.port} did not start: {self.error!r}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(app: Any, host: str, port: int, *, stack: str | None = None, **uvicorn_kwargs: Any) -> None:
    """Serve `app` in the foreground until Ctrl-C / SIGTERM."""
    sock = bind_socket(host, port)
    config = make_uvicorn_config(app, host, sock.getsockname()[1], stack=stack, **uvicorn_kwargs)
    run_server(uvicorn.Server(config), sock, stack=stack)


def run_server(server: uvicorn.Server, sock: socket.socket, *, stack: str | None = None) -> None:
    """Run a uvicorn server on an already bound socket until it exits, on the event loop
    `stack` names (default: the one its config names)."""
    loop = new_event_loop(stack or ("fast" if server.config.loop == "uvloop" else "plain"))
    try:
        loop.run_until_complete(serve(server, sock))
    finally:
        loop.close()
