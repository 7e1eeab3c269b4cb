"""vLLM general plugin: registers ``S3KVConnector`` in every vLLM process
(front end, engine core, workers). Cheap: it imports no s3kv code until
vLLM builds the connector, but for one small module that notes which cores
the process may use before vLLM's CPU worker binds its threads."""

from __future__ import annotations

CONNECTOR_NAME = "S3KVConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import s3kv.tiering.loop  # noqa: F401  (notes the process's cores before vLLM binds threads)

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "s3kv.connector.connector", CONNECTOR_NAME)
