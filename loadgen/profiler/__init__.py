"""`tidal profile`: the simulator's cost models measured on the real engine and fitted."""
