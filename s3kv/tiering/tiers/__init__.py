"""The tiers below vLLM's KV cache, a wing (package) each: cpu/, nvme/, s3/.

A wing holds its tier's :class:`~s3kv.tiering.tiers.spec.TierSpec` (spec.py),
its scheduler-side manager (manager.py) and its worker-side handler
(handler.py); :mod:`s3kv.tiering.tiers.registry` lists the specs, nearest
first. The abstract halves are :mod:`.manager` and :mod:`.handler`.
"""
