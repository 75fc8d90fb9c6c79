"""Real `ember serve` / `ember route` processes for tests (the launcher lives in benchmarks/servers.py)."""

from benchmarks.servers import LOG_DIR, ServerProcess, free_port, metric_value

__all__ = ["LOG_DIR", "ServerProcess", "free_port", "metric_value"]
