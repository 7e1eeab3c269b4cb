"""The scheduler side's floor: what runs in vLLM's scheduler process.

The planner turns vLLM's scheduler hooks into step plans; the tier stack,
the rank tally, the chain keys and the cost model serve it. Nothing here
touches KV pages.
"""
