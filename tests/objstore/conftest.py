"""Fixtures of the object-storage tests: a real S3-compatible server (moto) on loopback, a bucket per test."""

from tests.support.s3 import s3_bucket, s3_server  # noqa: F401
