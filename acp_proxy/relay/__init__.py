"""The gateway connection: its route table, the adapter->gateway relay, the writer."""
