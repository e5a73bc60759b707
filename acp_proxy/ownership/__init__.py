"""Process ownership: which processes acp-proxy may signal, and the one way it does.

No other package module sends a signal. Every signal goes through this package,
after live evidence that the target is a process acp-proxy started; the one kill
without a per-process check is ``cgroup.kill`` on a cgroup acp-proxy made for a
tree (``cgroups``), every member of which descends from that tree's wrapper.
The per-lease wrapper program it launches (``wrappers/adapter_wrapper.py``, a
separate process) signals nothing but its own descendants.
"""
