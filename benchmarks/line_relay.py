"""A bare line relay: what a relay built from the proxy's own parts costs before any bookkeeping.

The "bare relay" rows of ``benchmarks/tasks.py`` run their turns through this
process. It starts the agent named after ``--`` (a plain child with pipes: no
wrapper, no lease, no state dir) and forwards lines both ways on one anyio event
loop (asyncio, or trio with ``--async-backend trio``), using what the proxy uses:
non-blocking fd streams (``acp_proxy.stdio``), ``LineReader`` batches, a msgspec
envelope decode of every line (``jsonrpc.decode_line``), and each batch written on
as it was read (``LineWriter``). No ids are remapped, no sessions or tasks kept, no
database touched, nothing logged. At the gateway's EOF it closes the agent's
stdin and exits with the agent.

    python benchmarks/line_relay.py [--async-backend asyncio|trio] -- AGENT ARGV...
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import anyio
import anyio.to_thread
from anyio.abc import ByteReceiveStream, ByteSendStream

from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import LineReader, LineWriter
from acp_proxy.stdio import FdReceiveStream, FdSendStream, enlarge_pipe


async def forward(source: ByteReceiveStream, sink: ByteSendStream) -> None:
    """Every batch of lines from ``source`` to ``sink``, each line's envelope decoded on the way."""
    reader, writer = LineReader(source), LineWriter(sink)
    while True:
        try:
            batch = await reader.receive_batch()
        except anyio.EndOfStream:
            return
        for line in batch.lines:
            jsonrpc.decode_line(line)
        await writer.send(batch.block)


async def relay(agent: subprocess.Popen[bytes]) -> int:
    assert agent.stdin is not None
    assert agent.stdout is not None
    to_agent = FdSendStream(agent.stdin.fileno())
    from_agent = FdReceiveStream(agent.stdout.fileno())
    gateway_in, gateway_out = FdReceiveStream(0), FdSendStream(1)
    enlarge_pipe(1)
    async with anyio.create_task_group() as tasks:

        async def upstream() -> None:
            await forward(gateway_in, to_agent)
            agent.stdin.close()  # type: ignore[union-attr]

        tasks.start_soon(upstream)
        await forward(from_agent, gateway_out)
        tasks.cancel_scope.cancel()
    return await anyio.to_thread.run_sync(agent.wait)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("agent", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.agent[1:] if args.agent[:1] == ["--"] else args.agent
    if not argv:
        parser.error("give the agent's command after --")
    agent = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return anyio.run(relay, agent, backend=args.async_backend)


if __name__ == "__main__":
    sys.exit(main())
