# A bucket for s3kv, with the replica and gc IAM policies to attach to
# whatever runs vLLM (instance profiles, ECS task roles, IAM Roles Anywhere).

provider "aws" {
  region = var.region

  default_tags {
    tags = {
      Application = "s3kv"
    }
  }
}

module "s3kv" {
  source = "../../modules/s3kv"

  bucket_name = var.bucket_name
  prefix      = var.prefix

  # Backstop behind `s3kv gc`: nothing under the prefix outlives 30 days.
  expiration_days = 30

  vpc_id          = var.vpc_id
  route_table_ids = var.route_table_ids

  connector_extra_config = {
    cpu_bytes = "16GiB"
  }
}
