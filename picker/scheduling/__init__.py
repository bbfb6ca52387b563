"""Scheduling: profiles (filters -> weighted scorers -> picker), profile handlers, registry."""
