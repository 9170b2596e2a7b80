"""The eval service."""
