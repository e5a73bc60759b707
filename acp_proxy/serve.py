"""The composition root: wires the layers for one ``acp-proxy`` process (``main`` runs it).

Everything below is built here, once, each object after those it needs, and handed
what it needs in its constructor; nothing is assigned to an object afterwards. What
must go upward is pulled where it can be: new adapters reach the relay through a
channel, a gateway that closed our output and a signal stop the connection through
tasks started here. Two calls go up, callables made or picked here: the pool asking
the sessions to suspend one (``suspend``), and the task book handing a turn past its
deadline to the sessions (``intents.expire_turn``, given to the task that watches).

    protocol -> state, config -> ownership -> tasks -> pool -> sessions -> relay -> operator -> serve
"""

from __future__ import annotations

import functools
import logging
import math
import signal
import time
from pathlib import Path

import anyio

from acp_proxy.concurrency import Background, Stopping
from acp_proxy.config import Config
from acp_proxy.early_signals import EARLY_SIGNALS
from acp_proxy.journal import SuspendReason
from acp_proxy.operator.operations import InstallPeers, Operations, ServedProxy
from acp_proxy.ownership.owner import Owner
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.pool.running import WarmStart
from acp_proxy.relay.adapters import AdapterRelay
from acp_proxy.relay.attached import Links
from acp_proxy.relay.gateway import GatewayConnection
from acp_proxy.relay.sharing import Sharing
from acp_proxy.relay.upstream import AgentRequests
from acp_proxy.relay.writer import GatewayWriter
from acp_proxy.sessions.ceilings import MemoryCeilings
from acp_proxy.sessions.intents import SessionIntents
from acp_proxy.sessions.leftovers import clear_periodically
from acp_proxy.sessions.registry import SessionRegistry, titles_of
from acp_proxy.sessions.retention import retire_suspended
from acp_proxy.sessions.table import SessionTable
from acp_proxy.sessions.transcript import Transcripts
from acp_proxy.stdio import FdReceiveStream, FdSendStream, enlarge_pipe
from acp_proxy.tasks.notify import Notifier
from acp_proxy.tasks.records import TaskRegistry
from acp_proxy.tasks.turns import TurnBook
from acp_proxy.trace import Trace

log = logging.getLogger("acp_proxy.proxy")


