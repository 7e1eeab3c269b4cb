"""The scheduler side's floor: what runs in vLLM's scheduler process.

The planner turns vLLM's scheduler hooks into step plans; the tier stack,
the rank tally, the chain keys, the cost model (with the work in flight it
weighs a load against), the prefetcher and each request's state serve it.
The runtime starts them (the model's identity, the tiers for its
namespace, the manifest) and shuts them down. Nothing here touches KV pages.
"""
