"""The wire: JSON-RPC framing and envelopes, the ACP method table, the proxy's named errors.

The bottom layer. It knows bytes and messages, never processes, sessions or the database.
"""
