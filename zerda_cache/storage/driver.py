"""One flow, two drivers: how a flow written once runs over sync and asyncio clients.

A *flow* is a generator that does no I/O itself. Whenever it needs the outside world (a
pipeline to execute, a script to run, an ``embed_fn`` to call, a lock to take) it yields
a *step*: a call with no arguments. The driver makes the call and sends the result back
into the flow (or throws the call's exception into it, at the ``yield``). The asyncio
driver awaits a step's result when it is awaitable; the sync driver refuses one, with an
error that names the async flavour. Everything else (validation, plans, parsing, ranking,
index upkeep, error wrapping) is the flow's, and so is written once. The shape is that of
h11 and httpcore: the protocol is a state machine, the I/O is at its edge.

``op`` turns a flow method into the public method of both flavours: on a ``SyncDriven``
object it returns the flow's result, on an ``AsyncDriven`` one an awaitable of it, and
mypy sees both signatures.

Background work (a replica's index build) is a flow too: ``spawn`` runs it in a daemon
thread (sync flavour) or as a task of the event loop (asyncio), and the ``Job`` it returns
gives a step that waits for it with a timeout, so a flow can wait for another one a
bounded time without knowing which driver runs either.

Only this package's modules build steps that touch a Redis client.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

import redis.exceptions

from zerda_cache.core.errors import FencedError, StorageError, StorageUnavailable, ZerdaError

T = TypeVar("T")
P = ParamSpec("P")

#: A call the driver makes for a flow: its result (awaited, if the driver is async and
#: the result is awaitable) is sent back into the flow.
Step = Callable[[], Any]
#: A flow: yields steps, returns its result.
Flow = Generator[Step, Any, T]


#: Client errors that say the server cannot be used at all for now (an outage), not that
#: one command failed on its keys: ``StorageUnavailable``. ``ConnectionError`` covers a
#: refused or lost connection, authentication, too many clients and LOADING;
#: ``ClusterDownError`` covers MASTERDOWN too.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    TimeoutError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
)
#: Reply errors of the same kind that redis-py has no class for: a script running past
#: busy-reply-threshold holds every other command.
UNAVAILABLE_REPLIES = ("BUSY ",)


def unavailable(exc: BaseException) -> bool:
    """Does the client error ``exc`` say that Redis cannot be used for now?"""
    if isinstance(exc, UNAVAILABLE):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(
        UNAVAILABLE_REPLIES
    )


@contextlib.contextmanager
def wrap_errors(what: str) -> Iterator[None]:
    """Turn client errors (and socket timeouts) into ``StorageError``; the cause stays
    chained. Used around the steps of a flow: the driver throws a step's exception into
    the flow at its ``yield``, inside this block.

    Redis being out of reach (``unavailable``) is ``StorageUnavailable``; a refused
    fence is ``FencedError``; any other reply error (a script's error, WRONGTYPE: the
    data of the keys the command touched) is a plain ``StorageError``, which a caller
    going over tenants takes as that tenant's failure, not as an outage."""
    try:
        yield
    except ZerdaError:
        raise
    except (TimeoutError, redis.exceptions.RedisError) as exc:
        raise storage_error(what, exc) from exc


def storage_error(what: str, exc: BaseException) -> StorageError:
    """The ``StorageError`` of the client error ``exc`` (raised, or a pipeline's reply)
    of ``what``: ``StorageUnavailable``, ``FencedError`` or a plain one, as
    ``wrap_errors`` tells them apart. The caller chains ``exc`` (``raise ... from``)."""
    if unavailable(exc):
        return StorageUnavailable(f"{what} failed: {exc}")
    if isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("FENCED"):
        return FencedError(f"{what} refused: {exc}")
    return StorageError(f"{what} failed: {exc}")


