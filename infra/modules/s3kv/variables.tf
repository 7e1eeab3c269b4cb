################################################################################
# Bucket
################################################################################

variable "bucket_name" {
  description = "Name of the general purpose bucket, or the base name of the directory bucket (the module appends `--<availability_zone_id>--x-s3`)."
  type        = string
  nullable    = false

  validation {
    condition = (
      can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name)) &&
      !strcontains(var.bucket_name, "..") &&
      !can(regex("^\\d+\\.\\d+\\.\\d+\\.\\d+$", var.bucket_name))
    )
    error_message = "bucket_name: 3-63 characters of lowercase letters, digits, dots and hyphens, starting and ending with a letter or digit, no \"..\", not an IP address."
  }
}

variable "bucket_type" {
  description = "`general-purpose` (the default: regional, multi-AZ, the full S3 feature set) or `directory` (S3 Express One Zone: single-digit-millisecond reads for a fleet that lives in one Availability Zone). See the README for what differs."
  type        = string
  default     = "general-purpose"
  nullable    = false

  validation {
    condition     = contains(["general-purpose", "directory"], var.bucket_type)
    error_message = "bucket_type: must be general-purpose or directory."
  }
}

variable "availability_zone_id" {
  description = "Availability Zone ID (e.g. `usw2-az1`, not the name `us-west-2a`) of a directory bucket; put the fleet's nodes in the same zone. Required when `bucket_type = \"directory\"`, ignored otherwise."
  type        = string
  default     = null

  validation {
    condition     = var.availability_zone_id == null || can(regex("^[a-z0-9]+-az[0-9]+$", coalesce(var.availability_zone_id, "x")))
    error_message = "availability_zone_id: an Availability Zone ID such as usw2-az1 (aws ec2 describe-availability-zones shows ZoneId)."
  }
}

variable "prefix" {
  description = "Key prefix of every s3kv object (s3kv's `prefix` key). IAM policies are scoped to it, so several fleets can share a bucket with one prefix each."
  type        = string
  default     = "s3kv"
  nullable    = false

  # The rule of `_prefix` in s3kv/config.py, written the canonical way: s3kv
  # strips leading and trailing slashes, IAM resource ARNs must not have them.
  # Kept equal to the kv-transfer-config module's rule by a test.
  validation {
    condition = (
      can(regex("^[A-Za-z0-9._=-]+(/[A-Za-z0-9._=-]+)*$", var.prefix)) &&
      alltrue([for segment in split("/", var.prefix) : !contains([".", ".."], segment)])
    )
    error_message = "prefix: use segments of letters, digits and . _ - = separated by single slashes, with no leading or trailing slash and no \".\" or \"..\" segment (e.g. \"s3kv\" or \"prod/llama-8b\")."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds objects. The cache is rebuildable, but the default keeps a mistaken destroy from emptying it."
  type        = bool
  default     = false
  nullable    = false
}

variable "tags" {
  description = "Tags for the resources that take them (the directory bucket does not)."
  type        = map(string)
  default     = {}
  nullable    = false
}

################################################################################
# Encryption
################################################################################

variable "sse_algorithm" {
  description = "Encryption at rest: `AES256` (SSE-S3, the default: no per-request KMS cost or KMS request quota on the load path) or `aws:kms` (SSE-KMS with `kms_key_arn`, or a key the module creates). S3 Bucket Keys are on with SSE-KMS, so KMS is called per bucket key, not per chunk."
  type        = string
  default     = "AES256"
  nullable    = false

  validation {
    condition     = contains(["AES256", "aws:kms"], var.sse_algorithm)
    error_message = "sse_algorithm: must be AES256 (SSE-S3) or aws:kms (SSE-KMS)."
  }
}

variable "kms_key_arn" {
  description = "ARN of an existing customer managed KMS key for `sse_algorithm = \"aws:kms\"`. Null: the module creates one (rotation on). Directory buckets take only customer managed keys, and one key for the bucket's lifetime."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/.+$", coalesce(var.kms_key_arn, "x")))
    error_message = "kms_key_arn: a KMS key ARN (arn:aws:kms:REGION:ACCOUNT:key/ID); aliases are not accepted in IAM policies."
  }
}

variable "kms_key_deletion_window_in_days" {
  description = "Waiting period before a key created by the module is deleted (7-30 days)."
  type        = number
  default     = 30
  nullable    = false

  validation {
    condition     = var.kms_key_deletion_window_in_days >= 7 && var.kms_key_deletion_window_in_days <= 30
    error_message = "kms_key_deletion_window_in_days: between 7 and 30."
  }
}

################################################################################
# Lifecycle, versioning, logging, events
################################################################################

variable "expiration_days" {
  description = "Backstop: expire every object under the prefix this many days after it was written. Null (default): no expiry; `s3kv gc` is the primary policy because it knows when chunks were last used, which lifecycle rules do not. Set it larger than gc's max age."
  type        = number
  default     = null

  validation {
    condition     = var.expiration_days == null || try(var.expiration_days >= 1 && floor(var.expiration_days) == var.expiration_days, false)
    error_message = "expiration_days: a whole number of days, at least 1, or null for no expiry."
  }
}

variable "versioning_enabled" {
  description = "Turn on S3 Versioning (general purpose buckets only). Off by default: chunks are immutable, content-addressed and written create-only, so there is nothing to roll back, and versions would only keep deleted chunks billable."
  type        = bool
  default     = false
  nullable    = false
}