async def serve_gateway(
    config: Config,
    owner: Owner,
    gateway_in: anyio.abc.ByteReceiveStream,
    gateway_out: anyio.abc.ByteSendStream,
    *,
    backend: str | None = None,
    warm: WarmStart | None = None,
    trace: Trace | None = None,
) -> None:
    """Serve one gateway connection until it leaves or a signal, then shut down cleanly.

    ``warm`` is an adapter launched before the event loop started, so that its
    start-up overlapped ours; the first request that needs an adapter adopts it.
    """
    owner.db.defer_checkpoints()  # the checkpoints' fsyncs run in a worker thread (TurnBook.watch)
    stopping = Stopping()
    registry = SessionRegistry(owner.db, owner.instance_id)
    for session_id in registry.adopt_orphans():
        log.info("session %s: left live by a proxy that is gone; suspended, resumable", session_id)
    transcripts = Transcripts(owner.db.state_dir, config.attach.transcript_max_bytes)

    def prune_also(retention: float) -> int:
        """With the tasks' pruning: old transcripts go, sessions suspended past ``keep_suspended`` are closed."""
        transcripts.prune(retention, registry.existing)
        retire_suspended(registry, owner.journal, config.sessions.keep_suspended)
        return registry.prune_deleted(retention)

    async with anyio.create_task_group() as tasks:
        background = Background(tasks, owner.db.path)
        # Built in the order each needs the one before. What goes back up is pulled, not called: new
        # adapters reach the relay through a channel (``started``), a gateway that closed its output is
        # an event (``stop_when_closed``). One call goes up: the pool suspends the idle session its plan
        # chose (``suspend``, a callable over the intents, bound further down), in the same step as the
        # choice, with no point in between where another task could take the session.
        intents: SessionIntents | None = None

        def suspend(session_id: str, why: str, reason: SuspendReason) -> bool:
            assert intents is not None
            return intents.suspend(session_id, why, reason)

        started, new_adapters = anyio.create_memory_object_stream[Adapter](math.inf)
        writer = GatewayWriter(gateway_out, stopping, trace=trace)
        peers = InstallPeers(owner.db)
        pool = ProcessPool(
            config,
            owner,
            background,
            stopping,
            default_backend=config.backend(backend),
            warm=warm,
            suspend=suspend,
            started=started,
            peers=peers,
            trace=trace,
        )
        table = SessionTable(registry, background, pool.changed, on_bound=pool.recency.note_bound)
        title_of = functools.partial(session_title, table)
        notifier = Notifier.for_tasks(config.tasks, owner.instance_id, owner.journal, title_of=title_of)
        turns = TurnBook(
            TaskRegistry(owner.db, owner.instance_id),
            config,
            stopping,
            prune_also=prune_also,
            session_info=registry.record_title,
            notifier=notifier,
            timings=owner.timings,
            titles=titles_of,
        )
        turns.maintain()
        intents = SessionIntents(config, registry, table, pool, turns, writer, background, stopping, holders=peers)
        requests = AgentRequests(pool, turns)
        sharing = Sharing(
            config, owner.instance_id, intents, transcripts, writer, background, requests, owner.journal, notifier
        )
        relay = AdapterRelay(config, pool, turns, intents, writer, background, stopping, sharing, requests)
        links = Links(
            config,
            owner.db.state_dir,
            registry,
            sharing,
            writer,
            background,
            requests.new_id,
            lambda: pool.client_init,
        )
        ceilings = MemoryCeilings(config, intents, background)
        gateway = GatewayConnection(
            config,
            pool=pool,
            intents=intents,
            relay=relay,
            turns=turns,
            registry=registry,
            writer=writer,
            background=background,
            stopping=stopping,
            sharing=sharing,
            links=links,
        )
        operations = Operations(ServedProxy(config, owner, pool, turns, intents, stopping, time.time(), sharing))
        tasks.start_soon(relay.follow, new_adapters)
        tasks.start_soon(stop_on_signals, gateway)
        tasks.start_soon(stop_when_closed, writer, gateway)
        tasks.start_soon(pool.processes.suspend_idle)
        tasks.start_soon(pool.processes.publish_slots)
        tasks.start_soon(pool.memory.keep)
        tasks.start_soon(ceilings.watch, pool)
        tasks.start_soon(turns.watch, intents.expire_turn, background.start)
        tasks.start_soon(operations.serve)
        tasks.start_soon(transcripts.keep_flushing)
        if config.ownership.reap_interval > 0:
            interval, grace = config.ownership.reap_interval, config.shutdown.term_grace
            tasks.start_soon(clear_periodically, owner, interval, grace, stopping, notifier)
        if notifier is not None:
            tasks.start_soon(notifier.run)
        await gateway.run(gateway_in)
        if notifier is not None:
            await notifier.drain()  # what the shutdown settled is told too, within a short grace
        tasks.cancel_scope.cancel()
    transcripts.close()


def session_title(table: SessionTable, session_id: str) -> str | None:
    """A session's title as this proxy holds it, read from no database."""
    session = table.get(session_id)
    return session.record.title if session is not None else None


async def stop_when_closed(writer: GatewayWriter, gateway: GatewayConnection) -> None:
    """The gateway closed its end of our output: nothing more can reach it, so stop."""
    await writer.closed_by_gateway.wait()
    gateway.stop("gateway closed its output")


async def stop_on_signals(gateway: GatewayConnection) -> None:
    """SIGTERM, SIGINT and SIGHUP all mean: shut down cleanly and exit 0."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        if EARLY_SIGNALS:  # arrived while the adapter was being launched, before the loop ran
            gateway.stop(f"received {signal.Signals(EARLY_SIGNALS[0]).name}")
        async for signum in signals:
            gateway.stop(f"received {signal.Signals(signum).name}")


async def serve_stdio(config: Config, owner: Owner, backend: str | None, warm: WarmStart | None) -> int:
    """Serve ACP on this process's stdin/stdout."""
    gateway_in, gateway_out = FdReceiveStream(0), FdSendStream(1)
    enlarge_pipe(1)  # fewer, larger writes to the gateway while updates stream
    trace = Trace(Path(config.trace.file), config.trace.max_size) if config.trace.file else None
    try:
        await serve_gateway(config, owner, gateway_in, gateway_out, backend=backend, warm=warm, trace=trace)
    finally:
        await gateway_in.aclose()
        await gateway_out.aclose()
        if trace is not None:
            trace.close()
    return 0
