"""Policy serving: the default local policy, clawpipe's batching engine, and the vLLM launcher.

Heavy modules (torch/transformers) are imported by submodules only; importing this package is cheap.
"""
