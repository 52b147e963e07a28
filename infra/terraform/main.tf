# Per-region buckets for one Decoupled DiLoCo deployment, with write access limited to
# what each role owns (docs/storage-layout.md has the key tree):
#
# - a learner may write only under RUN/learners/LEARNER/ in its own region's bucket, and
#   read the run spec and the global versions there;
# - the syncer may read everything and write RUN/globals/ and RUN/metrics/ in every bucket;
# - versioning stays off: the commit protocol never overwrites a committed object, and
#   retention (storage_layout/retention.py) deletes what is no longer needed.
#
# Two regions as an example: us-east on S3, eu-west on GCS. Add a module block per region.

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

resource "aws_iam_user" "learner" {
  for_each = { for id, region in var.learners : id => region if region == "us-east" }
  name     = "diloco-${var.run}-${each.key}"
}

resource "aws_iam_user_policy" "learner" {
  for_each = aws_iam_user.learner
  name     = "own-prefix-only"
  user     = each.value.name
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid      = "WriteOwnPrefix"
        Effect   = "Allow"
        Action   = ["s3:PutObject", "s3:GetObject", "s3:DeleteObject"]
        Resource = "${aws_s3_bucket.us_east.arn}/${var.run}/learners/${each.key}/*"
      },
      {
        Sid    = "ReadSpecGlobalsMetrics"
        Effect = "Allow"
        Action = ["s3:GetObject"]
        Resource = [
          "${aws_s3_bucket.us_east.arn}/${var.run}/spec.json",
          "${aws_s3_bucket.us_east.arn}/${var.run}/globals/*",
        ]
      },
      {
        Sid      = "WriteOwnMetrics"
        Effect   = "Allow"
        Action   = ["s3:PutObject", "s3:GetObject"]
        Resource = "${aws_s3_bucket.us_east.arn}/${var.run}/metrics/${each.key}.json"
      },
      {
        Sid      = "List"
        Effect   = "Allow"
        Action   = ["s3:ListBucket"]
        Resource = aws_s3_bucket.us_east.arn
      },
    ]
  })
}

resource "aws_iam_user" "syncer" {
  name = "diloco-${var.run}-syncer"
}

resource "aws_iam_user_policy" "syncer" {
  name = "read-all-write-globals"
  user = aws_iam_user.syncer.name
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Effect   = "Allow"
        Action   = ["s3:GetObject", "s3:ListBucket"]
        Resource = [aws_s3_bucket.us_east.arn, "${aws_s3_bucket.us_east.arn}/*"]
      },
      {
        Effect = "Allow"
        Action = ["s3:PutObject", "s3:DeleteObject"]
        Resource = [
          "${aws_s3_bucket.us_east.arn}/${var.run}/spec.json",
          "${aws_s3_bucket.us_east.arn}/${var.run}/globals/*",
          "${aws_s3_bucket.us_east.arn}/${var.run}/metrics/*",
        ]
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

resource "google_service_account" "learner" {
  for_each   = { for id, region in var.learners : id => region if region == "eu-west" }
  account_id = "diloco-${each.key}"
}

resource "google_storage_bucket_iam_member" "learner_reads" {
  for_each = google_service_account.learner
  bucket   = google_storage_bucket.eu_west.name
  role     = "roles/storage.objectViewer"
  member   = "serviceAccount:${each.value.email}"
}

resource "google_storage_bucket_iam_member" "learner_writes_own_prefix" {
  for_each = google_service_account.learner
  bucket   = google_storage_bucket.eu_west.name
  role     = "roles/storage.objectCreator"
  member   = "serviceAccount:${each.value.email}"
  condition {
    title      = "own-prefix-only"
    expression = "resource.name.startsWith(\"projects/_/buckets/${google_storage_bucket.eu_west.name}/objects/${var.run}/learners/${each.key}/\") || resource.name == \"projects/_/buckets/${google_storage_bucket.eu_west.name}/objects/${var.run}/metrics/${each.key}.json\""
  }
}

resource "google_service_account" "syncer" {
  account_id = "diloco-syncer"
}

resource "google_storage_bucket_iam_member" "syncer_reads" {
  bucket = google_storage_bucket.eu_west.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.syncer.email}"
}

resource "google_storage_bucket_iam_member" "syncer_writes_globals" {
  bucket = google_storage_bucket.eu_west.name
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.syncer.email}"
  condition {
    title      = "globals-spec-metrics"
    expression = "resource.name.startsWith(\"projects/_/buckets/${google_storage_bucket.eu_west.name}/objects/${var.run}/globals/\") || resource.name.startsWith(\"projects/_/buckets/${google_storage_bucket.eu_west.name}/objects/${var.run}/metrics/\") || resource.name == \"projects/_/buckets/${google_storage_bucket.eu_west.name}/objects/${var.run}/spec.json\""
  }
}

output "regions" {
  description = "Pass to diloco train as --region NAME=URL (us-east first: the syncers' home)."
  value = {
    "us-east" = "s3://${aws_s3_bucket.us_east.bucket}"
    "eu-west" = "gs://${google_storage_bucket.eu_west.name}"
  }
}
