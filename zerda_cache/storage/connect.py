"""Clients for a URL, with zerda-cache's timeouts: the same options for every flavour."""

from __future__ import annotations

from typing import Any

from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from zerda_cache.core.config import CacheConfig

#: Seconds between the health checks (PING) of an idle pooled connection.
HEALTH_CHECK_INTERVAL_S = 30
#: What the one quick retry is for: a pooled connection the server closed meanwhile (a
#: restart, an idle timeout). Never a timeout: retrying one would double the fail-open
#: bound (a lookup would take 2 x redis_timeout_s before it returned its miss).
RETRY_ON = (RedisConnectionError,)
#: Connections of an asyncio client's pool. The pool blocks (up to ``redis_timeout_s``)
#: when all are in use: redis-py's default asyncio pool raises "Too many connections" at
#: once, which would turn a burst of concurrent lookups into fail-open misses.
ASYNC_MAX_CONNECTIONS = 100


def client_options(
    url: str, config: CacheConfig, cluster: bool | None = None
) -> tuple[str, bool, dict[str, Any]]:
    """The URL (a ``+cluster`` scheme suffix removed), whether it is a Redis Cluster, and
    zerda-cache's client options: socket timeouts of ``redis_timeout_s``, one quick retry
    without backoff after a dropped connection (never after a timeout, so that a lookup
    fails open within one ``redis_timeout_s``), and health checks of
    idle connections (redis-py's sync ``RedisCluster`` drops that one option: its node
    connections take no ``health_check_interval``)."""
    scheme, sep, rest = url.partition("://")
    if scheme.endswith("+cluster"):
        cluster = True
        url = scheme.removesuffix("+cluster") + sep + rest
    timeout = config.redis_timeout_s
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
    }
    return url, bool(cluster), options


def connect(
    url: str, config: CacheConfig, *, cluster: bool | None = None, asyncio: bool = False
) -> Any:
    """A redis-py client for ``url``: ``redis://``, ``rediss://`` (TLS), ``unix://``, with
    an ACL user and password in the URL as usual; ``cluster=True`` or a ``+cluster``
    scheme (``redis+cluster://``) gives a Redis Cluster client; a ``+sentinel`` scheme
    (``redis+sentinel://[user:password@]host:port,host:port/service[/db]``) the primary of
    a Sentinel group, found again after a failover. ``asyncio=True`` gives the
    ``redis.asyncio`` flavour, with the same options."""
    if url.partition("://")[0].endswith("+sentinel"):
        return _sentinel_primary(url, config, asyncio=asyncio)
    url, is_cluster_url, options = client_options(url, config, cluster)
    if asyncio:
        import redis.asyncio
        import redis.asyncio.cluster
        import redis.asyncio.retry

        options["retry"] = redis.asyncio.retry.Retry(NoBackoff(), 1, RETRY_ON)
        if not is_cluster_url:
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                url,
                max_connections=ASYNC_MAX_CONNECTIONS,
                timeout=config.redis_timeout_s,
                **options,
            )
            return redis.asyncio.Redis.from_pool(pool)
        cls: Any = redis.asyncio.cluster.RedisCluster
    else:
        import redis
        import redis.cluster
        import redis.retry

        options["retry"] = redis.retry.Retry(NoBackoff(), 1, RETRY_ON)
        cls = redis.cluster.RedisCluster if is_cluster_url else redis.Redis
    return cls.from_url(url, **options)


def _sentinel_primary(url: str, config: CacheConfig, *, asyncio: bool) -> Any:
    """The primary of the Sentinel group a ``redis+sentinel://`` URL names."""
    from urllib.parse import unquote, urlsplit

    scheme, _, rest = url.partition("://")
    parts = urlsplit("redis://" + rest)
    creds, _, hostlist = parts.netloc.rpartition("@")
    path = [p for p in parts.path.split("/") if p]
    if not hostlist or not path:
        raise ValueError(
            f"a sentinel URL needs hosts and a service: "
            f"{scheme}://[user:password@]host:port[,host:port]/service[/db], got {url!r}"
        )
    sentinels = []
    for item in hostlist.split(","):
        host, _, port = item.rpartition(":")
        sentinels.append((host or item, int(port) if host else 26379))
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    user, _, password = creds.partition(":")
    _, _, options = client_options("redis://x", config)
    options.update(db=db, username=unquote(user) or None, password=unquote(password) or None)
    if scheme.startswith("rediss"):
        options["ssl"] = True
    timeouts = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout")}
    if asyncio:
        import redis.asyncio.retry
        import redis.asyncio.sentinel

        options["retry"] = redis.asyncio.retry.Retry(NoBackoff(), 1, RETRY_ON)
        group: Any = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            sentinels, sentinel_kwargs=timeouts
        )
    else:
        import redis.retry
        import redis.sentinel

        options["retry"] = redis.retry.Retry(NoBackoff(), 1, RETRY_ON)
        group = redis.sentinel.Sentinel(sentinels, sentinel_kwargs=timeouts)  # type: ignore[no-untyped-call, unused-ignore]
    return group.master_for(service, **options)
