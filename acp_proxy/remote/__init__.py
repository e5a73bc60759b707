"""``acp-proxy serve`` on the network and ``acp-proxy connect``: the install's sessions over ACP's
WebSocket and streamable HTTP transport, authenticated; nothing here is imported by a stdio proxy."""
