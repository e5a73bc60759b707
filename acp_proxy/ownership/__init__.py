"""Process ownership: which processes acp-proxy may signal, and the one way it does.

No other package module sends a signal. Every signal goes through this package,
after live evidence that the target is a process acp-proxy started.
"""
