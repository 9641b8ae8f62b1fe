"""What the two daemons (kvtier-pool: kvtier.pool, kvtier-master: kvtier.master) share, and only they: the start-up
of their command lines (startup.py: logging, signals, the ready file, the owner token) and the metrics endpoint
(metrics_http.py)."""
