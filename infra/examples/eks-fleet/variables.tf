variable "region" {
  description = "AWS region of the cluster and the bucket."
  type        = string
  default     = "us-west-2"
}

variable "cluster_name" {
  description = "EKS cluster that runs the vLLM fleet; it needs an IAM OIDC provider (IRSA)."
  type        = string
}

variable "bucket_name" {
  description = "Name of the bucket (global: include something of your own)."
  type        = string
}

variable "prefix" {
  description = "Key prefix of this fleet's cache; fleets that share the bucket use different prefixes."
  type        = string
  default     = "s3kv"
}

variable "namespace" {
  description = "Kubernetes namespace of the vLLM pods and the gc CronJob."
  type        = string
  default     = "vllm"
}

variable "vllm_service_account" {
  description = "Service account of the vLLM pods."
  type        = string
  default     = "vllm"
}

variable "gc_service_account" {
  description = "Service account of the gc CronJob."
  type        = string
  default     = "s3kv-gc"
}

variable "create_vpc_endpoint" {
  description = "Create an S3 gateway endpoint on every route table of the cluster's VPC. Set false if the VPC has one already."
  type        = bool
  default     = true
}

variable "s3kv_image" {
  description = "Container image with s3kv installed: its distribution vllm-s3kv (`pip install .` in a checkout; PyPI's `s3kv` is an unrelated project). The gc job needs s3kv only, not vLLM."
  type        = string
}

variable "gc_schedule" {
  description = "Cron schedule of `s3kv gc`."
  type        = string
  default     = "17 * * * *"
}

variable "gc_args" {
  description = "Arguments after `s3kv gc --config ...`: the eviction policy."
  type        = list(string)
  default     = ["--max-age", "14d"]
}
