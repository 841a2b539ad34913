"""Discrete-event simulation of Tidal workers driven by the live routing policies."""
