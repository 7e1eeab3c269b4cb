"""The worker side's floor: what runs in each vLLM worker process.

The transfer engine carries a step plan's loads and stores between the KV
pages and the tiers' handlers, as jobs on its job loop (the loads' in
``loads``, the stores' and their byte budget in ``stores``); the host pool
stages them. The step timer times rank 0's forwards, and a refusal answers
the plans of a rank whose fleet key is not the scheduler side's. What the
worker side reports of a step's synchronous loads (``sync_loads``) and of
held requests finished sending (``sending``), and the rank's publisher of
the objects it creates (``publisher``), are its core objects too.
"""
