"""kvtier-pool: a node's DRAM served to other nodes and to engine processes on the same host.

* ``server.py``  PoolServer: zmq ROUTER + proxy + worker threads, signal handling, the ready file;
* ``state.py``   PoolState: the DRAM tier (shared-memory backed in standalone mode), leases, the node agent;
* ``ops.py``     the ops (hello, contains, remove, put, get, reserve/commit, acquire/release, stats);
* ``protocol.py`` op names and field layouts (kvtier.wire's envelope, block bytes as extra frames);
* ``leases.py``  what shared-memory and RDMA clients hold between two requests, with expiry;
* ``cli.py``     the ``kvtier-pool`` command.

Clients: kvtier.transport (one module per data path) and kvtier.tiers.pool.PoolTier (in a TieredStore).
"""
