"""Prefect flows that wire clawpipe's library stages into scheduled, retried, tracked runs."""
