"""Process ownership: which processes acp-proxy may signal, and the one way it does.

No other package module sends a signal. Every signal goes through this package,
after live evidence that the target is a process acp-proxy started.
The per-lease wrapper program it launches (``wrappers/adapter_wrapper.py``, a
separate process) signals nothing but its own descendants.
"""
