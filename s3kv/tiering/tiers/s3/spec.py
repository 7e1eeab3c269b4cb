"""The S3 tier's spec: chunk objects in the shared bucket, listed by the fleet's manifest."""

from __future__ import annotations

import logging

from s3kv.config import S3KVConfig
from s3kv.errors import ConfigError, NotFound, PermissionDenied, Transient
from s3kv.stores.s3 import S3Store
from s3kv.tiering.placement import Tier
from s3kv.tiering.tiers.s3.handler import S3Handler
from s3kv.tiering.tiers.s3.manager import S3TierManager
from s3kv.tiering.tiers.s3.settings import S3Settings
from s3kv.tiering.tiers.settings import WorkerEnv
from s3kv.tiering.tiers.spec import ManagerEnv, Run, TierPrior, TierSpec

log = logging.getLogger("s3kv.scheduler")


def check_bucket(store: S3Store, config: S3KVConfig, run: Run) -> bool:
    """Check the bucket at start-up: True if it answered. A bucket that does
    not exist or refuses us fails start-up (ConfigError, naming it); one
    that does not answer only warns (False): the replica serves from its
    local tiers meanwhile."""
    c = config
    budget = (c.s3_connect_timeout_s + c.s3_read_timeout_s) * c.s3_max_attempts + 5
    try:
        run(store.check_access(), budget)
    except NotFound as e:
        raise ConfigError(
            f"bucket: s3://{c.bucket} does not exist (endpoint {c.endpoint_url or 'AWS'})"
        ) from e
    except PermissionDenied as e:
        raise ConfigError(f"bucket: access to s3://{c.bucket} denied: {e}") from e
    except (Transient, TimeoutError) as e:
        log.warning(
            "s3kv: S3 is unreachable at start-up (%s); serving from the local tiers and "
            "retrying in the background",
            e,
        )
        return False
    return True


class S3Spec(TierSpec):
    tier = Tier.S3
    prior = TierPrior(0.1, 2e8)
    medium = "STORAGE"
    locality = "REMOTE"
    hit_source = "external_unspecified"

    def manager(self, env: ManagerEnv) -> S3TierManager | None:
        """The bucket's manager, paused (``down``) if the bucket did not answer."""
        if env.manifest is None:
            return None
        manager = S3TierManager.from_config(env.manifest, env.config)
        if env.store is not None and env.run is not None:
            manager.down = not check_bucket(env.store, env.config, env.run)
        return manager

    def settings(self, config: S3KVConfig) -> S3Settings:
        return S3Settings.from_config(config)

    def handler(self, env: WorkerEnv) -> S3Handler | None:
        """The bucket's handler wherever the worker has a store, with the
        S3 settings it was given (the config's defaults where it has none)."""
        if env.store is None:
            return None
        s = env.settings.wings.get(self.tier, S3Settings())
        if not isinstance(s, S3Settings):
            raise TypeError(f"the S3 tier's settings are {type(s).__name__}, not S3Settings")
        return S3Handler(
            env.store,
            env.codec,
            env.settings.prefix,
            range_bytes=s.range_bytes,
            executor=env.threads,
            published=env.published,
            choice=env.choices.get(self.tier),
            report=env.report,
            counters=env.counters,
        )
