"""Pure policy modules: inputs in, decision out, no I/O, no clock reads (DESIGN §5).

The live services and the simulator (`loadgen/sim`) call the same code.
"""
