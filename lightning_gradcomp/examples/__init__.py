"""Example models, data and runnable demos (no downloads: every task here is built in)."""
