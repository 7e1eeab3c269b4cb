"""The worker side's floor: what runs in each vLLM worker process.

The transfer engine carries a step plan's loads and stores between the KV
pages and the tiers' handlers; the host pool stages them.
"""
