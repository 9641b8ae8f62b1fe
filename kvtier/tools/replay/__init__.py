"""kvtier.tools.replay: replay real LLM serving traces through a real store and compare with the offline optimum.

Rooms: traces.py (readers), workload.py (parsed traces, replay order, keys), hbm.py (the engine's prefix
cache), service.py (service times), replayer.py (the virtual-clock replay), opt.py (infinite cache and
Belady's optimum), sizing.py (model bytes, capacities), sweep.py (policies x capacities), report.py (table,
JSON), plot.py (PNG), cli.py (`kvtier replay`, `kvtier demo`).
"""