class _Run:
    """One flow being driven: the value (or exception) to resume it with, and finally its
    result. The two drivers differ only in how they make a step's call."""

    __slots__ = ("flow", "resume", "value")

    def __init__(self, flow: Flow[Any]) -> None:
        self.flow = flow
        self.resume: Callable[[Any], Step] = flow.send
        self.value: Any = None

    def next_step(self) -> Step | None:
        """The flow's next step; ``None`` once it returned (its result is ``value``)."""
        try:
            return self.resume(self.value)
        except StopIteration as stop:
            self.value = stop.value
            return None

    def call(self, step: Step, *, awaitable_ok: bool) -> Awaitable[Any] | None:
        """Make the step's call; an awaitable result is returned for the caller to await
        (or refused), any other result or exception is kept to resume the flow with."""
        try:
            value = step()
        except BaseException as exc:  # into the flow: its finally/except blocks run
            self.failed(exc)
            return None
        if inspect.isawaitable(value):
            if awaitable_ok:
                return value
            self.failed(_refuse_awaitable(value))
            return None
        self.value, self.resume = value, self.flow.send
        return None

    def failed(self, exc: BaseException) -> None:
        self.value, self.resume = exc, self.flow.throw


def run_sync(flow: Flow[T]) -> T:
    """Drive ``flow`` to its result, making each step's call in this thread."""
    run = _Run(flow)
    while (step := run.next_step()) is not None:
        run.call(step, awaitable_ok=False)
    return run.value  # type: ignore[no-any-return]


async def run_async(flow: Flow[T]) -> T:
    """Drive ``flow`` to its result, awaiting each step's result when it is awaitable."""
    run = _Run(flow)
    while (step := run.next_step()) is not None:
        pending = run.call(step, awaitable_ok=True)
        if pending is not None:
            try:
                run.value, run.resume = await pending, flow.send
            except BaseException as exc:  # CancelledError too: the flow's finally blocks run
                run.failed(exc)
    return run.value  # type: ignore[no-any-return]


def _refuse_awaitable(value: Awaitable[Any]) -> TypeError:
    if inspect.iscoroutine(value):
        value.close()  # never awaited: close it rather than leave a warning behind
    return TypeError(
        f"a synchronous cache got an awaitable ({type(value).__name__}) from its client or "
        "embed_fn: use AsyncCacheManager / AsyncRedisStorage with redis.asyncio clients "
        "and async embed functions"
    )


class Job(Protocol):
    """A flow running in the background (``SyncDriven.spawn`` / ``AsyncDriven.spawn``)."""

    def done(self) -> bool:
        """Has the flow returned or raised?"""
        ...

    def wait(self, timeout: float | None) -> Step:
        """A step that returns once the flow is done or ``timeout`` seconds passed."""
        ...

    def error(self) -> BaseException | None:
        """What the flow raised, once done (``None``: it returned, or is still running)."""
        ...

    def cancel(self) -> None:
        """Ask the flow to stop (an asyncio task is cancelled; a thread is not: flows
        check their own stop condition)."""
        ...


