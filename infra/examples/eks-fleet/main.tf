# s3kv for a vLLM fleet on EKS: the bucket, a gateway endpoint in the
# cluster's VPC, and one IRSA role each for the vLLM pods and the gc CronJob.
# The Kubernetes side (service accounts, config map, CronJob) is rendered to
# the `kubernetes_manifests` output for kubectl or a GitOps repository.

provider "aws" {
  region = var.region

  default_tags {
    tags = {
      Application = "s3kv"
      Cluster     = var.cluster_name
    }
  }
}

data "aws_eks_cluster" "this" {
  name = var.cluster_name
}

data "aws_iam_openid_connect_provider" "this" {
  url = data.aws_eks_cluster.this.identity[0].oidc[0].issuer
}

data "aws_route_tables" "cluster" {
  vpc_id = data.aws_eks_cluster.this.vpc_config[0].vpc_id
}

locals {
  # IRSA condition keys are the issuer without its scheme.
  oidc_issuer = trimprefix(data.aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://")
}

module "s3kv" {
  source = "../../modules/s3kv"

  bucket_name = var.bucket_name
  prefix      = var.prefix

  # Backstop behind the gc CronJob, well above its --max-age.
  expiration_days = 30

  vpc_id          = var.create_vpc_endpoint ? data.aws_eks_cluster.this.vpc_config[0].vpc_id : null
  route_table_ids = var.create_vpc_endpoint ? data.aws_route_tables.cluster.ids : []

  connector_extra_config = {
    cpu_bytes = "16GiB"
  }
}

################################################################################
# IRSA: a role per service account, assumable only by that service account
################################################################################

data "aws_iam_policy_document" "vllm_trust" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [data.aws_iam_openid_connect_provider.this.arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${var.vllm_service_account}"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "vllm" {
  name_prefix        = "s3kv-vllm-"
  description        = "vLLM pods (${var.namespace}/${var.vllm_service_account}) using the s3kv cache in ${module.s3kv.bucket_name}"
  assume_role_policy = data.aws_iam_policy_document.vllm_trust.json
}

resource "aws_iam_role_policy_attachment" "vllm" {
  role       = aws_iam_role.vllm.name
  policy_arn = module.s3kv.replica_policy_arn
}

data "aws_iam_policy_document" "gc_trust" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [data.aws_iam_openid_connect_provider.this.arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${var.gc_service_account}"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "gc" {
  name_prefix        = "s3kv-gc-"
  description        = "s3kv gc CronJob (${var.namespace}/${var.gc_service_account}) for ${module.s3kv.bucket_name}"
  assume_role_policy = data.aws_iam_policy_document.gc_trust.json
}

resource "aws_iam_role_policy_attachment" "gc" {
  role       = aws_iam_role.gc.name
  policy_arn = module.s3kv.gc_policy_arn
}
