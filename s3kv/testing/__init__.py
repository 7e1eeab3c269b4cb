"""Harness for the tests, the benchmarks and the demo; the connector and the
``s3kv`` tools for a bucket never import it.

- :mod:`s3kv.testing.loopback_s3`: moto's S3 server in a child process on
  127.0.0.1 (objects in memory; not a store for production data).
- :mod:`s3kv.testing.latency_proxy`: a loopback proxy in front of it that
  delays each object GET's first byte (a distant bucket) or plays an S3
  Express directory bucket.
- :mod:`s3kv.testing.replica`: the replica tool, one vLLM engine process
  running a spec of prompts (the engine side is
  :mod:`s3kv.connector.replica`, as vLLM is imported only there).
- :mod:`s3kv.testing.chunks`: the S3 object a transfer engine stores a
  chunk under, for tests that read or tamper with it.
- :mod:`s3kv.testing.pages`: pages as functions, for tests and benchmarks
  that load chunks without a KV cache.
"""
