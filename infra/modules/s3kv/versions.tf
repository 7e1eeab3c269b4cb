terraform {
  # 1.5: check blocks, strcontains(), import blocks; the module uses nothing newer.
  required_version = ">= 1.5.7"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 6.0: data.aws_region.region (name is deprecated); directory buckets
      # with lifecycle, SSE-KMS and bucket policies are supported well before.
      version = ">= 6.0"
    }
  }
}
