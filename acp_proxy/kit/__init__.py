"""A small kit for driving an ACP agent over stdio as a gateway does, and for finding what it left running.

``acp_proxy.kit.gateway``: the gateway's end of a connection (``Gateway`` on anyio,
``SyncGateway`` blocking). ``acp_proxy.kit.markers``: live processes whose
environment carries a marker. The examples, tests, soak, benchmarks and the peer
checks all use them; nothing in the proxy itself does.
"""
