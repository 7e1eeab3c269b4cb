variable "region" {
  description = "AWS region of the bucket (and of the fleet that uses it)."
  type        = string
  default     = "us-west-2"
}

variable "bucket_name" {
  description = "Name of the bucket; bucket names are global, so include something of your own (e.g. `acme-prod-s3kv`)."
  type        = string
}

variable "prefix" {
  description = "Key prefix of the cache inside the bucket."
  type        = string
  default     = "s3kv"
}

variable "vpc_id" {
  description = "VPC of the fleet, for an S3 gateway endpoint. Null: none."
  type        = string
  default     = null
}

variable "route_table_ids" {
  description = "Route tables of the fleet's subnets (with vpc_id)."
  type        = list(string)
  default     = []
}
