"""s3kv: a KV cache for vLLM in a hierarchy GPU -> CPU -> NVMe -> S3, shared by
replicas through object storage. The vLLM connector is
``s3kv.connector.S3KVConnector``; everything else here is free of vLLM."""

__version__ = "0.1.0"
DISTRIBUTION = "vllm-s3kv"
"""The name pip knows s3kv by (``s3kv`` on PyPI is an unrelated project)."""
