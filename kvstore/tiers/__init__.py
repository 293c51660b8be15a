"""Storage tiers of the KV store; ``base`` holds the contract every tier implements."""
