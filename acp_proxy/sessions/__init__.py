"""Sessions: the registry (all SQL on sessions), the session table and its queues, the lifecycle intents."""
