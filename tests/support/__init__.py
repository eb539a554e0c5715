"""Helpers shared by the test tiers: clusters, servers, tiny models, fixtures data."""
