"""The shared block tier: sealed files published to a distributed store, fetched by name elsewhere."""
