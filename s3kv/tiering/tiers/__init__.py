"""The tiers below vLLM's KV cache, one module each (manager and handler together).

A new tier is one module here with a manager and a handler, registered below.
"""
