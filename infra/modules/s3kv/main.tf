data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  directory = var.bucket_type == "directory"
  region    = data.aws_region.current.region
  partition = data.aws_partition.current.partition

  bucket_name = local.directory ? "${var.bucket_name}--${coalesce(var.availability_zone_id, "unset")}--x-s3" : var.bucket_name
  bucket_id   = local.directory ? aws_s3_directory_bucket.this[0].bucket : aws_s3_bucket.this[0].id
  bucket_arn  = local.directory ? aws_s3_directory_bucket.this[0].arn : aws_s3_bucket.this[0].arn

  # Object ARNs, all under the prefix (the object layout is in the README).
  prefix_objects  = "${local.bucket_arn}/${var.prefix}/*"
  manifest_object = "${local.bucket_arn}/${var.prefix}/*/manifest/*"
  snapshot_object = "${local.bucket_arn}/${var.prefix}/*/manifest/snap/*"
  gc_lock_object  = "${local.bucket_arn}/${var.prefix}/gc.lock"

  create_kms_key = var.sse_algorithm == "aws:kms" && var.kms_key_arn == null
  kms_key_arn    = var.sse_algorithm != "aws:kms" ? null : (local.create_kms_key ? aws_kms_key.this[0].arn : var.kms_key_arn)

  policy_name_prefix = coalesce(var.iam_policy_name_prefix, "s3kv-${var.bucket_name}-")

  replica_policy_json = local.directory ? data.aws_iam_policy_document.replica_express[0].json : data.aws_iam_policy_document.replica[0].json
  gc_policy_json      = local.directory ? data.aws_iam_policy_document.gc_express[0].json : data.aws_iam_policy_document.gc[0].json
}

################################################################################
# General purpose bucket
################################################################################

# Trivy reads ignore comments only directly above a block. Reasons:
# AVD-AWS-0089: access logs are optional (var.access_log_bucket), see CKV_AWS_18 below.
# AVD-AWS-0090: versioning is off on purpose (var.versioning_enabled), see CKV_AWS_21 below.
# AVD-AWS-0132: SSE-S3 is the default on purpose (var.sse_algorithm), see CKV_AWS_145 below.
#trivy:ignore:AVD-AWS-0089
#trivy:ignore:AVD-AWS-0090
#trivy:ignore:AVD-AWS-0132
resource "aws_s3_bucket" "this" {
  count = local.directory ? 0 : 1

  #checkov:skip=CKV_AWS_18:Server access logs are optional (var.access_log_bucket); a cache bucket serves millions of ranged GETs whose logs would cost more than they tell, and the connector's own metrics count every request.
  #checkov:skip=CKV_AWS_21:Versioning is optional (var.versioning_enabled) and off on purpose: chunks are immutable, content-addressed and written create-only, so versions would only keep deleted chunks billable (README).
  #checkov:skip=CKV_AWS_144:No cross-region replication: the bucket is a cache that replicas rebuild by computing, and replication needs versioning; a fleet in another region gets its own bucket.
  #checkov:skip=CKV_AWS_145:SSE-S3 is the default on purpose; SSE-KMS is one variable away (var.sse_algorithm = "aws:kms") and adds KMS requests and quota to the load path.
  #checkov:skip=CKV2_AWS_62:Event notifications are optional (var.eventbridge_enabled); nothing consumes events of a cache by default.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_public_access_block" "this" {
  count = local.directory ? 0 : 1

  bucket                  = aws_s3_bucket.this[0].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  count = local.directory ? 0 : 1

  bucket = aws_s3_bucket.this[0].id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_versioning" "this" {
  count = !local.directory && var.versioning_enabled ? 1 : 0

  bucket = aws_s3_bucket.this[0].id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_logging" "this" {
  count = !local.directory && var.access_log_bucket != null ? 1 : 0

  bucket        = aws_s3_bucket.this[0].id
  target_bucket = var.access_log_bucket
  target_prefix = coalesce(var.access_log_prefix, "${var.bucket_name}/")
}

resource "aws_s3_bucket_notification" "this" {
  count = !local.directory && var.eventbridge_enabled ? 1 : 0

  bucket      = aws_s3_bucket.this[0].id
  eventbridge = true
}

################################################################################
# S3 Express One Zone directory bucket
#
# Always private: every Block Public Access setting is on and Object Ownership
# is BucketOwnerEnforced, neither can be changed (so there are no resources
# for them). No versioning, server access logs or event notifications exist
# for directory buckets. Access is granted per bucket only (s3express:CreateSession),
# never per prefix.
################################################################################

