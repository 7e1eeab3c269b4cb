"""The S3 tier: chunk objects shared by the fleet, and the manifest that lists them."""
