output "bucket_name" {
  description = "The bucket."
  value       = module.s3kv.bucket_name
}

output "replica_policy_arn" {
  description = "Attach to the role that runs vLLM."
  value       = module.s3kv.replica_policy_arn
}

output "gc_policy_arn" {
  description = "Attach to the role that runs `s3kv gc`."
  value       = module.s3kv.gc_policy_arn
}

output "kv_transfer_config" {
  description = "vllm serve ... --kv-transfer-config \"$(terraform output -raw kv_transfer_config)\""
  value       = module.s3kv.kv_transfer_config
}
