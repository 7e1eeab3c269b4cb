variable "bucket" {
  description = "Name of the bucket that holds the shared cache."
  type        = string
  nullable    = false
}

variable "prefix" {
  description = "Key prefix inside the bucket (same rules as s3kv's `prefix` key)."
  type        = string
  nullable    = false

  # Same rule as the s3kv module's `prefix` variable (a test keeps the two equal)
  # and as `_prefix` in s3kv/config.py, minus the slashes s3kv would strip.
  validation {
    condition = (
      can(regex("^[A-Za-z0-9._=-]+(/[A-Za-z0-9._=-]+)*$", var.prefix)) &&
      alltrue([for segment in split("/", var.prefix) : !contains([".", ".."], segment)])
    )
    error_message = "prefix: use segments of letters, digits and . _ - = separated by single slashes, with no leading or trailing slash and no \".\" or \"..\" segment (e.g. \"s3kv\" or \"prod/llama-8b\")."
  }
}

variable "region" {
  description = "AWS region of the bucket."
  type        = string
  nullable    = false
}

variable "kv_role" {
  description = "vLLM's `kv_role`. s3kv replicas both store and load: `kv_both`."
  type        = string
  default     = "kv_both"
  nullable    = false

  validation {
    condition     = contains(["kv_both", "kv_producer", "kv_consumer"], var.kv_role)
    error_message = "kv_role: must be kv_both, kv_producer or kv_consumer."
  }
}

variable "kv_load_failure_policy" {
  description = "vLLM's `kv_load_failure_policy`. `recompute` (the default here) recomputes the tokens of a chunk that is missing, corrupt or late; vLLM's own default `fail` fails the request."
  type        = string
  default     = "recompute"
  nullable    = false

  validation {
    condition     = contains(["recompute", "fail"], var.kv_load_failure_policy)
    error_message = "kv_load_failure_policy: must be recompute or fail."
  }
}

variable "extra_config" {
  description = "More s3kv keys for `kv_connector_extra_config` (e.g. `{ cpu_bytes = \"16GiB\", disk_path = \"/nvme/s3kv\" }`). Keys must be s3kv config keys; bucket, prefix and region come from this module."
  type        = any
  default     = {}
  nullable    = false

  validation {
    condition     = can(keys(var.extra_config))
    error_message = "extra_config: must be a map (an object) of s3kv config keys to values."
  }
}
