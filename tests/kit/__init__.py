"""A small kit for driving an ACP agent over stdio as a gateway does, and for finding what it left running.

``tests.kit.gateway``: the gateway's end of a connection (``Gateway`` on anyio,
``SyncGateway`` blocking). ``tests.kit.markers``: live processes whose
environment carries a marker. ``tests.kit.proctree``: samples of the live process
trees, the adapter trees of a run by lease or the tree under one pid. ``tests.kit.state``: a
state database read and prepared from outside. The tests, the soak, the benchmarks, the demo and
the peer checks all use them. They are the gateway's side, so they live beside the
package, not in it: a gateway ends the children it starts, and the proxy itself
signals nothing except through ``acp_proxy.ownership``.
"""
