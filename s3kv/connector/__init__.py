"""The vLLM-facing adapter. Every vLLM import of s3kv lives in this package.

``kv_connector_module_path: "s3kv.connector"`` with ``kv_connector:
"S3KVConnector"`` loads the class from here; the ``vllm.general_plugins``
entry point (:mod:`s3kv.connector.plugin`) registers the same name in every
vLLM process. The class is imported on first use, so that registering the
plugin costs nothing in processes that never build it.
"""

from typing import Any

__all__ = ["S3KVConnector"]


def __getattr__(name: str) -> Any:
    if name == "S3KVConnector":
        from s3kv.connector.connector import S3KVConnector

        return S3KVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
