"""Adapter processes: the connection to each, the pure plan of who may run, the pool that runs them."""
