"""What operators use: the CLI, the control socket and the operations a running proxy serves, reports."""
