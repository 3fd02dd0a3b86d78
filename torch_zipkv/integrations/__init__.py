"""Integrations with model libraries, each imported on first use (``torch_zipkv.integrations.transformers``)."""
