"""The object-storage tests use a real S3-compatible server (moto) on loopback and a bucket per test: the
``s3_server`` and ``s3_bucket`` fixtures of tests/conftest.py (one server per session: s3fs caches its
filesystems by their arguments, so a second server in one session would be reached through the first's)."""
