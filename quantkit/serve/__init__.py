"""Serving with vLLM: the plugin vLLM loads in each of its processes, and our vLLM model classes."""