variable "access_log_bucket" {
  description = "Name of an existing bucket that receives S3 server access logs for this bucket (general purpose buckets only; directory buckets log through CloudTrail data events). Null: no access logs."
  type        = string
  default     = null

  validation {
    condition     = var.access_log_bucket == null || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", coalesce(var.access_log_bucket, "xxx")))
    error_message = "access_log_bucket: a bucket name."
  }
}

variable "access_log_prefix" {
  description = "Key prefix of the access logs in `access_log_bucket`. Default: `<bucket name>/`."
  type        = string
  default     = null
}

variable "eventbridge_enabled" {
  description = "Send the bucket's S3 events to Amazon EventBridge (general purpose buckets only), e.g. to alarm on deletes outside `s3kv gc`."
  type        = bool
  default     = false
  nullable    = false
}

################################################################################
# IAM
################################################################################

variable "create_iam_policies" {
  description = "Create the two IAM managed policies (replicas, gc job). Their JSON is an output either way."
  type        = bool
  default     = true
  nullable    = false
}

variable "iam_policy_name_prefix" {
  description = "Prefix of the IAM policy names (`<prefix>replica`, `<prefix>gc`). Default: `s3kv-<bucket name>-`."
  type        = string
  default     = null

  validation {
    condition     = var.iam_policy_name_prefix == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,100}$", coalesce(var.iam_policy_name_prefix, "x")))
    error_message = "iam_policy_name_prefix: up to 100 letters, digits and + = , . @ _ -."
  }
}

variable "replica_delete_enabled" {
  description = "Let replicas delete any object under the prefix (s3kv deletes a chunk it found corrupt, so a later store rewrites it). Off by default: replicas can delete only old manifest snapshots; a replica that finds a chunk corrupt then reports it bad in the manifest instead, so the fleet stops offering it (one failed load per replica), and `s3kv gc` deletes it."
  type        = bool
  default     = false
  nullable    = false
}

variable "replica_create_only" {
  description = "Deny replicas any write under the prefix that could overwrite an object: every PutObject and CompleteMultipartUpload must carry `If-None-Match: *` (s3kv writes all its objects that way). Enforces the immutability the no-versioning default relies on."
  type        = bool
  default     = true
  nullable    = false
}

variable "allow_head_bucket" {
  description = "Allow `s3:ListBucket` without a prefix condition, which S3's HeadBucket needs (it carries no `s3:prefix`); s3kv calls HeadBucket at start-up to check the bucket. It also allows a prefix-less listing of the bucket's key names (not their content): in a bucket shared by several fleets, set false once s3kv's start-up check no longer uses HeadBucket."
  type        = bool
  default     = true
  nullable    = false
}

################################################################################
# Network
################################################################################

variable "vpc_id" {
  description = "VPC in which to create a gateway endpoint for S3 (for a directory bucket: for S3 Express), so KV traffic bypasses NAT gateways and their per-GB charge. Null: no endpoint (e.g. the VPC has one already; a route table can route to only one gateway endpoint per service)."
  type        = string
  default     = null

  validation {
    condition     = var.vpc_id == null || can(regex("^vpc-[0-9a-f]+$", coalesce(var.vpc_id, "x")))
    error_message = "vpc_id: a VPC ID (vpc-...)."
  }
}

variable "route_table_ids" {
  description = "Route tables of the fleet's subnets that get a route to the gateway endpoint. Required with `vpc_id`."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for id in var.route_table_ids : can(regex("^rtb-[0-9a-f]+$", id))])
    error_message = "route_table_ids: route table IDs (rtb-...)."
  }
}

variable "vpc_endpoint_policy" {
  description = "Endpoint policy (JSON) of the gateway endpoint. Null: full access, like an endpoint created in the console; the endpoint serves all S3 traffic of those route tables (ECR image layers, for one), so a policy that allows only this bucket would break other workloads."
  type        = string
  default     = null

  validation {
    condition     = var.vpc_endpoint_policy == null || can(jsondecode(coalesce(var.vpc_endpoint_policy, "{}")))
    error_message = "vpc_endpoint_policy: a JSON policy document."
  }
}

################################################################################
# Connector config
################################################################################

variable "kv_role" {
  description = "vLLM's `kv_role` in the `kv_transfer_config` output."
  type        = string
  default     = "kv_both"
  nullable    = false

  validation {
    condition     = contains(["kv_both", "kv_producer", "kv_consumer"], var.kv_role)
    error_message = "kv_role: must be kv_both, kv_producer or kv_consumer."
  }
}

variable "kv_load_failure_policy" {
  description = "vLLM's `kv_load_failure_policy` in the `kv_transfer_config` output: `recompute` (default) recomputes what could not be loaded; vLLM's own default `fail` fails the request."
  type        = string
  default     = "recompute"
  nullable    = false

  validation {
    condition     = contains(["recompute", "fail"], var.kv_load_failure_policy)
    error_message = "kv_load_failure_policy: must be recompute or fail."
  }
}

variable "connector_extra_config" {
  description = "More s3kv keys for `kv_connector_extra_config` in the `kv_transfer_config` output, e.g. `{ cpu_bytes = \"16GiB\", disk_path = \"/nvme/s3kv\" }`. Unknown keys fail the plan."
  type        = any
  default     = {}
  nullable    = false

  validation {
    condition     = can(keys(var.connector_extra_config))
    error_message = "connector_extra_config: must be a map (an object) of s3kv config keys to values; the keys are checked against s3kv's at plan time."
  }
}