resource "aws_s3_directory_bucket" "this" {
  count = local.directory ? 1 : 0

  bucket          = local.bucket_name
  data_redundancy = "SingleAvailabilityZone"
  force_destroy   = var.force_destroy
  type            = "Directory"

  location {
    name = coalesce(var.availability_zone_id, "unset")
    type = "AvailabilityZone"
  }

  # No tags: not every provider version 6.x takes them on directory buckets.

  lifecycle {
    precondition {
      condition     = var.availability_zone_id != null
      error_message = "availability_zone_id: required for a directory bucket (bucket_type = \"directory\")."
    }
    precondition {
      condition     = length(local.bucket_name) <= 63 && !strcontains(var.bucket_name, ".")
      error_message = "bucket_name: a directory bucket's name (base--zone--x-s3) must fit 63 characters, without dots."
    }
    precondition {
      condition     = !var.versioning_enabled && var.access_log_bucket == null && !var.eventbridge_enabled
      error_message = "versioning_enabled, access_log_bucket and eventbridge_enabled: directory buckets support none of them."
    }
  }
}

################################################################################
# Encryption at rest: SSE-S3 by default, SSE-KMS with a given or created key
################################################################################

resource "aws_kms_key" "this" {
  count = local.create_kms_key ? 1 : 0

  description             = "s3kv KV cache in ${local.bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_key_deletion_window_in_days
  policy                  = data.aws_iam_policy_document.kms[0].json
  tags                    = var.tags
}

