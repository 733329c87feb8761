"""Adapters that plug kvblock into serving engines and model libraries."""
