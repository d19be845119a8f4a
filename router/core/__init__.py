"""Foundations of the router every layer may use: settings (and the defaults the state and log share), structured logs, metrics, the start clock."""
