"""The vLLM-facing adapter. Every vLLM import of s3kv lives in this package.

``kv_connector_module_path: "s3kv.connector"`` with ``kv_connector:
"S3KVConnector"`` loads the class from here; the ``vllm.general_plugins``
entry point (:mod:`s3kv.connector.plugin`) registers the same name in every
vLLM process.
"""

from s3kv.connector.connector import S3KVConnector

__all__ = ["S3KVConnector"]
