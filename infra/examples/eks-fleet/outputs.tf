output "bucket_name" {
  description = "The bucket."
  value       = module.s3kv.bucket_name
}

output "vllm_role_arn" {
  description = "IRSA role of the vLLM pods (eks.amazonaws.com/role-arn of their service account)."
  value       = aws_iam_role.vllm.arn
}

output "gc_role_arn" {
  description = "IRSA role of the gc CronJob."
  value       = aws_iam_role.gc.arn
}

output "kv_transfer_config" {
  description = "JSON for `vllm serve --kv-transfer-config`."
  value       = module.s3kv.kv_transfer_config
}

output "kubernetes_manifests" {
  description = "Service accounts, the config map with kv_transfer_config and the gc CronJob: terraform output -raw kubernetes_manifests | kubectl apply -f -"
  value = templatefile("${path.module}/kubernetes.yaml.tftpl", {
    namespace            = var.namespace
    vllm_service_account = var.vllm_service_account
    vllm_role_arn        = aws_iam_role.vllm.arn
    gc_service_account   = var.gc_service_account
    gc_role_arn          = aws_iam_role.gc.arn
    kv_transfer_config   = module.s3kv.kv_transfer_config
    region               = module.s3kv.region
    image                = var.s3kv_image
    schedule             = var.gc_schedule
    gc_args              = var.gc_args
  })
}
