output "bucket_name" {
  description = "Name of the bucket (for a directory bucket the full `base--zone--x-s3` name). s3kv's `bucket` key."
  value       = local.bucket_id
}

output "bucket_arn" {
  description = "ARN of the bucket (`arn:aws:s3:::name`, or `arn:aws:s3express:region:account:bucket/name` for a directory bucket)."
  value       = local.bucket_arn
}

output "bucket_type" {
  description = "`general-purpose` or `directory`."
  value       = var.bucket_type
}

output "prefix" {
  description = "Key prefix of the cache. s3kv's `prefix` key."
  value       = var.prefix
}

output "region" {
  description = "Region of the bucket. s3kv's `region` key."
  value       = local.region
}

output "kms_key_arn" {
  description = "ARN of the KMS key that encrypts objects (null with SSE-S3)."
  value       = local.kms_key_arn
}

output "replica_policy_arn" {
  description = "ARN of the IAM policy for replicas (vLLM pods); null when create_iam_policies = false."
  value       = try(aws_iam_policy.replica[0].arn, null)
}

output "gc_policy_arn" {
  description = "ARN of the IAM policy for the `s3kv gc` job; null when create_iam_policies = false."
  value       = try(aws_iam_policy.gc[0].arn, null)
}

output "replica_policy_json" {
  description = "The replicas' IAM policy document, to attach elsewhere (e.g. an inline role policy)."
  value       = local.replica_policy_json
}

output "gc_policy_json" {
  description = "The gc job's IAM policy document."
  value       = local.gc_policy_json
}

output "vpc_endpoint_id" {
  description = "ID of the gateway VPC endpoint (null without vpc_id)."
  value       = try(aws_vpc_endpoint.this[0].id, null)
}

output "kv_transfer_config" {
  description = "JSON for `vllm serve --kv-transfer-config` (and `s3kv gc --config`): the S3KVConnector with this bucket, prefix and region."
  value       = module.kv_transfer_config.json
}

output "kv_connector_extra_config" {
  description = "The `kv_connector_extra_config` object of kv_transfer_config."
  value       = module.kv_transfer_config.kv_connector_extra_config
}
