output "json" {
  description = "The JSON for `vllm serve --kv-transfer-config` (and `s3kv gc --config`)."
  value       = jsonencode(local.kv_transfer_config)

  precondition {
    condition     = length(local.unknown_keys) == 0
    error_message = "extra_config: unknown s3kv config key(s) ${join(", ", local.unknown_keys)}; known keys: ${join(", ", local.connector_keys)}."
  }

  precondition {
    condition     = length(local.shadowed_keys) == 0
    error_message = "extra_config: remove ${join(", ", local.shadowed_keys)}; the module sets bucket, prefix and region itself."
  }
}

output "kv_connector_extra_config" {
  description = "The `kv_connector_extra_config` object alone."
  value       = local.kv_connector_extra_config
}
