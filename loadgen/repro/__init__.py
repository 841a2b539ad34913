"""Paper reproductions in the simulator (`tidal repro PAPER`): setups, runs and reports."""
