"""Side inputs that feed the picker's state in the background (never on the request path)."""
