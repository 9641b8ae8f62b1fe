"""kvtier-pool: a node's DRAM served to other nodes and to engine processes on the same host.

The folder pool/ is the package kvtier.pool (setup.py's ROOTS), a daemon beside master/ (kvtier.master): what it
shares with its clients is kvtier.wire (the pool protocol is kvtier/wire/pool.py), never kvtier.transport's
internals (tests/test_layering.py).

* ``server.py``  PoolServer: zmq ROUTER + worker threads, signal handling, shutdown, the ready file;
* ``dispatch.py`` Dispatcher: who sent each request, per-client queues taken in turn, busy past the bounds;
* ``clients.py`` Client: a request's sender (key, address, session; roles hang off it), session tokens;
* ``sizing.py``  the smallest block a client may set, the most slots a pool keeps;
* ``budget.py``  Budget: the memory budget beyond the capacity and the held budget of unevictable slots;
* ``state.py``   PoolState: the DRAM tier (shared-memory backed in standalone mode), leases, budgets, agent;
* ``ops.py``     the ops (hello, contains, remove, put, get, reserve/commit, acquire/release, stats);
* ``offers.py``  what the hello offers: each transport of the transports' table over a service this pool serves;
* ``leases.py``  what shared-memory and RDMA clients hold between two requests, owned, with expiry;
* ``replicas.py`` pool-to-pool copies (hot-block replication, ``copy_from``): the pool as a client of a pool;
* ``rdma.py``    RdmaServer: the DRAM registered for one-sided RDMA, a queue pair per client;
* ``stream.py``, ``admission.py`` the raw TCP data port: serving messages, and who is admitted to it;
* ``ports.py``   the zmq port: open-files limit, the ipc socket's mode, the handshake watch;
* ``metrics.py`` Prometheus metrics (``--metrics-port``);
* ``cli.py``     the ``kvtier-pool`` command;
* ``process.py`` PoolDaemon: a pool started as a subprocess by a tool (the benches, ``kvtier replay --pool``).

Clients: kvtier.transport (one module per data path) and kvtier.tiers.pool.PoolTier (in a TieredStore).
"""
