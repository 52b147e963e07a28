# Per-region buckets for one Decoupled DiLoCo deployment, with write access limited to
# what each role writes (docs/storage-layout.md has the key tree; local.writes below is
# the one list the policies are made of):
#
# - a learner writes its own keys in its own region's bucket and reads the run there;
# - the syncers read the run in every bucket and write the global versions, the ledger,
#   unit offers, fences and retention's deletes;
# - the launcher writes the run's spec, budget, pipeline settings, version 0, its lock
#   and the join tokens, and reads the run in every bucket;
# - versioning stays off: the commit protocol never overwrites a committed object, and
#   retention (storage_layout/retention.py) deletes what is no longer needed.
#
# Two regions as an example: us-east on S3, eu-west on GCS. Add a module block per region.
# The identities' keys reach the workers as the workers' own credentials (docs/deploy.md).

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.0"
    }
    google = {
      source  = "hashicorp/google"
      version = "~> 6.0"
    }
  }
}

variable "run" {
  description = "Run name: the top-level prefix in every bucket."
  type        = string
  default     = "main"
}

variable "gcp_project" {
  description = "GCP project of the eu-west bucket."
  type        = string
}

variable "learners" {
  description = "Learner id -> region, as in the run spec (diloco train deals them round-robin)."
  type        = map(string)
  default = {
    "learner-0" = "us-east"
    "learner-1" = "eu-west"
    "learner-2" = "us-east"
    "learner-3" = "eu-west"
  }
}

locals {
  # What each role writes and deletes under RUN/ in a bucket: a key, or a prefix (ending
  # in "/" or "*"). LEARNER stands for the learner's own id. tests/test_terraform.py
  # checks every write and delete the processes of real runs make against these lists,
  # and that each policy below is made of them.
  writes = {
    learner = [
      "learners/LEARNER/",    # contributions, checkpoints, leases, seqs, units, joins, heartbeat, history
      "metrics/LEARNER.json", # its status
      "members/LEARNER.json", # a joiner's slot beyond the spec's
      "units/fresh/",         # its claims of data units (exclusive creates)
      "units/returned/",      # its claims of units given back or offered
    ]
    syncer = [
      "globals/",                # the global versions
      "ledger/",                 # the merge ledger
      "units/",                  # units offered to another region's learners
      "learners/",               # fences of silent learners, their data given back, merged contributions deleted
      "metrics/syncer-*",        # its status
      "secret-fingerprint.json", # written once, by whoever holds the run secret first
    ]
    launcher = [
      "spec.json",
      "budget.json",
      "pipeline.json",
      "secret-fingerprint.json",
      "globals/",       # version 0
      "launcher/",      # the run's lock
      "metrics/",       # its status, the loss curve
      "join-tokens/",   # diloco join-token
      ".diloco-probe/", # the check that the store honours exclusive creates
    ]
  }
  # Who writes: each learner of the region, the syncers and the launcher (id -> role).
  us_east_writers = merge(
    { for id, region in var.learners : id => "learner" if region == "us-east" },
    { syncer = "syncer", launcher = "launcher" },
  )
  eu_west_writers = merge(
    { for id, region in var.learners : id => "learner" if region == "eu-west" },
    { syncer = "syncer", launcher = "launcher" },
  )
  # A role's writes as S3 resources and as a GCS condition (LEARNER: the writer's id).
  s3_writes = { for role, keys in local.writes : role => [
    for k in keys : "${aws_s3_bucket.us_east.arn}/${var.run}/${endswith(k, "/") ? "${k}*" : k}"
  ] }
  gcs_objects = "projects/_/buckets/${google_storage_bucket.eu_west.name}/objects/${var.run}"
  gcs_writes = { for role, keys in local.writes : role => join(" || ", [
    for k in keys : (endswith(k, "/") || endswith(k, "*")
      ? "resource.name.startsWith(\"${local.gcs_objects}/${trimsuffix(k, "*")}\")"
    : "resource.name == \"${local.gcs_objects}/${k}\"")
  ]) }
}

provider "aws" {
  region = "us-east-1"
}

provider "google" {
  project = var.gcp_project
  region  = "europe-west1"
}

# --- us-east: S3 ---------------------------------------------------------------------

resource "aws_s3_bucket" "us_east" {
  bucket_prefix = "diloco-us-east-"
}

resource "aws_s3_bucket_public_access_block" "us_east" {
  bucket                  = aws_s3_bucket.us_east.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_iam_user" "writer" {
  for_each = local.us_east_writers
  name     = "diloco-${var.run}-${each.key}"
}

resource "aws_iam_user_policy" "writer" {
  for_each = aws_iam_user.writer
  name     = "read-run-write-own-keys"
  user     = each.value.name
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid      = "WriteOwnKeys"
        Effect   = "Allow"
        Action   = ["s3:PutObject", "s3:DeleteObject"]
        Resource = [for r in local.s3_writes[local.us_east_writers[each.key]] : replace(r, "LEARNER", each.key)]
      },
      {
        Sid      = "ReadRun"
        Effect   = "Allow"
        Action   = ["s3:GetObject"]
        Resource = "${aws_s3_bucket.us_east.arn}/${var.run}/*"
      },
      {
        Sid       = "ListRun"
        Effect    = "Allow"
        Action    = ["s3:ListBucket"]
        Resource  = aws_s3_bucket.us_east.arn
        Condition = { StringLike = { "s3:prefix" = [var.run, "${var.run}/*"] } }
      },
    ]
  })
}

# --- eu-west: GCS --------------------------------------------------------------------

resource "google_storage_bucket" "eu_west" {
  name                        = "diloco-eu-west-${var.gcp_project}"
  location                    = "EUROPE-WEST1"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
}

resource "google_service_account" "writer" {
  for_each   = local.eu_west_writers
  account_id = "diloco-${each.key}"
}

resource "google_storage_bucket_iam_member" "reads" {
  for_each = google_service_account.writer
  bucket   = google_storage_bucket.eu_west.name
  role     = "roles/storage.objectViewer"
  member   = "serviceAccount:${each.value.email}"
}

# objectAdmin, not objectCreator: a learner overwrites its status and heartbeat and prunes
# its checkpoints; the condition keeps each writer to its own keys.
resource "google_storage_bucket_iam_member" "writes" {
  for_each = google_service_account.writer
  bucket   = google_storage_bucket.eu_west.name
  role     = "roles/storage.objectAdmin"
  member   = "serviceAccount:${each.value.email}"
  condition {
    title      = "own-keys-only"
    expression = replace(local.gcs_writes[local.eu_west_writers[each.key]], "LEARNER", each.key)
  }
}

output "regions" {
  description = "Pass to diloco train as --region NAME=URL (us-east first: the syncers' home)."
  value = {
    "us-east" = "s3://${aws_s3_bucket.us_east.bucket}"
    "eu-west" = "gs://${google_storage_bucket.eu_west.name}"
  }
}
