"""Pool transports: how block bytes move between this process and a kvtier-pool.

``connect(endpoint, block_bytes)`` says hello and picks one (kvtier/transport/dial.py); each module is
one data path behind the PoolConnection protocol (base.py): stream.py (raw TCP received in place), tcp.py
(zmq frames), shm.py (the node pool's shared-memory file), rdma.py (pyverbs, optional), each registered in one
table (registry.py: ``register_transport`` adds one; a pool offers what it lists: ``pool_offers``).
"""

from kvtier.transport.base import PoolConnection, PoolError, PoolInfo, PoolProtocolError, PoolRefused, PoolUnavailable
from kvtier.transport.dial import connect
from kvtier.transport.registry import Transport, pool_offers, register_transport

__all__ = ["PoolConnection", "PoolError", "PoolInfo", "PoolProtocolError", "PoolRefused", "PoolUnavailable",
           "Transport", "connect", "pool_offers", "register_transport"]
