"""Picker state: endpoints with their scraped signals, and the KV block index."""