# AWS's default key policy: the account administers the key, and IAM policies
# (the replica and gc policies below) grant its use.
data "aws_iam_policy_document" "kms" {
  count = local.create_kms_key ? 1 : 0

  #checkov:skip=CKV_AWS_109:A key policy's Resource "*" is this key alone; the account-root statement is AWS's default key policy, without which the key can become unmanageable.
  #checkov:skip=CKV_AWS_111:Same statement as CKV_AWS_109: a key policy scoped to its own key, administered by the account.
  #checkov:skip=CKV_AWS_356:In a key policy "*" can only mean the key the policy is attached to.
  statement {
    sid       = "AccountAdministersKey"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  count = local.directory ? 0 : 1

  bucket = aws_s3_bucket.this[0].id

  rule {
    # S3 Bucket Keys: KMS is called once per bucket key instead of once per
    # object (no effect with SSE-S3).
    bucket_key_enabled = var.sse_algorithm == "aws:kms"

    apply_server_side_encryption_by_default {
      sse_algorithm     = var.sse_algorithm
      kms_master_key_id = local.kms_key_arn
    }
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "directory" {
  count = local.directory ? 1 : 0

  bucket = aws_s3_directory_bucket.this[0].bucket

  rule {
    # Directory buckets require Bucket Keys on.
    bucket_key_enabled = true

    apply_server_side_encryption_by_default {
      sse_algorithm     = var.sse_algorithm
      kms_master_key_id = local.kms_key_arn
    }
  }
}

################################################################################
# Lifecycle
#
# The abort rule: a multipart upload (s3kv uses them for objects of 32 MiB and
# more) that a crashed replica left behind costs storage until it is aborted.
#
# The expiry rule is a backstop only: `s3kv gc`, which knows when chunks were
# last used, is the primary eviction policy. Lifecycle filters match a literal
# key prefix, so it covers everything under the prefix (descriptors and
# manifest objects too; replicas recreate what they need).
################################################################################

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  count = local.directory ? 0 : 1

  #checkov:skip=CKV_AWS_300:False positive: checkov drops the static abort rule when a dynamic rule block sits beside it; tests/infra asserts the abort rule (1 day, whole bucket).
  bucket = aws_s3_bucket.this[0].id

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }

  dynamic "rule" {
    for_each = var.expiration_days == null ? [] : [var.expiration_days]

    content {
      id     = "expire-after-${rule.value}-days"
      status = "Enabled"

      filter {
        prefix = "${var.prefix}/"
      }

      expiration {
        days = rule.value
      }
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "directory" {
  count = local.directory ? 1 : 0

  #checkov:skip=CKV_AWS_300:False positive, as for the general purpose bucket's lifecycle configuration above.
  bucket = aws_s3_directory_bucket.this[0].bucket

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }

  dynamic "rule" {
    for_each = var.expiration_days == null ? [] : [var.expiration_days]

    content {
      id     = "expire-after-${rule.value}-days"
      status = "Enabled"

      filter {
        prefix = "${var.prefix}/"
      }

      expiration {
        days = rule.value
      }
    }
  }

  # S3 Lifecycle acts on a directory bucket through a session that the bucket
  # policy grants it.
  depends_on = [aws_s3_bucket_policy.directory]
}

################################################################################
# Bucket policies
################################################################################

resource "aws_s3_bucket_policy" "this" {
  count = local.directory ? 0 : 1

  bucket = aws_s3_bucket.this[0].id
  policy = data.aws_iam_policy_document.bucket[0].json

  # Put Block Public Access in place first: S3 rejects policy changes that
  # race with it.
  depends_on = [aws_s3_bucket_public_access_block.this]
}

data "aws_iam_policy_document" "bucket" {
  count = local.directory ? 0 : 1

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [local.bucket_arn, "${local.bucket_arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid       = "DenyTLSBelow12"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [local.bucket_arn, "${local.bucket_arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "directory" {
  count = local.directory ? 1 : 0

  bucket = aws_s3_directory_bucket.this[0].bucket
  policy = data.aws_iam_policy_document.bucket_express[0].json
}

data "aws_iam_policy_document" "bucket_express" {
  count = local.directory ? 1 : 0

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3express:*"]
    resources = [local.bucket_arn]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  # Without it the lifecycle rules of a directory bucket do nothing: S3
  # Lifecycle deletes and aborts through a ReadWrite session like any client.
  statement {
    sid       = "AllowS3LifecycleSession"
    actions   = ["s3express:CreateSession"]
    resources = [local.bucket_arn]

    principals {
      type        = "Service"
      identifiers = ["lifecycle.s3.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "s3express:SessionMode"
      values   = ["ReadWrite"]
    }
  }
}

################################################################################
# IAM: replicas (vLLM pods) and the gc job, general purpose bucket
################################################################################

data "aws_iam_policy_document" "replica" {
  count = local.directory ? 0 : 1

  # ListObjectsV2 with Prefix (manifest segments, snapshots).
  statement {
    sid       = "ListPrefix"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.prefix}/*"]
    }
  }

  # HeadBucket (s3kv's start-up check) is authorized as s3:ListBucket and has
  # no s3:prefix at all, so ListPrefix never matches it.
  dynamic "statement" {
    for_each = var.allow_head_bucket ? [1] : []

    content {
      sid       = "HeadBucket"
      actions   = ["s3:ListBucket"]
      resources = [local.bucket_arn]

      condition {
        test     = "Null"
        variable = "s3:prefix"
        values   = ["true"]
      }
    }
  }

  # Ranged GETs and HEADs, create-only PUTs, multipart uploads (PutObject
  # covers create, parts and complete) and aborting one that failed.
  statement {
    sid       = "ReadWriteObjects"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"]
    resources = [local.prefix_objects]
  }

  # Replicas keep the newest manifest snapshots and delete older ones.
  statement {
    sid       = "DeleteOldSnapshots"
    actions   = ["s3:DeleteObject"]
    resources = [local.snapshot_object]
  }

  dynamic "statement" {
    for_each = var.replica_delete_enabled ? [1] : []

    content {
      sid       = "DeleteObjects"
      actions   = ["s3:DeleteObject"]
      resources = [local.prefix_objects]
    }
  }

  # Objects are immutable: a write that creates an object (PutObject,
  # CompleteMultipartUpload) must say If-None-Match: *; parts are not affected.
  dynamic "statement" {
    for_each = var.replica_create_only ? [1] : []

    content {
      sid       = "DenyOverwrite"
      effect    = "Deny"
      actions   = ["s3:PutObject"]
      resources = [local.prefix_objects]

      condition {
        test     = "Null"
        variable = "s3:if-none-match"
        values   = ["true"]
      }

      condition {
        test     = "Bool"
        variable = "s3:ObjectCreationOperation"
        values   = ["true"]
      }
    }
  }

  # The gc lease is gc's alone. A replica that created, overwrote or deleted
  # {prefix}/gc.lock could make two gc runs delete at once, so every write to
  # it (PutObject covers PUT, copy and multipart uploads; ACLs, tags,
  # retention, legal holds, versions) is denied whatever else is allowed.
  # Replicas never read it, so reads stay as they are.
  statement {
    sid    = "DenyGcLease"
    effect = "Deny"
    actions = [
      "s3:PutObject*",
      "s3:DeleteObject*",
      "s3:AbortMultipartUpload",
      "s3:RestoreObject",
    ]
    resources = [local.gc_lock_object]
  }

  dynamic "statement" {
    for_each = local.kms_key_arn == null ? [] : [local.kms_key_arn]

    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["s3.${local.region}.amazonaws.com"]
      }
    }
  }
}

data "aws_iam_policy_document" "gc" {
  count = local.directory ? 0 : 1

  statement {
    sid       = "ListPrefix"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.prefix}/*"]
    }
  }

  dynamic "statement" {
    for_each = var.allow_head_bucket ? [1] : []

    content {
      sid       = "HeadBucket"
      actions   = ["s3:ListBucket"]
      resources = [local.bucket_arn]

      condition {
        test     = "Null"
        variable = "s3:prefix"
        values   = ["true"]
      }
    }
  }

  # ListMultipartUploads has no s3:prefix condition key: it is granted on the
  # bucket, and the uploads gc aborts are limited to the prefix below.
  statement {
    sid       = "ListMultipartUploads"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [local.bucket_arn]
  }

  statement {
    sid       = "ReadDeleteObjects"
    actions   = ["s3:GetObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = [local.prefix_objects]
  }

  # gc writes only manifest objects (tombstone segments, snapshots, merged
  # access records) and its lease lock.
  statement {
    sid       = "WriteManifestAndLock"
    actions   = ["s3:PutObject"]
    resources = [local.manifest_object, local.gc_lock_object]
  }

  dynamic "statement" {
    for_each = local.kms_key_arn == null ? [] : [local.kms_key_arn]

    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["s3.${local.region}.amazonaws.com"]
      }
    }
  }
}

################################################################################
# IAM, directory bucket: one session grants every object operation on the
# whole bucket (no prefix, delete or create-only scoping is possible), so
# replicas and gc get the same ReadWrite session; give a fleet its own bucket.
# For the same reason replicas cannot be denied the gc lease ({prefix}/gc.lock)
# here: S3 Express authorizes CreateSession only, never a single object.
################################################################################

data "aws_iam_policy_document" "replica_express" {
  count = local.directory ? 1 : 0

  statement {
    sid       = "ReadWriteSession"
    actions   = ["s3express:CreateSession"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringEquals"
      variable = "s3express:SessionMode"
      values   = ["ReadWrite"]
    }
  }

  dynamic "statement" {
    for_each = local.kms_key_arn == null ? [] : [local.kms_key_arn]

    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

data "aws_iam_policy_document" "gc_express" {
  count = local.directory ? 1 : 0

  statement {
    sid       = "ReadWriteSession"
    actions   = ["s3express:CreateSession"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringEquals"
      variable = "s3express:SessionMode"
      values   = ["ReadWrite"]
    }
  }

  dynamic "statement" {
    for_each = local.kms_key_arn == null ? [] : [local.kms_key_arn]

    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_policy" "replica" {
  count = var.create_iam_policies ? 1 : 0

  name        = "${local.policy_name_prefix}replica"
  description = "s3kv replicas (vLLM): read and create KV chunks under s3://${local.bucket_name}/${var.prefix}/"
  policy      = local.replica_policy_json
  tags        = var.tags
}

resource "aws_iam_policy" "gc" {
  count = var.create_iam_policies ? 1 : 0

  name        = "${local.policy_name_prefix}gc"
  description = "s3kv gc job: list, read and delete KV chunks under s3://${local.bucket_name}/${var.prefix}/"
  policy      = local.gc_policy_json
  tags        = var.tags
}

################################################################################
# VPC gateway endpoint: S3 traffic from these route tables stays on the AWS
# network, with no NAT gateway data processing charge.
################################################################################

resource "aws_vpc_endpoint" "this" {
  count = var.vpc_id == null ? 0 : 1

  vpc_id            = var.vpc_id
  service_name      = "com.amazonaws.${local.region}.${local.directory ? "s3express" : "s3"}"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = var.route_table_ids
  policy            = var.vpc_endpoint_policy
  tags              = merge(var.tags, { Name = "s3kv-${local.bucket_name}" })

  lifecycle {
    precondition {
      condition     = length(var.route_table_ids) > 0
      error_message = "route_table_ids: a gateway endpoint needs the route tables of the fleet's subnets."
    }
  }
}

################################################################################
# The connector's config
################################################################################

module "kv_transfer_config" {
  source = "./modules/kv-transfer-config"

  bucket                 = local.bucket_name
  prefix                 = var.prefix
  region                 = local.region
  kv_role                = var.kv_role
  kv_load_failure_policy = var.kv_load_failure_policy
  extra_config           = var.connector_extra_config
}
