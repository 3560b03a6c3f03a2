"""The tests' redis-server helper lives with the chaos campaign, which owns one too
(load_tests/redis_server.py); this name stays for the test modules that import it."""

from kvmesh.load_tests.redis_server import RedisServer, redis_server_binary

__all__ = ["RedisServer", "redis_server_binary"]
