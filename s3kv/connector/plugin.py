"""vLLM general plugin: registers ``S3KVConnector`` in every vLLM process
(front end, engine core, workers). Cheap: it imports no s3kv code until
vLLM builds the connector, but for two small modules: one notes which cores
the process may use before vLLM's CPU worker binds its threads, the other
gives the front end a journal of the ranks' last stores to publish at exit."""

from __future__ import annotations

CONNECTOR_NAME = "S3KVConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import s3kv.tiering.loop  # noqa: F401  (notes the process's cores before vLLM binds threads)
    from s3kv.manifest.journal import start_front_end

    start_front_end()  # in the process that outlives the engine: see s3kv.manifest.journal

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "s3kv.connector.connector", CONNECTOR_NAME)
