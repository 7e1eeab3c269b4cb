locals {
  # The field names of S3KVConfig in s3kv/config.py (KNOWN_KEYS). s3kv rejects
  # any other key at start-up, so an unknown one fails here, at plan time.
  # tests/infra/test_terraform.py fails when this list and KNOWN_KEYS differ.
  connector_keys = [
    "bucket",
    "prefix",
    "region",
    "endpoint_url",
    "addressing_style",
    "bucket_kind",
    "chunk_tokens",
    "codec",
    "zstd_level",
    "max_inflight_bytes",
    "load_timeout_s",
    "range_bytes",
    "max_connections",
    "s3_client",
    "s3_max_attempts",
    "s3_connect_timeout_s",
    "s3_read_timeout_s",
    "cpu_bytes",
    "disk_path",
    "disk_codec",
    "disk_bytes",
    "disk_fsync",
    "disk_timeout_s",
    "shutdown_flush_s",
    "write_policy",
    "promote",
    "load_policy",
    "prefetch_bytes",
    "save_generated",
    "manifest_publish_s",
    "manifest_refresh_s",
    "manifest_clock_skew_s",
    "manifest_max_bytes",
    "manifest_protocol",
    "model_digest",
    "namespace_salt",
    "chunk_keys",
    "share_across_tp",
    "auth_key_file",
  ]

  # Set by this module from the bucket it describes; extra_config may not override them.
  module_keys = ["bucket", "prefix", "region"]

  unknown_keys  = [for key in keys(var.extra_config) : key if !contains(local.connector_keys, key)]
  shadowed_keys = [for key in keys(var.extra_config) : key if contains(local.module_keys, key)]

  kv_connector_extra_config = merge(var.extra_config, {
    bucket = var.bucket
    prefix = var.prefix
    region = var.region
  })

  kv_transfer_config = {
    kv_connector              = "S3KVConnector"
    kv_role                   = var.kv_role
    kv_load_failure_policy    = var.kv_load_failure_policy
    kv_connector_extra_config = local.kv_connector_extra_config
  }
}