class _ThreadJob:
    """A flow driven by ``run_sync`` in a daemon thread."""

    def __init__(self, flow: Flow[Any], name: str) -> None:
        self.pid = os.getpid()  # a thread does not survive fork(): see done()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(flow,), name=name, daemon=True)
        self._thread.start()

    def _run(self, flow: Flow[Any]) -> None:
        try:
            run_sync(flow)
        except BaseException as exc:  # kept for whoever waits on the job
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        # In a forked child the thread is gone and will never set the event.
        return self._done.is_set() or self.pid != os.getpid()

    def wait(self, timeout: float | None) -> Step:
        def step() -> bool:
            done = self._done.wait(timeout)
            if done and self.pid == os.getpid():
                # Past the flow's last step: the thread is leaving. Joined, so that a
                # waiter sees it gone (``close``: no build thread left at exit).
                self._thread.join(1.0)
            return done or self.done()

        return step

    def error(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        pass


class _TaskJob:
    """A flow driven by ``run_async`` as a task of the running event loop."""

    def __init__(self, flow: Flow[Any], name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(run_async(flow), name=name)
        self._task.add_done_callback(_retrieve)

    def done(self) -> bool:
        return self._task.done()

    def wait(self, timeout: float | None) -> Step:
        return lambda: asyncio.wait({self._task}, timeout=timeout)

    def error(self) -> BaseException | None:
        if not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    def cancel(self) -> None:
        self._task.cancel()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a finished task's exception as retrieved (the job reports it on demand)."""
    if not task.cancelled():
        task.exception()


class SyncDriven:
    """Mixin of the sync flavours: flows run to completion in the calling thread."""

    #: Serialises a tenant's index builds and catch-ups between threads.
    lock_factory: Callable[[], Any] = threading.Lock
    #: Awaitable results are refused (see ``run_sync``).
    is_async = False

    @staticmethod
    def drive(flow: Flow[T]) -> T:
        return run_sync(flow)

    @staticmethod
    def spawn(flow: Flow[Any], name: str) -> Job:
        """Run ``flow`` in a daemon thread."""
        return _ThreadJob(flow, name)

    @staticmethod
    def offload(fn: Callable[..., Any], *args: Any) -> Step:
        """A step that runs CPU-bound ``fn(*args)`` (in this thread: it is one already)."""
        return lambda: fn(*args)

    @staticmethod
    def pause(seconds: float) -> Step:
        """A step that sleeps ``seconds``."""
        return lambda: time.sleep(seconds)

    #: Bounds the flows that run at once (the index builds of a manager).
    semaphore_factory: Callable[[int], Any] = threading.BoundedSemaphore


class AsyncDriven:
    """Mixin of the asyncio flavours: flows run as coroutines."""

    lock_factory: Callable[[], Any] = asyncio.Lock
    is_async = True

    @staticmethod
    async def drive(flow: Flow[T]) -> T:
        return await run_async(flow)

    @staticmethod
    def spawn(flow: Flow[Any], name: str) -> Job:
        """Run ``flow`` as a task of the running event loop."""
        return _TaskJob(flow, name)

    @staticmethod
    def offload(fn: Callable[..., Any], *args: Any) -> Step:
        """A step that runs CPU-bound ``fn(*args)`` in a worker thread, so that the event
        loop (every other lookup) goes on meanwhile."""
        return lambda: asyncio.to_thread(fn, *args)

    @staticmethod
    def pause(seconds: float) -> Step:
        """A step that sleeps ``seconds`` without blocking the event loop."""
        return lambda: asyncio.sleep(seconds)

    semaphore_factory: Callable[[int], Any] = asyncio.BoundedSemaphore


class op(Generic[P, T]):
    """The public method of a flow, for both flavours.

    ``lookup = op(lookup_flow)`` in a class body: ``manager.lookup(...)`` drives
    ``manager.lookup_flow(...)`` with the object's driver and returns its result (sync) or an
    awaitable of it (asyncio).
    """

    def __init__(self, flow: Callable[Concatenate[Any, P], Flow[T]]) -> None:
        self.flow = flow
        self.__doc__ = flow.__doc__
        self.__name__ = flow.__name__.removesuffix("_flow")

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, obj: SyncDriven, owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: AsyncDriven, owner: type | None = None) -> Callable[P, Awaitable[T]]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        flow, drive = self.flow, obj.drive

        def bound(*args: Any, **kwargs: Any) -> Any:
            return drive(flow(obj, *args, **kwargs))

        bound.__doc__ = self.__doc__
        bound.__name__ = self.__name__
        return bound


def locked(lock: Any, flow: Flow[T]) -> Flow[T]:
    """Run ``flow`` holding ``lock`` (a ``threading.Lock`` or an ``asyncio.Lock``: the
    step ``lock.acquire`` blocks the thread or is awaited)."""
    yield lock.acquire
    try:
        return (yield from flow)
    finally:
        lock.release()


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Step:
    """A step that calls ``fn(*args, **kwargs)``."""
    if not args and not kwargs:
        return fn
    return lambda: fn(*args, **kwargs)


__all__ = [
    "AsyncDriven",
    "Flow",
    "Job",
    "Step",
    "SyncDriven",
    "call",
    "locked",
    "op",
    "run_async",
    "run_sync",
    "storage_error",
    "unavailable",
    "wrap_errors",
]
